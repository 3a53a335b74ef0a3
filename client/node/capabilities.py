"""What this node can do: GPUs, cores, memory, training throughput, and what the run asks of a node.

Measured once at start-up and advertised in the node's record; the planner compares them with the run's
`Requirements`. Memory is the budget the node may use for training: `--memory-gb` when the volunteer caps it,
else the chosen device's (a GPU's total memory, or the RAM available now on a CPU node).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil
import torch

from hetero_node.models.config import get_preset
from hetero_node.models.trainer import InnerTrainer
from hetero_node.models.transformer import Transformer
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


def measure_throughput(run: RunConfig, device: torch.device, steps: int = 2) -> float:
    """Training tokens/s of the whole model on this device (after one warm-up step), on random tokens."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    model = Transformer(cfg, seed=run.seed).to(device)
    trainer = InnerTrainer(model, run.optim, steps + 1, device)
    generator = torch.Generator().manual_seed(run.seed)
    x = torch.randint(0, run.vocab_size, (run.batch_size, run.seq_len), generator=generator)
    trainer.train_step(x, x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(x, x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps * run.batch_size * run.seq_len / (time.perf_counter() - start)
