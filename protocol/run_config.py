"""The run definition every peer of one swarm must share, and its identity.

Anything that changes what bits peers exchange or what model they train belongs here: the model preset, the
number of parameter shards, H, the outer method and its compression, the inner optimizer, seeds, and the data
and tokenizer identities. `run_id` hashes all of it; DHT keys and averaging groups are derived from it, so two
runs (or two peers that disagree on a setting) never mix their averages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from hetero_node.protocol.errors import ConfigError, require_positive
from hetero_node.protocol.outer_specs import outer_spec

PROTOCOL_VERSION = 16
"""Bumped whenever a message layout or an aggregation rule changes (16: peer records carry a measured round trip);
part of `run_id`."""

MAX_CHUNK = 64
"""Largest chunk side: in-chunk indices must fit the 12 bits of the wire format (64² = 4096)."""

AGGREGATION_RULES = ("mean", "robust")
ADMISSION_RULES = ("none", "loss")
DILOCO_WIRE_DTYPES = ("fp32", "fp16")
ACTIVATION_COMPRESSION = ("subspace", "none", "compress-all")
BOUNDARY_WIRE_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class SparseLoCoConfig:
    """Compression settings; `chunk` and `topk` shape the wire format, the rest only the sender's state."""

    chunk: int = field(default=64, metadata={"help": "Chunk side: matrices in chunk×chunk blocks, vectors in chunk²."})
    topk: int = field(default=64, metadata={"help": "Entries kept per full chunk of chunk² (density topk/chunk²)."})
    ef_decay: float = field(default=0.95, metadata={"help": "Error-feedback decay β; the buffer is outer momentum."})
    value_bits: int = field(default=2, metadata={"help": "Bits per transmitted value (only 2 is supported)."})
    range_sigmas: float = field(default=6.0, metadata={"help": "Quantizer range in σ; step = range_sigmas·σ/4."})

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ConfigError(f"chunk must be in 1..{MAX_CHUNK} (12-bit in-chunk indices), got {self.chunk}")
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ConfigError(f"topk must be in 1..chunk²={self.chunk * self.chunk}, got {self.topk}")
        if not 0.0 <= self.ef_decay <= 1.0:
            raise ConfigError(f"ef_decay must be in [0, 1], got {self.ef_decay}")
        if self.value_bits != 2:
            raise ConfigError(f"only 2-bit values are supported, got value_bits={self.value_bits}")
        if not (math.isfinite(self.range_sigmas) and self.range_sigmas > 0):
            raise ConfigError(f"range_sigmas must be a positive number, got {self.range_sigmas}")


