"""One pipeline stage's arithmetic: forward a microbatch, keep what its backward needs, back-propagate, step.

No networking here: the stage peer (`stage_peer.py`) moves the byte strings this class produces and consumes.
In a compressed run the stage's residual outputs (and stage 0's learned embedding E_S) stay in span(U): the
boundary codec then carries c = Uᵀ(x − T_fixed[tok]) forward and Uᵀ g backward without loss
(`models/subspace.py`). After every optimizer step the constrained weights are projected back, since AdamW's
element-wise update leaves the subspace.

Gradient clipping: the global norm spans all stages, and no stage sees the others' gradients, so each stage
clips its own shard's norm to grad_clip / √S; the global norm is then at most grad_clip, as on a full replica.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from hetero_node.models.config import get_preset
from hetero_node.models.stages import StageModule
from hetero_node.models.subspace import (
    constrained_parameter_names,
    enable_subspace,
    initial_embedding,
    project_,
    subspace_basis,
)
from hetero_node.models.trainer import InnerTrainer
from hetero_node.models.transformer import autocast_context
from hetero_node.protocol import boundary_codec as codec
from hetero_node.protocol.run_config import RunConfig

Key = tuple[int, int]
"""(inner step, microbatch): what a backward message answers."""


def boundary_format(run: RunConfig) -> codec.BoundaryFormat:
    """The codec settings every boundary of the run uses."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    rank = run.pipeline.rank(cfg.d_model) if run.pipeline.compressed else None
    return codec.BoundaryFormat(cfg.d_model, cfg.vocab_size, cfg.max_seq_len, rank, run.pipeline.boundary_wire)


class PipelineStage:
    """Stage `stage` of the run's S-stage pipeline (see the module docstring)."""

    def __init__(self, run: RunConfig, stage: int, device: torch.device) -> None:
        cfg = get_preset(run.preset, vocab_size=run.vocab_size)
        n_stages = run.outer.stages
        self.stage, self.device = stage, device
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.module = StageModule(cfg, stage, n_stages, seed=run.seed).to(device)
        self.fmt = boundary_format(run)
        self.basis: Tensor | None = None
        self.embedding: Tensor | None = None
        """A later stage's copy of E_S (CPU, fp32), replaced (never written into) by the stage peer's upkeep, which
        follows it to rebuild T_fixed; None when unknown (after a loaded state, until the next upkeep fetches it)."""
        self.constrained: list[str] = []
        if run.uses_subspace:
            self.basis = subspace_basis(cfg.d_model, self.fmt.width, run.seed).to(device)
            initial = None if self.first else initial_embedding(cfg, run.seed)
            embedding = enable_subspace(self.module, self.basis, initial)
            self.embedding = None if self.first else embedding
            self.constrained = constrained_parameter_names(cfg, n_stages)
        self.trainer = InnerTrainer(self.module, run.optim, run.total_inner_steps, device)
        self.clip = run.optim.grad_clip / math.sqrt(n_stages)
        self._pending: dict[Key, tuple[Tensor | None, Tensor]] = {}

    @property
    def fixed_table(self) -> Tensor | None:
        return self.module.embed_fixed

    def project(self) -> None:
        """W ← U Uᵀ W on this stage's constrained weights (a no-op without compression or on the last stage)."""
        if self.basis is not None:
            project_(self.module, self.basis, self.constrained)

    def reset(self) -> None:
        """Forget microbatches in flight and accumulated gradients (an aborted round)."""
        self._pending.clear()
        self.trainer.optimizer.zero_grad(set_to_none=True)

    # -------------------------------------------------------------------------------------------- messages

    def _encode_output(self, y: Tensor, tokens: Tensor, targets: Tensor) -> bytes:
        return codec.encode_activations(self.fmt, y.detach(), tokens, targets, self.basis, self.fixed_table)

    def _input(self, values: Tensor, tokens: Tensor, grad: bool) -> Tensor:
        x = codec.expand_activations(values, tokens, self.basis, self.fixed_table).to(self.device)
        return x.requires_grad_(grad)

    def forward(self, key: Key, tokens: Tensor, targets: Tensor, values: Tensor | None = None) -> bytes:
        """Training forward of a microbatch on a non-last stage: keep the graph, return the outgoing message.

        Stage 0 reads the token ids; later stages the parsed incoming `values`.
        """
        self.module.train()
        x = tokens.to(self.device) if self.first else self._input(values, tokens, grad=True)
        with autocast_context(self.device):
            y = self.module(x)
        self._pending[key] = (None if self.first else x, y)
        return self._encode_output(y, tokens, targets)

    def forward_backward_last(
        self, values: Tensor, tokens: Tensor, targets: Tensor, weight: float
    ) -> tuple[float, bytes]:
        """The last stage: loss of a microbatch (scaled by its share of the batch), backward, gradient message."""
        self.module.train()
        x = self._input(values, tokens, grad=True)
        with autocast_context(self.device):
            logits = self.module(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.to(self.device).flatten())
        (loss * weight).backward()
        return loss.item(), codec.encode_gradients(self.fmt, x.grad, self.basis)

    def backward(self, key: Key, grad_values: Tensor) -> bytes | None:
        """Back-propagate the gradient a later stage sent for microbatch `key`; the message for the previous stage
        (None on stage 0). KeyError for a microbatch this stage has not forwarded."""
        x, y = self._pending.pop(key)
        y.backward(codec.expand_gradients(grad_values, self.basis).to(y.device, y.dtype))
        return None if x is None else codec.encode_gradients(self.fmt, x.grad, self.basis)

    def optimizer_step(self) -> None:
        """AdamW once per global batch, then back into the subspace."""
        self.trainer.optimizer_step(self.clip)
        self.project()

    @torch.no_grad()
    def eval_forward(self, tokens: Tensor, targets: Tensor, values: Tensor | None = None) -> bytes | float:
        """Eval: the outgoing message, or on the last stage the batch's mean loss."""
        self.module.eval()
        x = tokens.to(self.device) if self.first else self._input(values, tokens, grad=False)
        with autocast_context(self.device):
            out = self.module(x)
        if self.last:
            return nn.functional.cross_entropy(out.float().flatten(0, 1), targets.to(self.device).flatten()).item()
        return self._encode_output(out, tokens, targets)
