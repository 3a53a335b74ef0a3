"""`hetero-node demo`: a bootstrap and N full replicas on 127.0.0.1, a live table, a summary and a JSON report.

Every peer is a real `hetero-node join` process talking through hivemind; this module only starts them, tails
their metrics files and summarises. The report's keys are stable (benchmarks read them).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from hetero_node.client.local_swarm import LocalSwarm
from hetero_node.client.metrics import read_metrics
from hetero_node.protocol.errors import HeteroNodeError, require_positive


@dataclass(frozen=True)
class DemoConfig:
    """The local swarm to run; the defaults take a few minutes on a 2-core laptop."""

    preset: str = field(default="small", metadata={"help": "Model preset: tiny or small (bigger ones need a GPU)."})
    full: int = field(default=3, metadata={"help": "Number of full replicas."})
    rounds: int = field(default=6, metadata={"help": "Outer rounds to run."})
    inner_steps: int = field(default=30, metadata={"help": "H: inner steps per round."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per inner step, per replica."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    stages: int = field(default=2, metadata={"help": "Parameter shards (one averaging group each)."})
    outer: str = field(default="sparseloco", metadata={"help": "sparseloco, or diloco for the dense baseline."})
    diloco_wire: str = field(default="fp32", metadata={"help": "DiLoCo all-reduce wire dtype: fp32 or fp16."})
    lr: float = field(default=2e-3, metadata={"help": "Peak inner learning rate."})
    report: Path | None = field(default=None, metadata={"help": "Write the JSON report here."})
    workdir: Path | None = field(
        default=None, metadata={"help": "Logs, metrics and checkpoints (default: a temp dir)."}
    )

    def __post_init__(self) -> None:
        require_positive(self, "full", "rounds", "inner_steps", "batch_size", "seq_len", "stages", "lr")


def run_args(cfg: DemoConfig) -> list[str]:
    """The run definition the demo's bootstrap announces (replicas learn it from there)."""
    return [
        "--preset", cfg.preset, "--rounds", str(cfg.rounds), "--inner-steps", str(cfg.inner_steps),
        "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len), "--stages", str(cfg.stages),
        "--outer", cfg.outer, "--diloco-wire", cfg.diloco_wire,
        "--lr", str(cfg.lr), "--warmup-steps", str(min(50, cfg.inner_steps)),
    ]  # fmt: skip


def replica_args(cfg: DemoConfig, peers: str, index: int, workdir: Path) -> list[str]:
    """The `hetero-node join` command line of replica `index`: only node options, as a volunteer would type."""
    return [
        "join", "--peers", peers, "--role", "full", "--replica-id", str(index),
        "--metrics", str(workdir / f"replica{index}.jsonl"),
        "--checkpoint-dir", str(workdir / f"replica{index}.ckpt"), "--min-peers", str(cfg.full), "--quiet",
    ]  # fmt: skip


