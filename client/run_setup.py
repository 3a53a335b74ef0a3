"""Turn a node's run options into the shared `RunConfig`: load the data and tokenizer, and stamp their identities.

Two peers that train different data, tokenizers or settings get different run ids and therefore never average
together (see `protocol/run_config.py`).
"""

from __future__ import annotations

from hetero_node.client.config import RunOptions
from hetero_node.models.config import get_preset
from hetero_node.models.data import TokenStore, build_token_store
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OptimConfig, OuterConfig, PipelineConfig, RunConfig, SparseLoCoConfig


def prepare_run(
    options: RunOptions, outer: OuterConfig, optim: OptimConfig, sparseloco: SparseLoCoConfig, pipeline: PipelineConfig
) -> tuple[RunConfig, TokenStore]:
    """Load (or build) the token store and return the run config that names it."""
    tokenizer = load_tokenizer(options.tokenizer)
    store = build_token_store(options.data, tokenizer, options.cache_dir or default_cache_dir())
    model_cfg = get_preset(options.preset, vocab_size=tokenizer.vocab_size)
    if options.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {options.seq_len} exceeds {options.preset}'s max_seq_len {model_cfg.max_seq_len}")
    if outer.stages > model_cfg.n_layers:
        raise ConfigError(f"--stages {outer.stages} exceeds {options.preset}'s {model_cfg.n_layers} layers")
    if pipeline.microbatches > options.batch_size:
        raise ConfigError(f"--microbatches {pipeline.microbatches} exceeds --batch-size {options.batch_size}")
    if pipeline.rank(model_cfg.d_model) > model_cfg.d_model:
        raise ConfigError(f"--subspace-rank {pipeline.subspace_rank} exceeds {options.preset}'s d_model")
    if pipeline.activation_compression == "compress-all" and outer.stages < 2:
        raise ConfigError("--activation-compression compress-all needs --stages ≥ 2 (a pipeline to compress)")
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
        pipeline=pipeline,
    )
    return run, store
