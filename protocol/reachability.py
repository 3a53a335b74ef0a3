"""Can other peers dial this node? A dial-back check every public peer answers, and circuit-relay addresses.

A node behind a home router dials out fine but cannot be dialed, so nobody could fetch its SparseLoCo message,
load state from it or send it stage activations. To find out, a node asks a peer it is connected to (the
bootstrap) to dial it back: the peer opens a plain TCP connection to each port the node listens on, at the
address it sees the node's connection come from (never an address the asker names, so the check cannot be turned
into a port scan of third parties), and says which ports accepted. Behind NAT that address is the router's, which
has no mapping for the port: the node is not reachable and joins through a circuit relay instead
(`client/swarm/runtime.py`), announcing `<relay>/p2p-circuit` addresses that others dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from typing import Any

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.keys import KEY_PREFIX
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.rate_limit import PeerBudget

wire = load_proto_module("wire")

DIALBACK = f"{KEY_PREFIX}.dialback"
DIALBACK_TIMEOUT_S = 3.0
"""How long one dial-back connection may take before the port counts as closed."""
MAX_PORTS = 4
MAX_DIALBACKS = 6
"""Dial-back requests one peer may make per `DIALBACK_WINDOW_S`."""
DIALBACK_WINDOW_S = 600.0
P2P_CODE, CIRCUIT_CODE = 421, 290
"""Multiaddr protocol codes of /p2p and /p2p-circuit."""

_build_daemon_args: Any = None
"""hivemind's own `P2P._make_process_args`, kept when `_set_daemon_flags` first wraps it."""
_daemon_flags: dict[str, Any] = {}
"""Extra p2pd flags for every daemon this process starts (relaying on or off, relay discovery)."""


def observed_hosts(addrs: list[Any]) -> list[str]:
    """The IP addresses among a connected peer's multiaddrs (relayed connections have none of their own)."""
    hosts: list[str] = []
    for addr in addrs:
        text = str(addr)
        if "p2p-circuit" in text:
            continue
        parts = text.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


async def port_accepts(host: str, port: int, timeout: float = DIALBACK_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port is accepted within `timeout` (closed at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class DialBackServer:
    """Answers dial-back requests on a hivemind P2P, at most `MAX_DIALBACKS` per peer per window."""

    def __init__(self, p2p: Any) -> None:
        self.p2p = p2p
        self.budget = PeerBudget(MAX_DIALBACKS, DIALBACK_WINDOW_S)

    async def answer(self, request: Any, context: Any) -> Any:
        peer = str(context.remote_id)
        ports = [p for p in request.ports[:MAX_PORTS] if 0 < p < 65536]
        if not self.budget.take(peer, 1):
            raise PayloadError(f"{peer} asked for {MAX_DIALBACKS} dial-backs already; try again later")
        infos = [info for info in await self.p2p.list_peers() if str(info.peer_id) == peer]
        hosts = observed_hosts(list(infos[0].addrs) if infos else [])[:2]
        pairs = [(host, port) for host in hosts for port in ports]
        accepted = await asyncio.gather(*(port_accepts(host, port) for host, port in pairs))
        reachable = [_host_port(host, port) for (host, port), ok in zip(pairs, accepted, strict=True) if ok]
        return wire.DialBackReply(observed=hosts, reachable=reachable)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"


async def register_dialback_handler(p2p: Any) -> None:
    await p2p.add_protobuf_handler(DIALBACK, DialBackServer(p2p).answer, wire.DialBackRequest)


async def ask_dial_back(p2p: Any, peer: Any, ports: list[int]) -> Any:
    """Ask `peer` (a hivemind PeerID we are connected to) to dial our `ports`; its DialBackReply."""
    return await p2p.call_protobuf_handler(peer, DIALBACK, wire.DialBackRequest(ports=ports), wire.DialBackReply)


def circuit_multiaddr(relay: str) -> Any:
    """`relay` (`/ip4/…/tcp/…/p2p/<relay id>`, with or without a trailing /p2p-circuit) as the multiaddr of a
    circuit through it, encoded as go-libp2p reads it: hivemind's multiaddr library writes the /p2p value as a
    CID, which p2pd rejects in binary ("length greater than remaining number of bytes"), so the bytes are built
    here from the relay id's raw multihash."""
    import varint
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, _, relay_id = relay.removesuffix("/p2p-circuit").rpartition("/p2p/")
    if not base or not relay_id:
        raise PayloadError(f"not a relay address (no /p2p/<peer id>): {relay}")
    digest = PeerID.from_base58(relay_id).to_bytes()
    raw = Multiaddr(base).to_bytes() + varint.encode(P2P_CODE) + varint.encode(len(digest)) + digest
    return Multiaddr(raw + varint.encode(CIRCUIT_CODE))


def lend_relay(enabled: bool, dial_circuits: bool = False) -> None:
    """Whether this node relays for peers behind NAT, for every daemon this process (or a child forked later)
    starts. p2pd cannot bound what it relays: hivemind 1.1.12's p2pd builds its relay service from its `-relay*`
    flags and then starts a second one with go-libp2p's defaults (its `EnableRelayV2`), which takes over (measured:
    every relayed connection reset after 128 KiB each way; by go-libp2p's source the defaults also end a circuit
    after 2 minutes and allow 128 reservations and 16 circuits per peer). By its source `-relayService=0` does not
    stop that second one either; only `-relay=0` does, which also takes away the circuit transport, so a node that
    does not lend can no longer dial relayed peers (they dial out to it instead). `dial_circuits`: keep the
    transport (a node behind NAT, which nobody can reach to be relayed through anyway, needs it to be reached)."""
    if enabled or dial_circuits:
        _daemon_flags.pop("relay", None)
        _set_daemon_flags(relayService=enabled)
    else:
        _set_daemon_flags(relayService=False, relay=False)


def reserve_on_trusted_relays_only(enabled: bool = True) -> None:
    """Make p2pd's auto-relay reserve a slot on the trusted relays at once. With relay discovery on (p2pd's
    default) it feeds them to go-libp2p's auto-relay as a peer source, which waits for 4 candidates or 3 minutes
    before reserving anything: a node behind NAT had no reservation for its first 3 minutes, so two such nodes could
    not reach each other (each circuit failed with NO_RESERVATION). Static relays are reserved on as soon as the
    node runs. For every daemon this process starts from now on that is given trusted relays (`enabled` False:
    p2pd's default again)."""
    if enabled:
        _set_daemon_flags(relayDiscovery=False)
    else:
        _daemon_flags.pop("relayDiscovery", None)


def _set_daemon_flags(**flags: Any) -> None:
    """Add p2pd flags hivemind does not expose, through its daemon-argument builder (patched once)."""
    global _build_daemon_args
    from hivemind.p2p import P2P

    if _build_daemon_args is None:
        _build_daemon_args = P2P._make_process_args
        build = _build_daemon_args

        def with_flags(*args: Any, **kwargs: Any) -> list[str]:
            flags = {**kwargs, **_daemon_flags}
            if not flags.get("trustedRelays"):  # p2pd refuses auto-relay with neither discovery nor static relays
                flags.pop("relayDiscovery", None)
            return build(*args, **flags)

        P2P._make_process_args = staticmethod(with_flags)
    _daemon_flags.update(flags)
