"""Turn a node's run options into the shared `RunConfig`: load the data and tokenizer, and stamp their identities.

Two peers that train different data, tokenizers or settings get different run ids and therefore never average
together (see `protocol/run_config.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.models.config import get_preset
from hetero_node.models.data import TokenStore, build_token_store
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OptimConfig, OuterConfig, RunConfig
from hetero_node.protocol.sparseloco import SparseLoCoConfig


@dataclass(frozen=True)
class RunOptions:
    """The model, batch and data part of the run definition (the rest: OuterConfig, OptimConfig, SparseLoCoConfig)."""

    preset: str = field(default="small", metadata={"help": "Model preset: tiny, small, 178m, 560m or 1b."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step, per replica."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    seed: int = field(default=0, metadata={"help": "Seed of the initial weights and the data order."})
    data_shards: int = field(default=16, metadata={"help": "The corpus is cut into this many disjoint shards."})
    data: Path | None = field(
        default=None, metadata={"help": "Your text: a .txt file, a directory of them, or JSONL with a 'text' field."}
    )
    tokenizer: Path | None = field(
        default=None, metadata={"help": "A Hugging Face tokenizer.json (default: byte-level, no file needed)."}
    )
    cache_dir: Path | None = field(
        default=None, metadata={"help": "Corpus and token cache (default: $HETERO_NODE_CACHE or ~/.cache/hetero-node)."}
    )

    def __post_init__(self) -> None:
        if min(self.batch_size, self.seq_len, self.data_shards) < 1 or self.seed < 0:
            raise ConfigError(f"batch size, sequence length and data shards must be positive: {self}")


def prepare_run(
    options: RunOptions, outer: OuterConfig, optim: OptimConfig, sparseloco: SparseLoCoConfig
) -> tuple[RunConfig, TokenStore]:
    """Load (or build) the token store and return the run config that names it."""
    tokenizer = load_tokenizer(options.tokenizer)
    store = build_token_store(options.data, tokenizer, options.cache_dir or default_cache_dir())
    model_cfg = get_preset(options.preset, vocab_size=tokenizer.vocab_size)
    if options.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {options.seq_len} exceeds {options.preset}'s max_seq_len {model_cfg.max_seq_len}")
    if outer.stages > model_cfg.n_layers:
        raise ConfigError(f"--stages {outer.stages} exceeds {options.preset}'s {model_cfg.n_layers} layers")
    run = RunConfig(
        preset=options.preset,
        vocab_size=tokenizer.vocab_size,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        seed=options.seed,
        data_shards=options.data_shards,
        data_identity=store.identity,
        tokenizer_identity=tokenizer.identity,
        outer=outer,
        optim=optim,
        sparseloco=sparseloco,
    )
    return run, store
