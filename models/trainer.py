"""The inner loop every replica runs between outer rounds: AdamW steps with cosine LR on local batches.

Kept deliberately short (nanoGPT-style): the outer machinery (SparseLoCo, pipelines) wraps this class, it never
reaches inside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from hetero_node.models.transformer import autocast_context
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OptimConfig


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present: a volunteer should not have to know which flag to pass."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available on this machine (try --device auto)")
    return device


def cosine_lr(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it at `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


class InnerTrainer:
    """AdamW on one module (a whole model or a pipeline stage); `step` counts inner steps for the LR schedule."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, total_steps: int, device: torch.device) -> None:
        self.model, self.cfg, self.total_steps, self.device = model, cfg, total_steps, device
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]  # norms: weight decay would only shrink them
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
        )
        self.step = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on a batch of token ids; returns the batch's mean cross-entropy."""
        self.model.train()
        x, y = x.to(self.device), y.to(self.device)
        with autocast_context(self.device):
            logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer_step()
        return loss.item()

    def optimizer_step(self, clip_norm: float | None = None) -> None:
        """Clip, step AdamW at the schedule's LR for this step, clear the gradients. A pipeline stage accumulates
        its microbatches' gradients itself and calls this once per global batch; `clip_norm` (default: the
        config's) is its share of the global clip."""
        lr = cosine_lr(self.step, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clip = self.cfg.grad_clip if clip_norm is None else clip_norm
        if clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean held-out cross-entropy over fixed batches (the same batches every time, so values compare)."""
        self.model.eval()
        losses = []
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with autocast_context(self.device):
                logits = self.model(x)
            losses.append(nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
