"""`hetero-node-lab slow-link`: does a home volunteer on a slow, far link count, without slowing the others down?

The same swarm twice on the netlab (`bench/topologies/slow-link.toml`): three datacenter replicas and `home0`, once
with home0 on a datacenter link (`slow-link-base.toml`, the baseline) and once on 5 Mbit/s each way at 150 ms from
the others. Every node gets the same CPU share, so only home0's link differs between the runs. From the nodes' round
records: the rounds home0's message was aggregated in, out of the rounds it finished, and the others' round period
(the time between the ends of two consecutive rounds, what their tokens per second divide by) against the
baseline's, a ratio of two runs on the same machine.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import BenchConfig, SlowLinkConfig
from hetero_node.bench.suite import run_bench
from hetero_node.bench.topology import BUNDLED_DIR

METHOD = "sparseloco"
VOLUNTEER = "home0"
RUNS = {"baseline": BUNDLED_DIR / "slow-link-base.toml", "slow link": BUNDLED_DIR / "slow-link.toml"}


def node_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's rounds: how many it finished and contributed to, and its mean round period (from its second
    round on: the first one's start-up is not a period)."""
    rounds = [r for r in records if "round" in r]
    ends = [r["ended_at"] for r in rounds]
    periods = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "rounds": len(rounds),
        "contributed": sum(1 for r in rounds if r.get("contributed")),
        "period_s": statistics.fmean(periods) if periods else None,
        "comm_s": statistics.fmean(r["comm_s"] for r in rounds) if rounds else None,
        "inner_steps": sum(r["inner_steps"] for r in rounds),
    }


def run_summary(logs: Path) -> dict[str, dict[str, Any]]:
    """Every node's summary from a run's metrics files (`<node>.jsonl`)."""
    return {
        path.stem: node_summary([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
        for path in sorted(logs.glob("*.jsonl"))
    }


def compare(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The volunteer's contribution share on the slow link, and the others' round period against the baseline."""

    def others_period(nodes: dict[str, dict[str, Any]]) -> float | None:
        periods = [n["period_s"] for name, n in nodes.items() if name != VOLUNTEER and n["period_s"] is not None]
        return statistics.fmean(periods) if periods else None

    volunteer = runs["slow link"].get(VOLUNTEER, {"rounds": 0, "contributed": 0})
    base, slow = others_period(runs["baseline"]), others_period(runs["slow link"])
    share = volunteer["contributed"] / volunteer["rounds"] if volunteer["rounds"] else None
    lengthening = slow / base - 1 if base and slow else None
    return {
        "volunteer_contribution_share": share,
        "others_period_s": {"baseline": base, "slow link": slow},
        "others_lengthening": lengthening,
        "targets": {
            "volunteer contributes in ≥ 80% of the rounds it finished": share is not None and share >= 0.8,
            "the others' rounds ≤ 5% longer": lengthening is not None and lengthening <= 0.05,
        },
    }


def run_slow_link(cfg: SlowLinkConfig, progress: Progress) -> dict[str, Any]:
    """Both runs (the baseline first), then `report.json` and `report.md` under `cfg.out`."""
    task = progress.add_task("slow-link runs", total=len(RUNS))
    runs = {}
    for name, topology in RUNS.items():
        out = cfg.out / name.replace(" ", "-")
        # a home volunteer joins a public swarm: its rule, robust
        bench = BenchConfig(topology=topology, methods=METHOD, preset=cfg.preset, rounds=cfg.rounds,
                            inner_steps=cfg.inner_steps, round_s=cfg.round_s, overlap=cfg.overlap, out=out,
                            aggregation="robust")  # fmt: skip
        run_bench(bench, progress.console)
        runs[name] = run_summary(out / "logs" / METHOD)
        progress.advance(task)
    report = {"config": {k: str(v) for k, v in vars(cfg).items()}, "runs": runs, **compare(runs)}
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (cfg.out / "report.md").write_text(render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# A home volunteer on a slow link (`hetero-node-lab slow-link`)",
        "",
        "| run | node | rounds finished | contributed | mean round period s | mean exchange s | inner steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for run, nodes in report["runs"].items():
        for name, n in nodes.items():
            period = "-" if n["period_s"] is None else f"{n['period_s']:.2f}"
            comm = "-" if n["comm_s"] is None else f"{n['comm_s']:.2f}"
            lines.append(f"| {run} | {name} | {n['rounds']} | {n['contributed']} | {period} | {comm} | "
                         f"{n['inner_steps']} |")  # fmt: skip
    share, longer = report["volunteer_contribution_share"], report["others_lengthening"]
    lines += [
        "",
        f"- {VOLUNTEER} contributed in {'-' if share is None else f'{share:.0%}'} of the rounds it finished on the "
        "slow link.",
        f"- The others' rounds were {'-' if longer is None else f'{longer:+.1%}'} longer than in the baseline run.",
        "",
        *(f"- {'met' if met else 'missed'}: {target}" for target, met in report["targets"].items()),
        "",
    ]
    return "\n".join(lines)