def build_report(metrics_files: list[Path]) -> dict[str, Any]:
    """The demo/benchmark report: run settings plus every peer's per-round records."""
    peers, run = [], {}
    for path in metrics_files:
        header, rounds = read_metrics(path)
        if not header:
            continue
        settings = header["run"]
        run = {
            "preset": settings["preset"],
            "n_params": header["n_params"],
            "H": settings["outer"]["inner_steps"],
            "outer": settings["outer"]["outer"],
            "stages": settings["outer"]["stages"],
            "batch_size": settings["batch_size"],
            "seq_len": settings["seq_len"],
            "sparseloco": settings["sparseloco"],
        }
        peers.append(
            {
                "peer_id": header["peer_id"],
                "role": header["role"],
                "stage": header["stage"],
                "vr": header["vr"],
                "replica_id": header["replica_id"],
                "rounds": rounds,
            }
        )
    return {"run": run, "peers": peers}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: loss endpoints, bytes per round per peer vs dense fp32 all-reduce, agreement."""
    rounds = [r for p in report["peers"] for r in p["rounds"]]
    if not rounds:
        raise HeteroNodeError("no replica completed a round; see the logs in the demo's work directory")
    evals = sorted((r["round"], r["eval_loss"]) for r in rounds if r["eval_loss"] is not None)
    by_round: dict[int, set[str]] = {}
    for r in rounds:
        by_round.setdefault(r["round"], set()).add(json.dumps(r["fingerprints"], sort_keys=True))
    sent = statistics.mean(r["bytes_sent"] for r in rounds)
    dense = (
        statistics.mean(r["dense_allreduce_bytes"] for r in rounds if r["dense_allreduce_bytes"])
        if any(r["dense_allreduce_bytes"] for r in rounds)
        else 0
    )
    return {
        "eval_loss_first_round": evals[0][1] if evals else None,
        "eval_loss_last_round": evals[-1][1] if evals else None,
        "bytes_sent_per_round_per_peer": sent,
        "dense_fp32_allreduce_bytes_per_round_per_peer": dense,
        "compression_vs_dense": dense / sent if sent else None,
        "compute_s_per_round": statistics.mean(r["compute_s"] for r in rounds),
        "comm_s_per_round": statistics.mean(r["comm_s"] for r in rounds),
        "rounds_with_agreeing_fingerprints": sum(1 for v in by_round.values() if len(v) == 1),
        "rounds": len(by_round),
    }


def _live_table(report: dict[str, Any], cfg: DemoConfig) -> Table:
    table = Table(title=f"hetero-node demo: {cfg.full} full replicas, {cfg.preset}, {cfg.outer}, H={cfg.inner_steps}")
    for column in ("peer", "role", "round", "train loss", "eval loss", "tokens/s", "bytes/round", "fingerprint"):
        table.add_column(column)
    for peer in report["peers"]:
        last = peer["rounds"][-1] if peer["rounds"] else None
        if last is None:
            table.add_row(peer["peer_id"][-8:], peer["role"], "joining", "", "", "", "", "")
            continue
        seconds = last["compute_s"] + last["comm_s"]
        table.add_row(
            peer["peer_id"][-8:],
            peer["role"],
            f"{last['round'] + 1}/{cfg.rounds}",
            f"{last['train_loss']:.3f}",
            "" if last["eval_loss"] is None else f"{last['eval_loss']:.3f}",
            f"{last['tokens'] / seconds:,.0f}" if seconds else "",
            f"{last['bytes_sent']:,}",
            " ".join(v[:6] for v in last["fingerprints"].values()),
        )
    return table


def run_demo(cfg: DemoConfig, console: Console) -> dict[str, Any]:
    """Run the swarm to completion with a live table; returns the report (summary under "summary")."""
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="hetero-node-demo-"))
    metrics = [workdir / f"replica{i}.jsonl" for i in range(cfg.full)]
    console.print(f"[bold]work directory:[/] {workdir}  (logs, metrics, checkpoints)")
    started = time.monotonic()
    with LocalSwarm(workdir) as swarm, Live(console=console, refresh_per_second=2) as live:
        peers = swarm.start_bootstrap(run_args(cfg))
        for i in range(cfg.full):
            swarm.start(f"replica{i}", replica_args(cfg, peers, i, workdir))
        running = [f"replica{i}" for i in range(cfg.full)]
        while running:
            live.update(_live_table(build_report(metrics), cfg))
            time.sleep(1.0)
            running = [n for n in running if swarm.processes[n].poll() is None]
        live.update(_live_table(build_report(metrics), cfg))
        failed = [n for n in swarm.processes if n != "bootstrap" and swarm.processes[n].returncode != 0]
    report = build_report(metrics)
    report["summary"] = summarize(report)
    report["summary"]["wall_s"] = time.monotonic() - started
    report["summary"]["failed_peers"] = failed
    if cfg.report is not None:
        cfg.report.parent.mkdir(parents=True, exist_ok=True)
        cfg.report.write_text(json.dumps(report, indent=2))
    return report
