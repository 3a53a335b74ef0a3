"""Node-side configuration: the inner optimizer and the local training job.

Defaults are chosen to work on a 2-core laptop CPU with the `small` preset; every field becomes a CLI option
(see `client/options.py`), so the help text here is the user's documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.protocol.errors import ConfigError


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
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ConfigError(f"invalid optimizer settings: {self}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError(f"invalid optimizer settings: {self}")


@dataclass(frozen=True)
class TrainConfig:
    """What one process trains, on which data, for how long."""

    preset: str = field(default="small", metadata={"help": "Model preset: tiny, small, 178m, 560m or 1b."})
    steps: int = field(default=600, metadata={"help": "Total inner steps (sets the length of the cosine schedule)."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step."})
    seq_len: int = field(default=256, metadata={"help": "Tokens per sequence."})
    eval_every: int = field(default=100, metadata={"help": "Evaluate held-out loss every N inner steps."})
    eval_batches: int = field(default=8, metadata={"help": "Validation batches per evaluation."})
    seed: int = field(default=0, metadata={"help": "Seed for weights and data order."})
    data: Path | None = field(
        default=None,
        metadata={"help": "Your text: a .txt file, a directory of them, or JSONL with a 'text' field."},
    )
    tokenizer: Path | None = field(
        default=None, metadata={"help": "A Hugging Face tokenizer.json (default: byte-level, no file needed)."}
    )
    cache_dir: Path | None = field(
        default=None, metadata={"help": "Corpus and token cache (default: $HETERO_NODE_CACHE or ~/.cache/hetero-node)."}
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (CUDA when available)."})

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.seq_len, self.eval_every, self.eval_batches) < 1:
            raise ConfigError(f"steps, batch size, sequence length and eval settings must be positive: {self}")
