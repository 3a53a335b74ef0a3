"""Whether this node can be dialed, and what to do when it cannot: join through a circuit relay.

`check_reachability` asks the peers we joined through to dial us back (`protocol/reachability.py`). A node that
is not reachable restarts its daemon relayed: p2pd's auto-relay reserves a slot on those peers (the bootstrap by
default; every hetero-node peer serves as a relay unless told not to), and the node announces
`<relay>/p2p-circuit` addresses in its record. `PeerDialer` is the other half, on every peer: it connects to
peers at the addresses their records carry (relayed peers through their circuits), which puts those addresses into
the local daemon's peerstore, so fetching a peer's message or sending it activations works like any other call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hetero_node.client.swarm.work_ledger import ANSWERED, SILENT
from hetero_node.protocol.reachability import (
    ask_dial_back,
    circuit_multiaddr,
    lend_relay,
    reserve_on_trusted_relays_only,
)
from hetero_node.protocol.records import PeerRecord

if TYPE_CHECKING:
    from hetero_node.client.swarm.runtime import PeerRuntime

logger = logging.getLogger(__name__)

CIRCUIT_SUFFIX = "/p2p-circuit"
REDIAL_S = 2.0
"""Least time between two dials of one relayed peer's circuit. Its record is read every few seconds, and each read
dials it again (a no-op while connected): relays reset circuits after 128 KiB (`protocol.reachability.lend_relay`),
and the peerstore then keeps only the peer's private addresses, which nobody can dial."""
MAX_ASKED = 3
DIAL_TIMEOUT_S = 15.0
"""Longest a background dial may take. Restarted nodes of the kill soak logged dials garbage-collected mid-wait
("Task was destroyed but it is pending!": nothing held what they waited for); such a peer was then never noted as
answered or silent, nor dialed again. With the timeout the kill soak logs none."""


@dataclass
class Reachability:
    """The outcome of asking peers to dial us back; `reachable` is None when no peer answered."""

    reachable: bool | None
    ports: list[int] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)
    """Our address as the answering peers see it (behind NAT: the router's)."""
    accepted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def listen_ports(addrs: list[str]) -> list[int]:
    """TCP ports of our own (non-relayed) listen addresses."""
    ports: list[int] = []
    for addr in addrs:
        parts = addr.split("/")
        if CIRCUIT_SUFFIX not in addr and "tcp" in parts:
            port = int(parts[parts.index("tcp") + 1])
            if port not in ports:
                ports.append(port)
    return ports


def check_reachability(runtime: PeerRuntime, timeout: float = 15.0) -> Reachability:
    """Ask up to `MAX_ASKED` of the peers we joined through to dial our listen ports back."""
    from hivemind.p2p import PeerID

    result = Reachability(reachable=None, ports=listen_ports(runtime.visible_maddrs))
    for address in runtime.initial_peers[:MAX_ASKED]:
        peer = PeerID.from_base58(address.rpartition("/p2p/")[2])
        try:
            reply = runtime.run(ask_dial_back(runtime.p2p, peer, result.ports), timeout=timeout)
        except Exception as e:  # an old peer without the handler, a timeout: ask the next one
            result.errors.append(f"{address}: {e!r}"[:300])
            continue
        result.observed += [h for h in reply.observed if h not in result.observed]
        result.accepted += list(reply.reachable)
        result.reachable = bool(result.accepted)
        if result.reachable:
            break
    return result


def relay_addresses(relays: list[str]) -> list[str]:
    """The circuit addresses a relayed node announces: one through each relay."""
    return [relay + CIRCUIT_SUFFIX for relay in relays]


def reachable_runtime(start: Callable[[list[str] | None], PeerRuntime], mode: str, peers: list[str]) -> PeerRuntime:
    """A runtime others can reach: direct when the dial-back check passes (or `mode` is "direct"), else relayed
    through `peers`, the peers it joins through (`mode`: --reachability; "relay" skips the check). `start(relays)`
    makes a runtime."""
    if mode != "relay":
        runtime = start(None)
        if mode == "direct":
            return runtime
        result = check_reachability(runtime)
        if result.reachable is not False:
            if result.reachable is None:
                logger.warning(
                    "no peer answered the dial-back check (%s); assuming this node is reachable", result.errors
                )
            else:
                logger.info("reachable from outside at %s", ", ".join(result.accepted))
            return runtime
        logger.warning(
            "peers see this node at %s but cannot connect to port(s) %s (behind NAT or a firewall): joining through a "
            "relay", ", ".join(result.observed) or "?", ", ".join(map(str, result.ports)),
        )  # fmt: skip
        runtime.shutdown()
    lend_relay(False, dial_circuits=True)  # nobody can reach us to be relayed; we must be reached through one
    reserve_on_trusted_relays_only()  # a reservation at once, not after p2pd's 3-minute wait for more candidates
    runtime = start(peers)
    logger.info("relayed through %s", ", ".join(peers))
    return runtime