@dataclass(frozen=True)
class OptimConfig:
    """Inner AdamW with cosine decay: the loop every replica runs between outer rounds."""

    lr: float = field(default=2e-3, metadata={"help": "Peak inner learning rate."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final LR as a fraction of the peak (cosine floor)."})
    warmup_steps: int = field(default=50, metadata={"help": "Linear LR warm-up, in inner steps."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decoupled weight decay."})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    grad_clip: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value (0: off)."})

    def __post_init__(self) -> None:
        require_positive(self, "lr")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"--beta1 and --beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if min(self.warmup_steps, self.weight_decay, self.grad_clip) < 0:
            raise ConfigError("--warmup-steps, --weight-decay and --grad-clip must not be negative")


@dataclass(frozen=True)
class OuterConfig:
    """How replicas turn H local steps into one shared outer step."""

    outer: str = field(default="sparseloco", metadata={"help": "Outer method: sparseloco or diloco (dense baseline)."})
    inner_steps: int = field(
        default=30, metadata={"help": "H: inner steps per round at the reference speed (the fastest replica's)."}
    )
    rounds: int = field(default=20, metadata={"help": "Outer rounds in the run (also sets the LR schedule length)."})
    stages: int = field(default=2, metadata={"help": "Parameter shards (= pipeline stages); one averaging group each."})
    outer_lr: float = field(default=1.0, metadata={"help": "SparseLoCo outer step size α (plain SGD, no momentum)."})
    diloco_lr: float = field(default=0.7, metadata={"help": "DiLoCo outer Nesterov learning rate."})
    diloco_momentum: float = field(default=0.9, metadata={"help": "DiLoCo outer Nesterov momentum."})
    diloco_wire: str = field(default="fp32", metadata={"help": "DiLoCo all-reduce wire dtype: fp32 or fp16."})
    aggregation: str = field(
        default="mean",
        metadata={
            "help": "How a group combines its messages: mean (token-weighted mean, per-token norm clip) or robust "
            "(every bound per tensor and per coordinate: a minority of liars cannot concentrate; see bench-byzantine). "
            "A public swarm's bootstrap announces robust unless this is given (or set in --config)."
        },
    )
    admission: str = field(
        default="none",
        metadata={
            "help": "Which selected messages a round counts: none (all that pass the claims judge and the rule) or "
            "loss (only those whose step alone lowers the loss of the run's probe data shard, as more than half of "
            "the round's members judged; needs a sparse --outer, and full replicas for more than half of a group)."
        },
    )
    max_contributors: int = field(
        default=8,
        metadata={
            "help": "K: messages a shard's round aggregates at most, a different subset each round (0: all); the "
            "others keep their Δ in their error feedback for a later round. Keeps each peer's bytes per round flat."
        },
    )
    round_s: float = field(
        default=0.0,
        metadata={
            "help": "Round length in seconds: every replica trains as many inner steps as fit (0: H steps at the "
            "fastest replica's measured speed)."
        },
    )
    target_utilisation: float = field(
        default=0.9,
        metadata={
            "help": "Rounds last long enough that training fills at least this share of a replica's time, given "
            "what a round costs outside training as measured (exchange, outer step); 0: H steps alone set the length."
        },
    )
    overlap_utilisation: float = field(
        default=0.95,
        metadata={
            "help": "--target-utilisation under --overlap, where a round costs training only its settling (apply, "
            "eval, checkpoint) and a longer round waits for no exchange; 0: H steps alone set the length."
        },
    )
    min_inner_steps: int = field(
        default=1, metadata={"help": "A replica that cannot train this many steps in a round sits it out."}
    )
    max_inner_steps: int = field(
        default=0, metadata={"help": "Stop a round's training after this many steps (0: no cap; = H and "
                             "--min-inner-steps H: every replica trains exactly H steps)."}
    )  # fmt: skip
    overlap: bool = field(
        default=False,
        metadata={"help": "Full replicas train the next round while a round's exchange runs (DiLoCoX one-step delay)."},
    )

    def __post_init__(self) -> None:
        method = outer_spec(self.outer)  # ConfigError for a method nobody registered
        if self.aggregation not in AGGREGATION_RULES:
            raise ConfigError(f"--aggregation must be one of {', '.join(AGGREGATION_RULES)}, got {self.aggregation!r}")
        if self.aggregation == "robust" and not method.sparse:
            raise ConfigError(
                f"--aggregation robust bounds sparse messages; --outer {self.outer} has only the mean rule"
            )
        if self.admission not in ADMISSION_RULES:
            raise ConfigError(f"--admission must be one of {', '.join(ADMISSION_RULES)}, got {self.admission!r}")
        if self.admission == "loss" and not method.sparse:
            raise ConfigError(f"--admission loss scores sparse messages; --outer {self.outer} has only none")
        if self.diloco_wire not in DILOCO_WIRE_DTYPES:
            raise ConfigError(f"--diloco-wire must be one of {', '.join(DILOCO_WIRE_DTYPES)}, got {self.diloco_wire!r}")
        require_positive(self, "inner_steps", "rounds", "stages", "outer_lr", "diloco_lr", "min_inner_steps")
        if self.max_contributors < 0:
            raise ConfigError(f"--max-contributors must be ≥ 0 (0: every contributor), got {self.max_contributors}")
        for name in ("target_utilisation", "overlap_utilisation"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        if not (math.isfinite(self.round_s) and self.round_s >= 0):
            raise ConfigError(f"--round-s must be ≥ 0 (0: derived from H), got {self.round_s}")
        if self.max_inner_steps < 0 or 0 < self.max_inner_steps < self.min_inner_steps:
            raise ConfigError(
                f"--max-inner-steps must be 0 (no cap) or ≥ --min-inner-steps {self.min_inner_steps}, "
                f"got {self.max_inner_steps}"
            )
        if not 0 <= self.diloco_momentum < 1:
            raise ConfigError(f"--diloco-momentum must be in [0, 1), got {self.diloco_momentum}")


@dataclass(frozen=True)
class PipelineConfig:
    """Virtual replicas: how pipeline stages split a batch and what crosses a stage boundary."""

    activation_compression: str = field(
        default="subspace",
        metadata={
            "help": "subspace (virtual replicas compress, full replicas do not), none (dense boundaries), "
            "or compress-all (every replica is a compressed virtual replica)."
        },
    )
    subspace_rank: int = field(default=0, metadata={"help": "Boundary rank k (0: d_model/8)."})
    boundary_wire: str = field(default="bf16", metadata={"help": "Boundary wire dtype: bf16, fp16 or fp32."})
    microbatches: int = field(default=4, metadata={"help": "Microbatches per inner step in flight through a pipeline."})
    project_start: bool = field(
        default=True, metadata={"help": "A virtual replica projects its start point into the subspace each round."}
    )
    drift_transfer: bool = field(
        default=True, metadata={"help": "Move the embedding's off-subspace drift into the fixed table each round."}
    )

    def __post_init__(self) -> None:
        if self.activation_compression not in ACTIVATION_COMPRESSION:
            raise ConfigError(
                f"--activation-compression must be one of {', '.join(ACTIVATION_COMPRESSION)}, "
                f"got {self.activation_compression!r}"
            )
        if self.boundary_wire not in BOUNDARY_WIRE_DTYPES:
            raise ConfigError(
                f"--boundary-wire must be one of {', '.join(BOUNDARY_WIRE_DTYPES)}, got {self.boundary_wire!r}"
            )
        if self.subspace_rank < 0:
            raise ConfigError(f"--subspace-rank must be ≥ 0 (0: d_model/8), got {self.subspace_rank}")
        require_positive(self, "microbatches")

    @property
    def compressed(self) -> bool:
        """Boundaries carry the subspace code (and every replica keeps the fixed token table)."""
        return self.activation_compression != "none"

    def rank(self, d_model: int) -> int:
        """The boundary rank for a model of width d_model: the configured k, or d/8."""
        return self.subspace_rank or max(1, d_model // 8)


@dataclass(frozen=True)
class RunConfig:
    """Everything peers of one run agree on; see the module docstring."""

    preset: str
    vocab_size: int
    batch_size: int
    seq_len: int
    seed: int
    data_shards: int
    data_identity: str
    tokenizer_identity: str
    outer: OuterConfig = field(default_factory=OuterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.outer.admission == "loss" and self.data_shards < 2:
            raise ConfigError("--admission loss keeps one data shard for probing: --data-shards must be ≥ 2")

    @property
    def training_shards(self) -> int:
        """Data shards replicas train on: all but the last under `--admission loss`, whose judges probe that one
        (`models/data.py: probe_batches`)."""
        return self.data_shards - 1 if self.outer.admission == "loss" else self.data_shards

    @property
    def uses_subspace(self) -> bool:
        """Every peer keeps T_fixed + E_S and the drift upkeep: a compressed run with pipeline boundaries."""
        return self.pipeline.compressed and self.outer.stages > 1

    @property
    def total_inner_steps(self) -> int:
        return self.outer.rounds * self.outer.inner_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Rebuild a config a peer sent (a bootstrap's announcement); anything malformed is a ConfigError."""
        nested = {
            "outer": OuterConfig, "optim": OptimConfig, "sparseloco": SparseLoCoConfig, "pipeline": PipelineConfig,
        }  # fmt: skip
        try:
            fields = {k: (nested[k](**v) if k in nested else v) for k, v in data.items()}
            run = cls(**fields)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"malformed run config: {e}") from None
        _check_field_types(run)
        return run

    @property
    def run_id(self) -> str:
        """Short stable hash of the whole config: the namespace of every DHT key and averaging group of the run."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def _check_field_types(config: Any, path: str = "") -> None:
    """A peer's config must carry exactly the types this version declares (a string seed would hash differently)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            _check_field_types(value, f"{path}{f.name}.")
        elif hint in (int, str, bool) and (type(value) is not hint):
            raise ConfigError(f"malformed run config: {path}{f.name} should be {hint.__name__}, got {value!r}")
        elif hint is float and (type(value) not in (int, float)):
            raise ConfigError(f"malformed run config: {path}{f.name} should be a number, got {value!r}")
