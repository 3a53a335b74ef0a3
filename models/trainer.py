"""The inner loop every replica runs between outer rounds: AdamW steps with cosine LR on local batches.

Kept deliberately short (nanoGPT-style): the outer machinery (SparseLoCo, pipelines) wraps this class, it never
reaches inside it.

On CUDA the step is built for throughput: the model's forward and its loss can be compiled together
(`torch.compile`, so the logits' fp32 upcast fuses into the softmax instead of materialising a full fp32 copy),
AdamW is the fused kernel, and `train_step` returns the loss as a device tensor instead of waiting for it. The
host still waits for the *previous* step before returning (`synchronize` for the current one), so it never runs
more than one step ahead: the device always has the next step queued, and wall-clock deadlines stay accurate to a
step. On CPU none of that applies, and a step computes exactly what it always did.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from hetero_node.models.transformer import autocast_context
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OptimConfig

logger = logging.getLogger(__name__)


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


def compile_wanted(option: bool, device: torch.device) -> bool:
    """What `--compile` means on `device`: on CUDA it nearly doubles a step's throughput; on CPU inductor's
    compile time (minutes on a small machine) costs more than it saves over a run, so CPU stays eager."""
    return option and device.type == "cuda"


def cosine_lr(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it at `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of (B, T, V) logits, in fp32: bf16 log-probabilities would round the loss to
    three digits. Under `torch.compile` the upcast fuses into the softmax; in eager mode it is one fp32 copy (as
    F.cross_entropy under autocast would make anyway: log_softmax is on autocast's fp32 list)."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def model_loss(model: nn.Module, x: Tensor, y: Tensor, device: torch.device) -> Tensor:
    """The mean token cross-entropy of `model` on one batch, under the device's autocast."""
    with autocast_context(device):
        logits = model(x)
    return token_loss(logits, y)


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device) -> float:
    """Mean cross-entropy of `model` over `batches` in eval mode. Eager: a few batches per evaluation do not repay a
    second compiled graph."""
    model.eval()
    losses = torch.stack([model_loss(model, x.to(device), y.to(device), device) for x, y in batches]).tolist()
    return sum(losses) / len(losses)


class InnerTrainer:
    """AdamW on one module (a whole model or a pipeline stage); `step` counts inner steps for the LR schedule.

    `compile` compiles the module's training forward and loss (a whole model only: a pipeline stage's
    forward is split across calls). If compiling fails, the trainer warns once and stays eager. `gradient_hook`
    sees the module's gradients before each step clips them (a multi-device node averages them over its ranks).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        device: torch.device,
        compile: bool = False,
        gradient_hook: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.model, self.cfg, self.total_steps, self.device = model, cfg, total_steps, device
        self.gradient_hook = gradient_hook
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]  # norms: weight decay would only shrink them
        on_cuda = device.type == "cuda" and all(p.is_cuda for p in model.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=on_cuda or None,  # one kernel for all tensors; None: torch's default (foreach) elsewhere
        )
        self.step = 0
        self._compiled_loss: Callable[[Tensor, Tensor], Tensor] | None = None
        if compile:
            self._compiled_loss = torch.compile(self._eager_loss, dynamic=False)
        self._in_flight: torch.cuda.Event | None = None
        """Marks the end of the last step queued on the device and not yet waited for (CUDA only)."""

    @property
    def compiled(self) -> bool:
        """Whether training steps run the compiled forward (False after a failed compile)."""
        return self._compiled_loss is not None

    @property
    def in_flight(self) -> bool:
        """A step is still running on the device: a caller checking a deadline adds its time."""
        return self._in_flight is not None

    def _eager_loss(self, x: Tensor, y: Tensor) -> Tensor:
        return model_loss(self.model, x, y, self.device)

    def _forward_backward(self, x: Tensor, y: Tensor, scale: float = 1.0) -> Tensor:
        """The batch's loss, `scale` × its gradients accumulated; falls back to eager (once, for good) if compiling
        fails."""
        if self._compiled_loss is not None:
            try:
                loss = self._compiled_loss(x, y)
                (loss if scale == 1.0 else loss * scale).backward()
                return loss.detach()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                logger.warning("torch.compile failed (%s: %s); training eagerly instead", type(e).__name__, e)
                self._compiled_loss = None
                self.optimizer.zero_grad(set_to_none=True)  # a backward may have failed halfway
        loss = self._eager_loss(x, y)
        (loss if scale == 1.0 else loss * scale).backward()
        return loss.detach()

    def warm_up(self, x: Tensor, y: Tensor) -> None:
        """Compile now, on a batch, without training on it (gradients dropped, weights and optimizer untouched):
        a replica's first measured step then times training, not the compiler. Nothing to do when eager."""
        if not self.compiled:
            return
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._forward_backward(x.to(self.device), y.to(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # its kernels too: a timer started next sees none of the warm-up

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        """One AdamW step on a batch of token ids; returns the batch's mean cross-entropy as a 0-d device tensor
        (reading it, e.g. `float(loss)`, waits for the step: callers do that only when they log or record)."""
        return self.train_accumulated([(x, y)])

    def train_accumulated(self, batches: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """One AdamW step on the mean gradient of several batches (one batch as `train_step`): a bigger step from
        the same memory. Returns their mean loss as a 0-d device tensor."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses = [self._forward_backward(x.to(self.device), y.to(self.device), 1 / len(batches)) for x, y in batches]
        self.optimizer_step()
        self._pace()
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def _pace(self) -> None:
        """Wait for the previous step (not this one): at most one step queued ahead of the device."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.synchronize()
        self._in_flight = done

    def synchronize(self) -> None:
        """Wait until every step queued so far has finished (a no-op on CPU, where steps are synchronous)."""
        if self._in_flight is not None:
            self._in_flight.synchronize()
            self._in_flight = None

    def optimizer_step(self, clip_norm: float | None = None) -> None:
        """Clip, step AdamW at the schedule's LR for this step, clear the gradients. A pipeline stage accumulates
        its microbatches' gradients itself and calls this once per global batch; `clip_norm` (default: the
        config's) is its share of the global clip."""
        lr = cosine_lr(self.step, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.gradient_hook is not None:
            self.gradient_hook(self.model)
        clip = self.cfg.grad_clip if clip_norm is None else clip_norm
        if clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
        """Mean held-out cross-entropy over fixed batches (the same batches every time, so values compare)."""
        return mean_loss(self.model, batches, self.device)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
