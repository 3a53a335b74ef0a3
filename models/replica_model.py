"""The whole model as a run defines it: what every full replica builds, and each rank of a multi-device node, so all
of them start from the same θ(0) (and, in a subspace run, the same basis and T_fixed)."""

from __future__ import annotations

import torch
from torch import Tensor

from hetero_node.models.config import get_preset
from hetero_node.models.subspace import enable_subspace, subspace_basis
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.run_config import RunConfig


def full_model(run: RunConfig, device: torch.device) -> tuple[Transformer, Tensor | None]:
    """The run's model on `device`, and its subspace basis (CPU, fp32) when the run constrains the embedding."""
    model_cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    model = Transformer(model_cfg, seed=run.seed).to(device)
    if not run.uses_subspace:
        return model, None
    basis = subspace_basis(model_cfg.d_model, run.pipeline.rank(model_cfg.d_model), run.seed)
    enable_subspace(model, basis.to(device))  # embedding = T_fixed + E_S, as on the virtual replicas
    return model, basis
