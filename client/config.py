"""Node-side configuration of the local training job (the inner optimizer lives in the run config).

Defaults are chosen to work on a 2-core laptop CPU with the `small` preset; every field becomes a CLI option
(see `client/options.py`), so the help text here is the user's documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OptimConfig

__all__ = ["OptimConfig", "TrainConfig"]


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
