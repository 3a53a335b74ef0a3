"""`hetero-node-lab rounds`: eval loss per trained token of the three ways a swarm can run its rounds.

* `synchronous`: every replica trains exactly H steps (`--min-inner-steps H --max-inner-steps H`), the way rounds
  worked before they were time-boxed;
* `time-boxed`: rounds are windows of wall time, every replica trains what fits (the default);
* `overlap`: time-boxed, and full replicas train the next round while a round's exchange runs.

Each mode runs `hetero-node demo` (full replicas on 127.0.0.1, real processes) once per seed, and the report
compares them at equal tokens: each run's eval loss is interpolated at the smallest token budget any run reached
(rounds are time-boxed, so runs of equal rounds train different token counts). Mean ± standard deviation over
seeds, per mode, in `report.json` and `report.md`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from hetero_node.bench.config import RoundModesConfig
from hetero_node.bench.results import write_report
from hetero_node.client.cli.demo import DemoConfig
from hetero_node.client.cli.options import to_argv

CLI = [sys.executable, "-m", "hetero_node.client.cli"]


def mode_fields(mode: str, inner_steps: int) -> dict[str, Any]:
    """The demo's round options of `mode`."""
    if mode == "synchronous":
        return {"min_inner_steps": inner_steps, "max_inner_steps": inner_steps}
    return {"overlap": True} if mode == "overlap" else {}


def demo_argv(cfg: RoundModesConfig, mode: str, seed: int, report: Path) -> list[str]:
    demo = DemoConfig(
        preset=cfg.preset, full=cfg.full, virtual=0, rounds=cfg.rounds, inner_steps=cfg.inner_steps, batch_size=8,
        seq_len=64, seed=seed, report=report, **mode_fields(mode, cfg.inner_steps),
    )  # fmt: skip
    return [*CLI, "demo", *to_argv(demo)]


def curve(report: dict[str, Any]) -> list[tuple[int, float]]:
    """(swarm tokens trained through round r, mean eval loss after round r) per round with an evaluation."""
    tokens_by_round: dict[int, int] = {}
    losses: dict[int, list[float]] = {}
    for peer in report["peers"]:
        for r in peer["rounds"]:
            tokens_by_round[r["round"]] = tokens_by_round.get(r["round"], 0) + r["tokens"]
            if r["eval_loss"] is not None:
                losses.setdefault(r["round"], []).append(r["eval_loss"])
    points, total = [], 0
    for t in sorted(tokens_by_round):
        total += tokens_by_round[t]
        if t in losses:
            points.append((total, statistics.mean(losses[t])))
    return points


def loss_at(points: list[tuple[int, float]], tokens: float) -> float:
    """Eval loss at `tokens`, linearly interpolated between the evaluations around it."""
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1)
    return points[-1][1] if tokens >= points[-1][0] else points[0][1]


def run_round_modes(cfg: RoundModesConfig) -> dict[str, Any]:
    """Run every mode for every seed (one after the other), then compare; returns the report."""
    runs_dir = cfg.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in range(cfg.seeds):
        for mode in cfg.mode_list:
            path = runs_dir / f"{mode}-seed{seed}.json"
            if not path.exists():  # a re-run keeps the runs it already has
                subprocess.run(demo_argv(cfg, mode, seed, path), check=True, stdout=subprocess.DEVNULL)
            report = json.loads(path.read_text())
            runs.setdefault(mode, []).append({"curve": curve(report), "summary": report["summary"]})
    budget = min(run["curve"][-1][0] for mode_runs in runs.values() for run in mode_runs)
    modes = {}
    for mode, mode_runs in runs.items():
        final = [run["curve"][-1][1] for run in mode_runs]
        at_budget = [loss_at(run["curve"], budget) for run in mode_runs]
        tokens = [run["curve"][-1][0] for run in mode_runs]
        wall = [run["summary"]["wall_s"] for run in mode_runs]
        modes[mode] = {name: _mean_std(values) for name, values in
                       (("loss_at_budget", at_budget), ("final_eval_loss", final), ("tokens", tokens),
                        ("wall_s", wall))}  # fmt: skip
    report = {"config": {k: str(v) for k, v in vars(cfg).items()}, "token_budget": budget, "modes": modes}
    write_report(cfg.out, report, render_markdown(report))
    return report


def _mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Round modes: eval loss at {report['token_budget']:,} trained tokens (mean ± std over seeds)",
        "",
        "| mode | eval loss at the budget | final eval loss | tokens trained | wall s |",
        "|---|---|---|---|---|",
    ]
    for mode, m in report["modes"].items():
        cells = [f"{m[k]['mean']:.3f} ± {m[k]['std']:.3f}" for k in ("loss_at_budget", "final_eval_loss")]
        cells += [f"{m['tokens']['mean']:,.0f} ± {m['tokens']['std']:,.0f}", f"{m['wall_s']['mean']:.0f}"]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
