"""Peer addresses as users type them (`--peers`), and what to tell a user whose node could not join through them."""

from __future__ import annotations

from pathlib import Path

from hetero_node.protocol.errors import PeerAddressError

EXAMPLE_PEER_MULTIADDR = "/ip4/1.2.3.4/tcp/31337/p2p/QmXa9QgKi..."
"""How a peer's address looks in messages (hetero-node's RSA keys give Qm… peer ids)."""


def parse_peer_multiaddrs(addresses: list[str]) -> list[str]:
    """Validate `--peers` values: each must be a full multiaddr ending in /p2p/<peer id>."""
    from hivemind.utils.multiaddr import Multiaddr

    parsed = []
    for address in addresses:
        try:
            maddr = Multiaddr(address)
        except Exception as e:  # multiaddr raises several unrelated types for malformed input
            raise PeerAddressError(f"{address!r} is not a peer multiaddr like {EXAMPLE_PEER_MULTIADDR} ({e})") from None
        if "/p2p/" not in str(maddr):
            raise PeerAddressError(
                f"{address!r} lacks the /p2p/<peer id> part that names the peer: copy the whole address the "
                f"bootstrap printed, like {EXAMPLE_PEER_MULTIADDR}"
            )
        parsed.append(str(maddr))
    return parsed


def join_failure(peers: list[str], error: Exception) -> str:
    """What to tell a user whose node could not start through `peers`: p2pd says only "Daemon failed to start"
    when no peer answered, which reads like a local fault."""
    if "failed to connect to bootstrap peers" not in str(error):
        return f"could not join the swarm through {peers}: {error}"
    return (
        f"no peer answered at {', '.join(peers)}: check that the bootstrap is running, that the address (host, port "
        "and /p2p/ id) is exactly the line it printed, and that no firewall between here and there blocks that TCP "
        "port (`hetero-node doctor --peers ...` checks the way)"
    )


IDENTITY_TAKEN = "is already taken by another peer"
"""How hivemind's check_if_identity_free says that a live peer of the swarm answers to this key's peer id."""


def identity_taken(identity: Path) -> str:
    """Why a second node with a live node's key is refused: one peer id for two nodes would have each overwrite the
    other's record (and pipeline slot) in everyone's view."""
    from hivemind.p2p import PeerID

    peer = PeerID.from_identity(identity.read_bytes())
    return (
        f"{identity}: a node with this identity (peer id {peer}) is already live in the swarm; stop it first, "
        "or give this node an --identity (or --checkpoint-dir) of its own"
    )
