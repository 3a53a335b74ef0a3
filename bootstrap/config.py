"""Where a bootstrap listens and who it is; light (no hivemind import) because the CLI is built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.protocol.errors import ConfigError, require_ports


@dataclass(frozen=True)
class BootstrapConfig:
    """Where the bootstrap listens and who it is."""

    host: str = field(default="0.0.0.0", metadata={"help": "Interface to listen on."})
    port: int = field(default=31337, metadata={"help": "Fixed TCP port, so the multiaddr survives restarts."})
    identity: Path = field(
        default=Path("bootstrap.id"),
        metadata={"help": "Private key file (created if missing): fixes the peer id; the same key signs the run."},
    )
    swarm_key: Path | None = field(
        default=None,
        metadata={"help": "Make the swarm private: only peers holding this key file (`hetero-node swarm-key`) join."},
    )
    announce: str | None = field(
        default=None, metadata={"help": "Public IP or hostname to advertise (behind NAT or in Docker)."}
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Interface of the --metrics-port server: loopback unless you expose it (0.0.0.0: all)."},
    )
    metrics_port: int | None = field(
        default=None,
        metadata={"help": "Serve the swarm dashboard at / and Prometheus /metrics on this HTTP port (0: any free)."},
    )
    heartbeat_s: float = field(
        default=30.0, metadata={"help": "How often to refresh the routing table and re-publish the run."}
    )

    def __post_init__(self) -> None:
        require_ports(self, "port", "metrics_port")
        if not self.heartbeat_s > 0:
            raise ConfigError(f"--heartbeat-s must be positive, got {self.heartbeat_s}")


@dataclass(frozen=True)
class RelayConfig:
    """What this node lends to peers behind NAT: every reachable node (the bootstrap included) relays for them."""

    relay: bool = field(
        default=True,
        metadata={"help": "Relay for peers behind NAT (--no-relay: never; this node then cannot dial relayed peers, "
                  "they dial it)."},
    )  # fmt: skip
