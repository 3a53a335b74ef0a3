"""`hetero-node-lab agreement`: the swarm CI runs in its tests, looped, with the figures a fork would show.

Each run is a fresh loopback swarm (a bootstrap and N full replicas of `tiny` on 2 shards, started together as
the tests start them); the report counts, over all runs, rounds in which two replicas that completed them hold
different weights (goal 0), rounds some replica aggregated without all N (a split or a missed round), and runs
in which a replica did not exit 0.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import AgreementConfig
from hetero_node.bench.kill_soak import disagreeing_rounds, rounds_of
from hetero_node.bench.results import write_report
from hetero_node.client.cli.local_swarm import LocalSwarm, fresh_dir
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts
from hetero_node.protocol.run_config import OuterConfig

EXIT_TIMEOUT_S = 300.0


def swarm_argvs(cfg: AgreementConfig, peers: str | None, workdir: Path, index: int) -> list[str]:
    """The bootstrap's run options (`peers` None) or replica `index`'s join line: the tests' swarm."""
    if peers is None:
        run = RunOptions(preset="tiny", batch_size=8, seq_len=64)
        outer = OuterConfig(rounds=cfg.rounds, inner_steps=cfg.inner_steps, stages=2, target_utilisation=0.0)
        return to_argv(run, outer, OptimConfig(warmup_steps=5, lr=3e-3))
    node = NodeConfig(
        peers=[peers], replica_id=index, record_refresh_s=3, settle_s=1, bandwidth_mbps=1000, min_peers=cfg.replicas,
        metrics=workdir / f"r{index}.jsonl", checkpoint_dir=workdir / f"r{index}.ckpt",
    )  # fmt: skip
    timeouts = SyncTimeouts(matchmaking_s=3, round_timeout_s=20, fetch_timeout_s=10)
    return ["--log-level", "INFO", "join", "--role", "full", *to_argv(node, timeouts), "--quiet"]


def run_once(cfg: AgreementConfig, workdir: Path) -> dict[str, Any]:
    """One swarm to its last round: each replica's exit code and round records."""
    names = [f"r{i}" for i in range(cfg.replicas)]
    with LocalSwarm(workdir) as swarm:
        peers = swarm.start_bootstrap(swarm_argvs(cfg, None, workdir, -1))
        for i, name in enumerate(names):
            swarm.start(name, swarm_argvs(cfg, peers, workdir, i))
        exits = {}
        for name in names:
            try:
                exits[name] = swarm.wait(name, EXIT_TIMEOUT_S)
            except Exception as e:  # a hung replica is a failed run, not a crashed bench
                exits[name] = repr(e)
    return {"exits": exits, "rounds": {name: rounds_of(workdir / f"{name}.jsonl") for name in names}}


def analyse_run(run: dict[str, Any], replicas: int) -> dict[str, Any]:
    per_peer = run["rounds"]
    records = [r for rounds in per_peer.values() for r in rounds.values()]
    return {
        "failed": sorted(name for name, code in run["exits"].items() if code != 0),
        "disagreeing_rounds": disagreeing_rounds(per_peer),
        "partial_rounds": sorted({r["round"] for r in records if r["contributors"] != replicas}),
        "comm_s": [r["comm_s"] for r in records],
    }


def summarise(cfg: AgreementConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    waits = sorted(w for run in runs for w in run["comm_s"])
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "runs": len(runs),
        "failed_runs": sum(1 for run in runs if run["failed"]),
        "rounds": len(runs) * cfg.rounds,
        "disagreeing_rounds": sum(len(run["disagreeing_rounds"]) for run in runs),
        "rounds_without_every_replica": sum(len(run["partial_rounds"]) for run in runs),
        "median_comm_s": waits[len(waits) // 2] if waits else None,
        "per_run": [{k: v for k, v in run.items() if k != "comm_s"} for run in runs],
    }


def run_agreement(cfg: AgreementConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Every run, then the report (also `out/report.json` and `report.md`); logs of the last run in `out/logs`."""
    task = progress.add_task("swarms", total=cfg.runs) if progress else None
    runs = []
    for _ in range(cfg.runs):
        runs.append(analyse_run(run_once(cfg, fresh_dir(cfg.out / "logs")), cfg.replicas))
        if progress is not None and task is not None:
            progress.advance(task)
    report = summarise(cfg, runs)
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = [
        ("swarms run", f"{report['runs']} × {c['replicas']} full replicas × {c['rounds']} rounds (tiny, 2 shards)"),
        ("runs with a replica not exiting 0 (goal 0)", report["failed_runs"]),
        ("rounds in which replicas disagreed (goal 0)", f"{report['disagreeing_rounds']} of {report['rounds']}"),
        ("rounds some replica aggregated without all", report["rounds_without_every_replica"]),
        ("median exchange time of a round, s", f"{report['median_comm_s']:.2f}" if report["median_comm_s"] else "-"),
    ]
    lines = ["| figure | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    return "# Round agreement, looped\n\n" + "\n".join(lines) + "\n"
