"""What this node can do: GPUs, cores, memory, training throughput, and what the run asks of a node.

Measured once at start-up and advertised in the node's record; the planner compares them with the run's
`Requirements`. Memory is the budget the node may use for training: `--memory-gb` when the volunteer caps it,
else the chosen device's (a GPU's total memory, or the RAM available now on a CPU node).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
import torch.nn.functional as F

from hetero_node.models.config import get_preset
from hetero_node.models.stages import StageModule
from hetero_node.models.trainer import InnerTrainer
from hetero_node.models.transformer import Transformer, autocast_context
from hetero_node.protocol.run_config import RunConfig

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[tuple[str, float], ...]  # (name, memory GB)
    cpu_cores: int
    ram_gb: float
    memory_gb: float


def probe_hardware(device: torch.device, memory_limit_gb: float | None) -> Hardware:
    gpus = tuple(
        (torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / GB)
        for i in range(torch.cuda.device_count())
    )
    if device.type == "cuda":
        device_gb = torch.cuda.get_device_properties(device).total_memory / GB
    else:
        device_gb = psutil.virtual_memory().available / GB
    budget = device_gb if memory_limit_gb is None else min(device_gb, memory_limit_gb)
    return Hardware(gpus, os.cpu_count() or 1, psutil.virtual_memory().total / GB, budget)


def measure_stage_throughput(run: RunConfig, device: torch.device, stage: int, share: float, steps: int = 2) -> float:
    """The whole model's training tokens/s as timed on pipeline stage `stage` alone, whose share of the model's
    FLOPs is `share`: a node too small for the model still tells the planner its speed, which prices a pipeline of
    such nodes (`client/swarm/auto_plan.py: MarginalGain`). Random hidden states in, a random gradient back, after
    one warm-up step; the boundary codec and the link are the cost model's to add."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    module = StageModule(cfg, stage, run.outer.stages, seed=run.seed).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=run.optim.lr)
    generator = torch.Generator().manual_seed(run.seed)
    tokens = torch.randint(0, run.vocab_size, (run.batch_size, run.seq_len), generator=generator).to(device)
    hidden, gradient = (torch.randn(run.batch_size, run.seq_len, cfg.d_model, generator=generator).to(device)
                        for _ in range(2))  # fmt: skip
    x = tokens if stage == 0 else hidden.requires_grad_()  # a later stage sends its input's gradient back
    last = stage == run.outer.stages - 1

    def step() -> None:
        with autocast_context(device):
            y = module(x)
        loss = F.cross_entropy(y.float().flatten(0, 1), tokens.flatten()) if last else (y.float() * gradient).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed(step, steps, device) * run.batch_size * run.seq_len * share


def _timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Steps per second of `step`, after one untimed."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps / (time.perf_counter() - start)


def measure_throughput(run: RunConfig, device: torch.device, steps: int = 2) -> float:
    """Training tokens/s of the whole model on this device (after one warm-up step), on random tokens."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    model = Transformer(cfg, seed=run.seed).to(device)
    trainer = InnerTrainer(model, run.optim, steps + 1, device)
    generator = torch.Generator().manual_seed(run.seed)
    x = torch.randint(0, run.vocab_size, (run.batch_size, run.seq_len), generator=generator)
    return _timed(lambda: trainer.train_step(x, x), steps, device) * run.batch_size * run.seq_len
