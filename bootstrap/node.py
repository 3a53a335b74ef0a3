"""A bootstrap node: a DHT peer with a stable identity and port that everyone else joins through.

It trains nothing. Its only jobs are to be reachable at the same multiaddr across restarts (identity file +
fixed port), to keep its routing table fresh, and to print the exact line volunteers paste.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.protocol.errors import ConfigError, PeerAddressError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    """Where the bootstrap listens and who it is."""

    host: str = field(default="0.0.0.0", metadata={"help": "Interface to listen on."})
    port: int = field(default=31337, metadata={"help": "Fixed TCP port, so the multiaddr survives restarts."})
    identity: Path = field(
        default=Path("bootstrap.id"), metadata={"help": "Private key file (created if missing): fixes the peer id."}
    )
    announce: str | None = field(
        default=None, metadata={"help": "Public IP or hostname to advertise (behind NAT or in Docker)."}
    )
    heartbeat_s: float = field(default=30.0, metadata={"help": "How often to refresh the routing table."})

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")


class BootstrapNode:
    """Runs the DHT until `stop` is set; see the module docstring."""

    def __init__(self, cfg: BootstrapConfig) -> None:
        import hivemind

        self.cfg = cfg
        announce = None
        if cfg.announce:
            proto = "ip6" if ":" in cfg.announce else ("ip4" if cfg.announce.replace(".", "").isdigit() else "dns4")
            announce = [f"/{proto}/{cfg.announce}/tcp/{cfg.port}"]
        cfg.identity.parent.mkdir(parents=True, exist_ok=True)
        multiprocessing.set_start_method("fork", force=True)  # hivemind's DHT process only works when forked
        try:
            self.dht = hivemind.DHT(
                host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
                announce_maddrs=announce,
                identity_path=str(cfg.identity),
                start=True,
            )
        except Exception as e:  # port in use, unreadable identity, ...: say so in one line
            raise PeerAddressError(f"could not start the bootstrap DHT on {cfg.host}:{cfg.port}: {e}") from None
        self.stop = threading.Event()

    @property
    def join_addresses(self) -> list[str]:
        """Multiaddrs others should pass to --peers (loopback ones only when that is all there is)."""
        maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        public = [a for a in maddrs if "/127.0.0.1/" not in a]
        return public or maddrs

    def serve_forever(self) -> None:
        """Refresh the routing table periodically until stopped; always shuts the DHT (and its p2pd) down."""
        try:
            while not self.stop.wait(self.cfg.heartbeat_s):
                self.dht.run_coroutine(_refresh_routing_table)
                logger.info("bootstrap alive as %s", self.dht.peer_id)
        finally:
            self.dht.shutdown()


async def _refresh_routing_table(_dht: object, node: object) -> int:
    """A lookup of our own id touches the closest buckets, keeping the table fresh (as hivemind-dht does)."""
    await node.find_nearest_nodes([node.node_id])
    return len(node.protocol.routing_table.uid_to_peer_id)
