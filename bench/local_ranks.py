"""`hetero-node-lab local-ranks`: what a node gains from training one replica on several local devices.

The baseline is one process on the first device taking the same step (the same N batches, accumulated); the node
is `client/local`'s ranks, one batch each, gradients averaged. Both start from the same θ and see the same tokens,
so the report has their throughput ratio and how far their weights drifted apart (float summation order only).
On a CPU machine the ranks split its cores, so the ratio there measures the collectives' overhead, not a speed-up.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.progress import Progress

from hetero_node.bench.config import LocalRanksConfig
from hetero_node.bench.results import write_report
from hetero_node.client.local.collective import mean_gradients
from hetero_node.client.local.devices import resolve_devices
from hetero_node.client.local.group import LocalGroup
from hetero_node.models.replica_model import full_model
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.run_config import RunConfig


def _run(cfg: LocalRanksConfig) -> RunConfig:
    """Random byte-level tokens: throughput and agreement do not depend on what the tokens say."""
    return RunConfig(
        preset=cfg.preset, vocab_size=256, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=0, data_shards=1,
        data_identity="random", tokenizer_identity="bytes",
    )  # fmt: skip


def random_batches(
    count: int, seed: int, batch_size: int = 8, seq_len: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (inputs, targets) batches of random byte-level tokens, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 256, (batch_size, seq_len + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _timed(step: Any, cfg: LocalRanksConfig, world: int, sync: Any) -> float:
    """Seconds of `cfg.steps` steps after an untimed one (waiting for the device at both ends)."""
    step(random_batches(world, 0, cfg.batch_size, cfg.seq_len))
    sync()
    started = time.perf_counter()
    for i in range(cfg.steps):
        step(random_batches(world, 1 + i, cfg.batch_size, cfg.seq_len))
    sync()
    return time.perf_counter() - started


def run_local_ranks(cfg: LocalRanksConfig, progress: Progress | None = None) -> dict[str, Any]:
    devices = resolve_devices("auto", cfg.devices)
    run, world, device = _run(cfg), len(devices), devices[0]
    task = progress.add_task("baseline, then the node", total=2) if progress else None
    alone, _ = full_model(run, device)
    single = InnerTrainer(alone, run.optim, run.total_inner_steps, device)
    single_s = _timed(single.train_accumulated, cfg, world, single.synchronize)
    if progress and task is not None:
        progress.advance(task)
    model, _ = full_model(run, device)
    trainer = InnerTrainer(model, run.optim, run.total_inner_steps, device, gradient_hook=mean_gradients)
    group = LocalGroup(run, devices, compile=False)
    try:
        started = time.perf_counter()
        group.sync(model, trainer.optimizer)
        sync_s = time.perf_counter() - started
        node_s = _timed(lambda batches: group.step(trainer, batches), cfg, world, trainer.synchronize)
    finally:
        group.close()
    if progress and task is not None:
        progress.advance(task)
    tokens = cfg.steps * world * cfg.batch_size * cfg.seq_len
    drift = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), alone.parameters(), strict=True))
    report = {
        "config": {k: str(v) for k, v in vars(cfg).items()},
        "devices": [str(d) for d in devices],
        "n_params": sum(p.numel() for p in model.parameters()),
        "single_tokens_per_s": tokens / single_s,
        "node_tokens_per_s": tokens / node_s,
        "speedup": single_s / node_s,
        "sync_s": sync_s,
        "max_weight_difference": drift,
    }
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    devices = ", ".join(report["devices"])
    return (
        f"# One replica on {len(report['devices'])} local devices ({devices})\n\n"
        f"{report['n_params']:,} parameters, {report['config']['steps']} steps of one batch per rank.\n\n"
        "| | tokens/s |\n|---|---|\n"
        f"| one process, the same batches accumulated | {report['single_tokens_per_s']:,.0f} |\n"
        f"| the node's ranks | {report['node_tokens_per_s']:,.0f} |\n\n"
        f"Speed-up {report['speedup']:.2f}×; handing rank 0's state to the others took {report['sync_s']:.3f} s; "
        f"largest weight difference after the steps {report['max_weight_difference']:.1e}.\n"
    )
