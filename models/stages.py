"""Pipeline stages: which layers a stage owns, and a module holding only that stage's parameters.

A weak peer serving one stage of a virtual replica builds a `StageModule` directly; it never allocates the rest of
the model. Stage s owns its contiguous layer range; stage 0 also owns `embed`, the last stage `norm` and `head`.
"""

from __future__ import annotations

import torch

from hetero_node.models.config import ModelConfig
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.errors import ConfigError

BATCHES_IN_FLIGHT = 2
"""Batches of microbatches a stage before the last keeps in flight when an inner step accumulates several
(`client/roles/pipeline_schedule.py`): their activations wait for the gradients, one round trip away. One batch
kept `hetero-tiny-wan`'s edge pipeline (140 ms round trip) at 930 tokens/s, two at 1,550–1,630 (edge token share
19% → 29–31%); the memory model counts their activations (`models/memory.py`)."""


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges covering range(n_layers), sizes differing by at most one.

    Earlier stages take the extra layers because the last stage also carries the output head (a vocab × d matmul
    and its softmax), which outweighs the embedding lookup stage 0 carries.
    """
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(
            f"n_stages must be between 1 and n_layers={n_layers} (one layer per stage at least), got {n_stages}"
        )
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


class StageModule(Transformer):
    """Stage `stage` of `n_stages`: input token ids (stage 0) or hidden states; output hidden states or logits (last).

    Its parameter names and initial values equal those of the same parameters in `Transformer(cfg, seed)`.
    """

    def __init__(self, cfg: ModelConfig, stage: int, n_stages: int, seed: int = 0) -> None:
        ranges = stage_layer_ranges(cfg.n_layers, n_stages)
        if not 0 <= stage < n_stages:
            raise ConfigError(f"stage must be in [0, {n_stages}), got {stage}")
        super().__init__(cfg, seed, layers=ranges[stage], with_embed=stage == 0, with_head=stage == n_stages - 1)
        self.stage, self.n_stages = stage, n_stages


@torch.no_grad()
def split_model(model: Transformer, n_stages: int) -> list[StageModule]:
    """Stage modules holding copies of a full model's current weights (same device), e.g. to check composition.

    A fixed token table (`embed_fixed`, subspace pipelines) is copied to every stage.
    """
    device = next(model.parameters()).device
    weights = model.state_dict()
    stages = []
    for s in range(n_stages):
        with device:
            stage = StageModule(model.cfg, s, n_stages)
        if model.embed_fixed is not None:  # every stage holds the fixed table (boundary decoding needs it)
            stage.embed_fixed = torch.empty_like(model.embed_fixed)
        stage.load_state_dict({name: weights[name] for name in stage.state_dict()})
        stages.append(stage)
    return stages
