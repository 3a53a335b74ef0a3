"""How much memory training a model (or one pipeline stage of it) needs: what the planner compares against a node.

Per parameter, a replica keeps fp32 weights, gradients, AdamW's two moments, the SparseLoCo error-feedback
buffer, the round's start copy, and while a round is in flight the error-feedback buffer it replaced (the
snapshot that undoes a failed round, `SparseLoCoMethod.encode`): 7 × 4 = 28 bytes. Activations kept for backward
are estimated per layer from the batch (attention via SDPA keeps no seq² matrix); the head adds logits and their
gradient. A headroom factor covers the allocator, temporaries and the framework itself: an estimate, deliberately
pessimistic.
"""

from __future__ import annotations

from hetero_node.models.config import ModelConfig
from hetero_node.models.meta import on_meta
from hetero_node.models.stages import BATCHES_IN_FLIGHT, stage_layer_ranges
from hetero_node.models.transformer import Transformer

TRAINING_BYTES_PER_PARAM = 28
ACTIVATION_FLOATS_PER_LAYER = 16
"""Saved activations per token per layer, in units of d_model floats (norms, q/k/v, attention out, MLP)."""
HEADROOM = 1.25


def parameter_count(cfg: ModelConfig, layers: range, with_embed: bool, with_head: bool) -> int:
    """Exact count, from the module built on the meta device (no memory is allocated)."""
    with on_meta():
        module = Transformer(cfg, layers=layers, with_embed=with_embed, with_head=with_head)
    return sum(p.numel() for p in module.parameters())


def training_memory_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, layers: range, with_embed: bool, with_head: bool
) -> int:
    """Memory to train these layers with this batch, headroom included."""
    params = parameter_count(cfg, layers, with_embed, with_head)
    tokens = batch_size * seq_len
    activations = tokens * cfg.d_model * ACTIVATION_FLOATS_PER_LAYER * len(layers) * 4
    if with_head:
        activations += 2 * tokens * cfg.vocab_size * 4
    return int(HEADROOM * (params * TRAINING_BYTES_PER_PARAM + activations))


def full_and_stage_memory(
    cfg: ModelConfig, batch_size: int, seq_len: int, stages: int, subspace: bool = False, judge: bool = False
) -> tuple[int, list[int]]:
    """(bytes to train the whole model, bytes to train each pipeline stage: a stage before the last keeps
    `BATCHES_IN_FLIGHT` batches' activations; the last computes each microbatch's loss and gradient at once, and one
    batch's bound it). In a `subspace` run every peer also
    holds the fixed table T_fixed on its device (fp32 vocab × d, a buffer outside the optimizer). Stages without the
    embedding keep a copy of E_S of the same size too, in host RAM, not counted here: this is the device's budget.
    A full replica that `judge`s messages (`--admission loss`) keeps a second fp32 copy of the model to score with."""
    table = int(HEADROOM * 4 * cfg.vocab_size * cfg.d_model) if subspace else 0
    full = training_memory_bytes(cfg, batch_size, seq_len, range(cfg.n_layers), True, True) + table
    if judge:
        full += int(HEADROOM * 4 * parameter_count(cfg, range(cfg.n_layers), True, True)) + table
    per_stage = [  # a stage before the last holds the activations of every microbatch in flight
        training_memory_bytes(cfg, batch_size * (1 if last else BATCHES_IN_FLIGHT), seq_len, layers, s == 0, last)
        + table
        for s, layers in enumerate(stage_layer_ranges(cfg.n_layers, stages))
        for last in [s == stages - 1]
    ]
    return full, per_stage
