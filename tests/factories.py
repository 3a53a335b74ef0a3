"""Test data factories: a run config and peer records with valid defaults, changed only where a test says so
(`record_fields` is the benches', re-exported)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hetero_node.bench.samples import record_fields as record_fields  # re-exported for the tests
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, RunConfig
from hetero_node.protocol.sparseloco import ErrorFeedbackCompressor, SparseLoCoConfig, SparseMessage


def run_config(
    stages: int = 2,
    batch_size: int = 8,
    seq_len: int = 64,
    inner_steps: int = 30,
    pipeline: PipelineConfig | None = None,
    **changes: Any,
) -> RunConfig:
    """A `tiny` run on byte-level tokens; `changes` replace any other field (`outer=...` wins over stages/H)."""
    base = RunConfig(
        preset="tiny",
        vocab_size=256,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=0,
        data_shards=16,
        data_identity="d" * 64,
        tokenizer_identity="t" * 64,
        outer=OuterConfig(stages=stages, inner_steps=inner_steps),
        pipeline=pipeline or PipelineConfig(),
    )
    return dataclasses.replace(base, **changes)


def peer_id(name: str) -> str:
    """A valid base58 peer id made from `name`: characters base58 lacks (0, O, I, l) are replaced, then padded."""
    return name.translate(str.maketrans("0OIl", "zQJL")).ljust(32, "x")


def peer_record(name: str, **changes: Any) -> PeerRecord:
    return PeerRecord(**record_fields(peer_id(name), **changes))


MESSAGE_SHAPES = [(256, 128), (1000,)]
"""A parameter shard of two tensors, for SparseLoCo messages."""


def correlated_messages(count: int, seed: int = 0, noise: float = 1.0) -> list[SparseMessage]:
    """Messages of one common step plus each sender's own noise: honest pseudo-gradients of one θ(t) agree."""
    gen = torch.Generator().manual_seed(seed)
    common = [torch.randn(s, generator=gen) for s in MESSAGE_SHAPES]
    return [
        ErrorFeedbackCompressor(MESSAGE_SHAPES, SparseLoCoConfig()).compress(
            [c + noise * torch.randn(c.shape, generator=gen) for c in common]
        )
        for _ in range(count)
    ]
