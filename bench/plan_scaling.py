"""`hetero-node-lab plan-scaling`: the cost model's weak scaling from 10 to 1,000 volunteers, for today's protocol, the
ones before it (later stages fetching T_fixed whole; every member fetching every message) and a butterfly, with
the planner choosing roles, virtual replicas, rank and H at every size.

A swarm of n is the first n nodes of the swarm file's nodes in a fixed shuffle (seed 0), so every size has the
file's mix. Weak scaling = the swarm's predicted tokens/s over the sum of each node's solo full-model tokens/s (a
node too small to hold the model counted at its compute speed), over all nodes and over the nodes that train.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import PlanScalingConfig
from hetero_node.bench.results import write_report
from hetero_node.client.cli.plan import choice_summary, sizing_run
from hetero_node.client.config import OptimConfig, RunOptions
from hetero_node.client.swarm.auto_plan import auto_plan
from hetero_node.client.swarm.swarm_file import load_swarm
from hetero_node.models.config import get_preset
from hetero_node.protocol.errors import positive_int_list
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

PLOT = "weak_scaling.png"
DESIGNS = {
    "dense T_fixed (before)": ("all-to-all", "dense", False),
    "all-to-all (before)": ("all-to-all", "changes", False),
    "today": ("relay-tree", "changes", False),
    "butterfly": ("butterfly", "changes", False),
    "today + windows": ("relay-tree", "changes", True),
    "butterfly + windows": ("butterfly", "changes", True),
}
"""design → (exchange, T_fixed upkeep, cadence): the protocol before T_fixed followed E_S's changes, the one before
the flat exchange, today's (at most K = `--max-contributors` messages a round through relay trees), a butterfly
exchange (modelled only), and both with slow replicas contributing once per window of rounds (`cadence`, modelled
only, stale tokens at the lab's value)."""


def run_plan_scaling(cfg: PlanScalingConfig, progress: Progress | None = None) -> dict[str, Any]:
    run = sizing_run(
        RunOptions(preset=cfg.preset, batch_size=cfg.batch_size, seq_len=cfg.seq_len),
        OuterConfig(stages=cfg.stages, inner_steps=cfg.inner_steps), OptimConfig(), SparseLoCoConfig(),
        PipelineConfig(microbatches=cfg.microbatches),
    )  # fmt: skip
    nodes, links = load_swarm(cfg.swarm, get_preset(run.preset, vocab_size=run.vocab_size).n_params())
    random.Random(0).shuffle(nodes)
    rows = []
    task = progress.add_task("swarm sizes", total=len(cfg.size_list) * len(DESIGNS)) if progress else None
    for n in cfg.size_list:
        peers = {p.peer_id: p for p in nodes[:n]}
        for design, (exchange, upkeep, cadence) in DESIGNS.items():
            model = dataclasses.replace(links, exchange=exchange, table_upkeep=upkeep, cadence=cadence)
            result = auto_plan(peers.values(), run, model, positive_int_list(cfg.h_choices, "--h-choices"))
            tuned = result.live_tuned or result.live
            rows.append({"nodes": n, "design": design, "best": choice_summary(result.best, peers),
                         "live": choice_summary(result.live, peers), "live_tuned": choice_summary(tuned, peers),
                         "idle": len(result.idle)})  # fmt: skip
            if progress is not None and task is not None:
                progress.advance(task)
    report = {"config": {k: str(v) for k, v in vars(cfg).items()}, "rows": rows}
    write_report(cfg.out, report, render_markdown(report))
    _plot(rows, cfg)
    return report


def render_markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"# Weak scaling by the cost model: {c['preset']}, batch {c['batch_size']} × {c['seq_len']}, "
        f"{c['stages']} stages, H from {c['h_choices']} ({c['swarm']})",
        "",
        "| nodes | design | full + virtual replicas (windowed; idle) | nodes training | messages aggregated per "
        "round | H × batches per step / rank | round s | tokens/s (trained) | "
        "weak scaling (all / training) | max exchange MB per peer per round (up / down) | "
        "the live planner: tokens/s, weak scaling (at the plan's H and rank) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        b, live, tuned = r["best"], r["live"], r["live_tuned"]
        lines.append(
            f"| {r['nodes']:,} | {r['design']} | {b['full_replicas']} + {b['virtual_replicas']} "
            f"({b['windowed_replicas']}; {r['idle']}) | {b['training_nodes']:,} | "
            f"{b['aggregated']} of {b['contributors']} | {b['inner_steps']} × {b['accumulation']} / "
            f"{b['rank'] or 'dense'} | {b['round_s']:,.1f} | {b['tokens_per_s']:,.0f} "
            f"({b['trained_tokens_per_s']:,.0f}) | {b['weak_scaling']:.0%} / {b['used_scaling']:.0%} | "
            f"{b['max_exchange_bytes_up_per_peer'] / 1e6:,.1f} / {b['max_exchange_bytes_down_per_peer'] / 1e6:,.1f} | "
            f"{live['tokens_per_s']:,.0f}, {live['weak_scaling']:.0%} ({tuned['weak_scaling']:.0%}) |"
        )
    return "\n".join([*lines, "", f"![weak scaling]({PLOT})", ""])


def _plot(rows: list[dict[str, Any]], cfg: PlanScalingConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for design in DESIGNS:
        mine = [r for r in rows if r["design"] == design]
        sizes = [r["nodes"] for r in mine]
        line = left.plot(sizes, [r["best"]["weak_scaling"] for r in mine], marker="o", label=f"{design}, planned")
        left.plot(sizes, [r["live"]["weak_scaling"] for r in mine], marker="x", linestyle=":",
                  color=line[0].get_color(), label=f"{design}, the live planner")  # fmt: skip
        right.plot(sizes, [r["best"]["max_exchange_bytes_down_per_peer"] / 1e6 for r in mine], marker="o",
                   label=design)  # fmt: skip
    left.set(xscale="log", xlabel="nodes", ylabel="weak-scaling efficiency", ylim=(0, 1))
    right.set(xscale="log", yscale="log", xlabel="nodes", ylabel="max exchange MB downloaded per peer per round")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(cfg.out / PLOT, dpi=120)
    plt.close(fig)
