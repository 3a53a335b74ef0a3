"""Node-side configuration: the local training job, a node's run options, where it lives, how long it waits.

Kept free of torch and hivemind imports so the CLI (built from these dataclasses) starts instantly; the inner
optimizer and outer settings live in `protocol/run_config.py` because peers must agree on them.

Defaults are chosen to work on a 2-core laptop CPU with the `small` preset; every field becomes a CLI option
(see `client/options.py`), so the help text here is the user's documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hetero_node.protocol.errors import ConfigError, require_ports, require_positive
from hetero_node.protocol.run_config import OptimConfig

__all__ = ["NodeConfig", "OptimConfig", "RunOptions", "SyncTimeouts", "TrainConfig"]


REACHABILITY_MODES = ("auto", "direct", "relay")
"""--reachability: how a node makes sure others can dial it (`client/swarm/reachability.py`)."""

DATA_HELP = (
    "Your text, a file or a directory: .txt, .jsonl (a 'text' field), either also as .gz or .zst, or Parquet (a 'text' "
    "column)."
)


@dataclass(frozen=True)
class ModelAndData:
    """What a local run and a swarm's run both define: the model, the batch and the data (defined once here)."""

    preset: str = field(default="small", metadata={"help": "Model preset: tiny, small, 178m, 560m or 1b."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step (per replica in a swarm)."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    seed: int = field(default=0, metadata={"help": "Seed of the initial weights and the data order."})
    data: Path | None = field(default=None, metadata={"help": DATA_HELP})
    tokenizer: Path | None = field(
        default=None, metadata={"help": "A Hugging Face tokenizer.json (default: byte-level, no file needed)."}
    )
    cache_dir: Path | None = field(
        default=None, metadata={"help": "Corpus and token cache (default: $HETERO_NODE_CACHE or ~/.cache/hetero-node)."}
    )

    def __post_init__(self) -> None:
        require_positive(self, "batch_size", "seq_len")
        if self.seed < 0:
            raise ConfigError(f"--seed must not be negative, got {self.seed}")


@dataclass(frozen=True)
class TrainConfig(ModelAndData):
    """What one process trains, on which data, for how long."""

    help_panel: ClassVar[str] = "Training"
    seq_len: int = field(default=256, metadata={"help": "Tokens per sequence."})
    steps: int = field(default=600, metadata={"help": "Total inner steps (sets the length of the cosine schedule)."})
    eval_every: int = field(default=100, metadata={"help": "Evaluate held-out loss every N inner steps."})
    eval_batches: int = field(default=8, metadata={"help": "Validation batches per evaluation."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (CUDA when available)."})
    compile: bool = field(
        default=True, metadata={"help": "torch.compile the training step on CUDA (CPU always trains eagerly)."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "steps", "eval_every", "eval_batches")


@dataclass(frozen=True)
class RunOptions(ModelAndData):
    """The model, batch and data part of the run definition (the rest: OuterConfig, OptimConfig, SparseLoCoConfig)."""

    data_shards: int = field(default=16, metadata={"help": "The corpus is cut into this many disjoint shards."})

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "data_shards")


@dataclass(frozen=True)
class NodeConfig:
    """Where this node lives and how it behaves; none of it must match other peers."""

    peers: list[str] = field(default_factory=list, metadata={"help": "Multiaddrs of peers to join through."})
    host: str = field(
        default="0.0.0.0", metadata={"help": "Interface to listen on (127.0.0.1: only this machine can reach it)."}
    )
    port: int = field(default=0, metadata={"help": "TCP port to listen on (0: any free port)."})
    identity: Path | None = field(
        default=None,
        metadata={"help": "Private key file: keeps the peer id stable (default: one in --checkpoint-dir, if given)."},
    )
    swarm_key: Path | None = field(
        default=None, metadata={"help": "A private swarm's key file (from `hetero-node swarm-key`): proves membership."}
    )
    reachability: str = field(
        default="auto",
        metadata={
            "help": "auto: ask the bootstrap to dial back, join through a relay if it cannot; direct; relay (always)."
        },
    )
    replica_id: int = field(default=-1, metadata={"help": "Data shard of this replica (-1: derived from peer id)."})
    checkpoint_dir: Path | None = field(default=None, metadata={"help": "Checkpoint each round here; resume from it."})
    metrics: Path | None = field(default=None, metadata={"help": "Append one JSON line per round to this file."})
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Interface of the --metrics-port server: loopback unless you expose it (0.0.0.0: all)."},
    )
    metrics_port: int | None = field(
        default=None, metadata={"help": "Serve Prometheus /metrics on this port of --metrics-host (0: any free port)."}
    )
    eval_every: int = field(default=1, metadata={"help": "Evaluate held-out loss every N rounds."})
    eval_batches: int = field(default=4, metadata={"help": "Validation batches per evaluation."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto."})
    devices: str = field(
        default="",
        metadata={
            "help": "Train one full replica on several devices of this machine: all (every GPU) or a list "
            "(cuda:0,cuda:1); data parallel inside the node, one member of the swarm. Default: --device alone."
        },
    )
    compile: bool = field(
        default=True, metadata={"help": "torch.compile a full replica's training step on CUDA (CPU trains eagerly)."}
    )
    record_refresh_s: float = field(
        default=5.0, metadata={"help": "Re-publish our peer record this often; it expires after 3x this."}
    )
    settle_s: float = field(
        default=3.0, metadata={"help": "When joining, wait this long for other records before deciding a role."}
    )
    memory_gb: float | None = field(
        default=None, metadata={"help": "Memory this node may use for training (default: the device's)."}
    )
    bandwidth_mbps: float | None = field(
        default=None, metadata={"help": "Skip the bandwidth probe and advertise this rate (Mbit/s, both ways)."}
    )
    remeasure_bandwidth: bool = field(
        default=False, metadata={"help": "Measure bandwidth again instead of using this host's cached figure."}
    )
    dht_client_below_mbps: float = field(
        default=20.0,
        metadata={
            "help": "Join the DHT as a client (store and read, serve no DHT requests) when this node's upload "
            "(--bandwidth-mbps, or this host's last measurement) is below this many Mbit/s; 0: always serve."
        },
    )
    linger_s: float = field(default=3.0, metadata={"help": "Keep serving this long after the last round."})
    min_peers: int = field(
        default=1, metadata={"help": "Before the first round, wait (up to 5 min) until this many replicas are online."}
    )
    step_delay_s: float = field(
        default=0.0,
        metadata={"help": "Sleep this long after every inner step: a slower machine, for tests and labs."},
    )

    def __post_init__(self) -> None:
        require_positive(self, "eval_every", "eval_batches", "record_refresh_s", "settle_s", "min_peers")
        for name in ("memory_gb", "bandwidth_mbps"):
            value = getattr(self, name)
            if value is not None and not (0 < value < 1e6):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if not self.dht_client_below_mbps >= 0:
            raise ConfigError(f"--dht-client-below-mbps must be ≥ 0, got {self.dht_client_below_mbps}")
        if not (0 <= self.step_delay_s < 3600):
            raise ConfigError(f"--step-delay-s must be in [0, 3600), got {self.step_delay_s}")
        require_ports(self, "port", "metrics_port")
        if self.reachability not in REACHABILITY_MODES:
            raise ConfigError(f"--reachability must be one of {', '.join(REACHABILITY_MODES)}, got {self.reachability}")
        if self.linger_s < 0:
            raise ConfigError(f"--linger-s must not be negative, got {self.linger_s}")


@dataclass(frozen=True)
class SyncTimeouts:
    """How long a round waits for others; a dead or frozen peer costs at most these (hivemind pitfall C in
    ARCHITECTURE.md)."""

    help_panel: ClassVar[str] = "Timeouts"
    matchmaking_s: float = field(
        default=4.0,
        metadata={"help": "Shortest wait of a round for late members, and longest for their seals once we sealed."},
    )
    straggler_fraction: float = field(
        default=0.5,
        metadata={"help": "A round's group waits this fraction of the round's length past its deadline for members."},
    )
    round_timeout_s: float = field(default=60.0, metadata={"help": "Give up on a round's averaging after this."})
    fetch_timeout_s: float = field(default=30.0, metadata={"help": "Deadline to download peers' payloads."})
    stage_timeout_s: float = field(
        default=30.0,
        metadata={"help": "A pipeline stage that hears nothing from its neighbours this long gives up the round."},
    )
    quorum_patience: int = field(
        default=5,
        metadata={
            "help": "Rounds without a quorum before members whose records are gone stop counting towards it (a "
            "partition shorter than this cannot fork the swarm; survivors of a crash wait this long)."
        },
    )

    def __post_init__(self) -> None:
        require_positive(
            self, "matchmaking_s", "round_timeout_s", "fetch_timeout_s", "stage_timeout_s", "quorum_patience"
        )
        if not 0 <= self.straggler_fraction <= 1:
            raise ConfigError(f"--straggler-fraction must be in [0, 1], got {self.straggler_fraction}")
