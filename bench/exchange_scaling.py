"""`hetero-node-lab exchange`: bytes each full replica moves per round as the swarm grows, measured on loopback
(`hetero-node demo`, real processes) next to what the cost model says for today's exchange (at most K messages a
round through relay trees), the all-to-all one before it, and a butterfly.

Measured, over rounds ≥ 1 (round 0: peers are still arriving) a replica got from its group (contributed, or left out
by the selection), mean and max over replicas and rounds: down = the round's message bytes it downloaded; up = the
blob bytes it served since its previous record (messages, manifests), which counts a message in the round its
fetchers came for it, so a single round's figure can hold two rounds' worth. The sizes of the groups that formed are
given too: on a small machine a large swarm's rounds can split into smaller groups, and the model is also given at
those sizes.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import ExchangeScalingConfig
from hetero_node.bench.results import write_report
from hetero_node.client.cli.demo import DemoConfig
from hetero_node.client.cli.options import to_argv
from hetero_node.client.cli.plan import sizing_run
from hetero_node.client.config import OptimConfig, RunOptions
from hetero_node.client.swarm.cost_model import RunShape, exchange_bytes
from hetero_node.protocol.errors import HeteroNodeError, positive_int_list
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

CLI = [sys.executable, "-m", "hetero_node.client.cli"]


def demo_argv(cfg: ExchangeScalingConfig, replicas: int, report: Path) -> list[str]:
    """Rounds of `round_s_per_replica` × R seconds: with the default H-step rounds, 8 or more replicas sharing 2
    cores miss each other's groups (rounds split into groups of 2–8, and 16 replicas completed none)."""
    demo = DemoConfig(
        preset="tiny", full=replicas, virtual=0, rounds=cfg.rounds, inner_steps=cfg.inner_steps, batch_size=4,
        seq_len=64, report=report, round_s=cfg.round_s_per_replica * replicas, max_contributors=cfg.max_contributors,
    )  # fmt: skip
    return [*CLI, "demo", *to_argv(demo)]


def measured_traffic(report: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(group size, bytes downloaded, bytes served) per replica per round, over rounds ≥ 1 it got from its group."""
    return [
        (r["group_size"], r["bytes_received"], r["bytes_sent"])
        for peer in report["peers"]
        for r in peer["rounds"]
        if r["round"] >= 1 and r["group_size"] >= 2 and not r.get("caught_up")
    ]


def run_exchange_scaling(cfg: ExchangeScalingConfig, progress: Progress | None = None) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    sizes = positive_int_list(cfg.replicas, "--replicas")
    task = progress.add_task("swarm sizes", total=len(sizes)) if progress else None
    run = sizing_run(RunOptions(preset="tiny", batch_size=4, seq_len=64), OuterConfig(inner_steps=cfg.inner_steps),
                     OptimConfig(), SparseLoCoConfig(), PipelineConfig())  # the demo's run  # fmt: skip
    message = RunShape.from_run(run).message_bytes
    rows = []
    for replicas in sizes:
        path = cfg.out / f"demo-{replicas}.json"
        done = subprocess.run(demo_argv(cfg, replicas, path), capture_output=True, text=True, check=False)
        if done.returncode != 0 or not path.exists():
            raise HeteroNodeError(f"the {replicas}-replica demo failed: {done.stderr.strip()[-500:]}")
        samples = measured_traffic(json.loads(path.read_text()))
        groups = [g for g, _, _ in samples]
        k = cfg.max_contributors
        rows.append({
            "replicas": replicas,
            "message_bytes": message,
            "max_contributors": k,
            "group_sizes": [min(groups), max(groups)] if groups else None,
            "down_mean": statistics.mean(d for _, d, _ in samples) if samples else None,
            "down_max": max((d for _, d, _ in samples), default=None),
            "up_mean": statistics.mean(u for _, _, u in samples) if samples else None,
            "up_max": max((u for _, _, u in samples), default=None),
            "model_at_groups": statistics.mean(exchange_bytes(message, g, "relay-tree", k) for g in groups or [0]),
            "samples": len(samples),
            "model_relay_tree": exchange_bytes(message, replicas, "relay-tree", k),
            "model_all_to_all": exchange_bytes(message, replicas, "all-to-all"),
            "model_butterfly": exchange_bytes(message, replicas, "butterfly"),
        })  # fmt: skip
        if progress is not None and task is not None:
            progress.advance(task)
    result = {"config": {k: str(v) for k, v in vars(cfg).items()}, "rows": rows}
    write_report(cfg.out, result, render_markdown(result))
    return result


def render_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    k = rows[0]["max_contributors"] if rows else 0
    lines = [
        f"# Bytes a full replica moves per round (tiny, loopback, --max-contributors {k})",
        "",
        "| replicas | message KB | groups formed (sizes) | measured down KB (mean / max, n) | measured up KB (mean "
        "/ max) | model at the groups formed KB | model at R: today KB | all-to-all KB | butterfly KB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["samples"]:
            low, high = r["group_sizes"]
            formed = f"{low}–{high}" if low != high else str(low)
            down = f"{r['down_mean'] / 1e3:,.1f} / {r['down_max'] / 1e3:,.1f} ({r['samples']})"
            up = f"{r['up_mean'] / 1e3:,.1f} / {r['up_max'] / 1e3:,.1f}"
            at_groups = f"{r['model_at_groups'] / 1e3:,.1f}"
        else:
            formed, down, up, at_groups = "none", "no rounds from a group", "", ""
        lines.append(
            f"| {r['replicas']} | {r['message_bytes'] / 1e3:,.1f} | {formed} | {down} | {up} | {at_groups} | "
            f"{r['model_relay_tree'] / 1e3:,.1f} | {r['model_all_to_all'] / 1e3:,.1f} | "
            f"{r['model_butterfly'] / 1e3:,.1f} |"
        )
    return "\n".join([*lines, ""])