class PeerDialer:
    """Connects to peers at the addresses their signed records carry. p2pd finds a peer by its id alone only on a
    private LAN or loopback; elsewhere a node never connected to a peer gets "routing: not found" (issue 29: a late
    joiner could fetch no state), so every stream to a peer starts with `dial`, and each peer is also dialed as its
    record appears or its addresses change, which puts them into the daemon's peerstore for hivemind's own calls
    (the DHT) too. A relayed peer is dialed through its circuits, again at least every REDIAL_S; a relayed node
    dials every direct peer out through its NAT, and libp2p prefers that direct connection to the relayed one for
    new streams in either direction: only traffic between two relayed peers then crosses a relay."""

    def __init__(self, runtime: PeerRuntime) -> None:
        self.runtime = runtime
        self._dialed: dict[str, float] = {}
        self._addrs: dict[str, tuple[str, ...]] = {}
        """Every other peer → the addresses its record last announced (its circuits only, when it has any)."""
        self._circuits: set[str] = set()
        """Peers reachable only through a relay (their records announce circuits)."""

    def note(self, records: dict[str, PeerRecord]) -> None:
        """Learn the addresses in freshly read records, and dial the peers that are new, moved or whose last dial
        failed; relayed peers (and, from a relayed node, every peer) again every REDIAL_S, so a dropped connection
        comes back."""
        now = time.monotonic()
        for pid, record in records.items():
            if pid == str(self.runtime.peer_id):
                continue
            circuits = tuple(a for a in record.addrs if a.endswith(CIRCUIT_SUFFIX))[:4]
            addrs = circuits or tuple(record.addrs)
            moved = addrs != self._addrs.get(pid)
            self._addrs[pid] = addrs
            if circuits:
                self._circuits.add(pid)
            else:
                self._circuits.discard(pid)
            due = now - self._dialed.get(pid, -REDIAL_S) >= REDIAL_S
            if moved or (due and (circuits or self.runtime.relays or pid not in self._dialed)):
                self._dialed[pid] = now
                asyncio.run_coroutine_threadsafe(self._connect(pid), self.runtime.loop)

    def through_relay(self, pid: str) -> bool:
        """Whether `pid` is reached through a circuit relay (its record announces circuits only)."""
        return pid in self._circuits

    async def dial(self, pid: str, must_connect: bool = False) -> None:
        """Connect to `pid` at its record's addresses before opening a stream to it: a no-op while connected, a
        fresh circuit when its relay reset the last one. Raises what the daemon says when no address answers; a
        peer whose record we have not read is left to the daemon's own routing (`must_connect`: a ValueError)."""
        from hivemind.p2p import PeerID

        addrs = self._addrs.get(pid)
        if not addrs and must_connect:
            raise ValueError(f"peer {pid}'s record has no address to dial")
        if addrs:
            self._dialed[pid] = time.monotonic()
            await self.runtime.p2p._client.connect(PeerID.from_base58(pid), [_dialable(a) for a in addrs])

    async def _connect(self, pid: str) -> None:
        """Dial `pid`; a connection made is also an answered liveness challenge (`PeerRuntime.challenge`), a failed
        one a silent challenge (a record with no node behind it is left out of rounds: `WorkLedger.running`)."""
        from hivemind.utils import get_dht_time

        try:
            await asyncio.wait_for(self.dial(pid, must_connect=True), DIAL_TIMEOUT_S)
        except Exception as e:  # the relay has no reservation yet, or the peer left: try again at the next read
            logger.debug("connecting to peer %s failed: %r", pid, e)
            if self._addrs.get(pid):
                self._dialed.pop(pid, None)
                self.runtime.work.note_challenge(pid, SILENT, get_dht_time())  # until a later dial answers
            return
        self.runtime.work.note_challenge(pid, ANSWERED, get_dht_time())


def _dialable(addr: str) -> Any:
    """A record's address as p2pd's connect takes it: a circuit as `circuit_multiaddr` encodes it, a listen
    address without its /p2p/<id> part (the id travels separately)."""
    from hivemind.utils.multiaddr import Multiaddr

    if addr.endswith(CIRCUIT_SUFFIX):
        return circuit_multiaddr(addr)
    return Multiaddr(addr.partition("/p2p/")[0])
