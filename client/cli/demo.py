"""`hetero-node demo`: a bootstrap, full replicas and virtual replicas (pipeline-stage peers) on 127.0.0.1, a live
table, a summary and a JSON report.

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

from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.protocol.errors import ConfigError, HeteroNodeError, require_positive
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig


@dataclass(frozen=True)
class DemoConfig:
    """The local swarm to run; the defaults take a few minutes on a 2-core laptop."""

    preset: str = field(default="small", metadata={"help": "Model preset: tiny or small (bigger ones need a GPU)."})
    full: int = field(default=2, metadata={"help": "Number of full replicas."})
    virtual: int = field(default=1, metadata={"help": "Number of virtual replicas (one stage peer per stage each)."})
    rounds: int = field(default=6, metadata={"help": "Outer rounds to run."})
    inner_steps: int = field(default=30, metadata={"help": "H: inner steps per round."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per inner step, per replica."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    stages: int = field(default=2, metadata={"help": "Pipeline stages = parameter shards (one averaging group each)."})
    activation_compression: str = field(
        default="subspace", metadata={"help": "Virtual replicas' boundaries: subspace, none, or compress-all."}
    )
    subspace_rank: int = field(default=0, metadata={"help": "Boundary rank k (0: d_model/8)."})
    outer: str = field(default="sparseloco", metadata={"help": "sparseloco, or diloco for the dense baseline."})
    diloco_wire: str = field(default="fp32", metadata={"help": "DiLoCo all-reduce wire dtype: fp32 or fp16."})
    lr: float = field(default=2e-3, metadata={"help": "Peak inner learning rate."})
    round_s: float = field(default=0.0, metadata={"help": "Round length in seconds (0: H steps at the fastest speed)."})
    target_utilisation: float = field(
        default=OuterConfig.target_utilisation,
        metadata={"help": "Share of a round training fills at least, next to the round's measured costs (0: off)."},
    )
    overlap_utilisation: float = field(
        default=OuterConfig.overlap_utilisation,
        metadata={"help": "The same under --overlap, where a round costs training only its settling (0: off)."},
    )
    min_inner_steps: int = field(default=1, metadata={"help": "Fewest inner steps a replica trains to contribute."})
    max_inner_steps: int = field(
        default=0, metadata={"help": "Most inner steps per round (0: no cap; = H with --min-inner-steps H: fixed H)."}
    )
    overlap: bool = field(default=False, metadata={"help": "Full replicas train on while a round's exchange runs."})
    max_contributors: int = field(
        default=OuterConfig.max_contributors, metadata={"help": "K: messages a round aggregates at most (0: all)."}
    )
    aggregation: str = field(
        default="mean",
        metadata={"help": "mean: the demo's peers are your own processes; robust: a public swarm's default."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the initial weights and the data order."})
    report: Path | None = field(default=None, metadata={"help": "Write the JSON report here."})
    workdir: Path | None = field(
        default=None, metadata={"help": "Logs, metrics and checkpoints (default: a temp dir)."}
    )

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "inner_steps", "batch_size", "seq_len", "stages", "lr", "min_inner_steps")
        if min(self.round_s, self.max_inner_steps, self.seed, self.max_contributors) < 0:
            raise ConfigError("--round-s, --max-inner-steps, --seed and --max-contributors must not be negative")
        if self.full < 0 or self.virtual < 0 or self.full + self.virtual < 1:
            raise ConfigError(f"--full {self.full} --virtual {self.virtual}: the swarm needs at least one replica")
        if self.virtual and self.stages < 2:
            raise ConfigError("--virtual needs --stages ≥ 2: a virtual replica is a pipeline of stages")
        if self.activation_compression == "compress-all" and self.full:
            raise ConfigError(
                "--activation-compression compress-all trains every replica as a virtual replica: --full 0"
            )

    @property
    def peers(self) -> list[str]:
        """Process names: replica0.., then vr0-stage0, vr0-stage1, ..."""
        stages = [f"vr{v}-stage{s}" for v in range(self.virtual) for s in range(self.stages)]
        return [f"replica{i}" for i in range(self.full)] + stages


def run_args(cfg: DemoConfig) -> list[str]:
    """The run definition the demo's bootstrap announces (replicas learn it from there)."""
    run = RunOptions(preset=cfg.preset, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    outer = OuterConfig(
        outer=cfg.outer, inner_steps=cfg.inner_steps, rounds=cfg.rounds, stages=cfg.stages,
        diloco_wire=cfg.diloco_wire, max_contributors=cfg.max_contributors, round_s=cfg.round_s,
        target_utilisation=cfg.target_utilisation, overlap_utilisation=cfg.overlap_utilisation,
        min_inner_steps=cfg.min_inner_steps,
        max_inner_steps=cfg.max_inner_steps, overlap=cfg.overlap, aggregation=cfg.aggregation,
    )  # fmt: skip
    optim = OptimConfig(lr=cfg.lr, warmup_steps=min(OptimConfig.warmup_steps, cfg.inner_steps))
    pipeline = PipelineConfig(activation_compression=cfg.activation_compression, subspace_rank=cfg.subspace_rank)
    return to_argv(run, outer, optim, pipeline, explicit={"aggregation"})  # the bootstrap's default is another


def peer_args(cfg: DemoConfig, peers: str, name: str, workdir: Path) -> list[str]:
    """The `hetero-node join` command line of peer `name`: only node options, as a volunteer would type. Stage
    peers pin their stage, so the planner fills one virtual replica after another."""
    full = name.startswith("replica")
    node = NodeConfig(
        peers=[peers], replica_id=cfg.peers.index(name), metrics=workdir / f"{name}.jsonl",
        checkpoint_dir=workdir / f"{name}.ckpt" if full else None, min_peers=cfg.full + cfg.virtual,
    )  # fmt: skip
    role = ["--role", "full"] if full else ["--role", "stage", "--stage", name.rsplit("stage", 1)[1]]
    return ["join", *role, *to_argv(node), "--quiet"]


def build_report(metrics_files: list[Path]) -> dict[str, Any]:
    """The demo/benchmark report: run settings plus every peer's per-round records."""
    from hetero_node.models.config import get_preset  # the CLI imports this module; keep --help instant

    peers, run = [], {}
    for path in metrics_files:
        header, rounds = read_metrics(path)
        if not header:
            continue
        settings = header["run"]
        model = get_preset(settings["preset"], vocab_size=settings["vocab_size"])
        pipeline = settings["pipeline"]
        run = {
            "preset": settings["preset"],
            "n_params": model.n_params(),  # the whole model (a stage peer's header counts its shard)
            "H": settings["outer"]["inner_steps"],
            "outer": settings["outer"]["outer"],
            "stages": settings["outer"]["stages"],
            "batch_size": settings["batch_size"],
            "seq_len": settings["seq_len"],
            "sparseloco": settings["sparseloco"],
            "d_model": model.d_model,
            "subspace_rank": pipeline["subspace_rank"] or max(1, model.d_model // 8),
            "activation_compression": pipeline["activation_compression"],
            "boundary_wire": pipeline["boundary_wire"],
            "vocab_size": settings["vocab_size"],
        }
        peers.append(
            {
                "peer_id": header["peer_id"],
                "role": header["role"],
                "stage": header["stage"],
                "vr": header["vr"],
                "replica_id": header.get("replica_id"),
                "rounds": rounds,
            }
        )
    return {"run": run, "peers": peers}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: loss endpoints, bytes per round per peer vs dense fp32 all-reduce, agreement."""
    rounds = [r for p in report["peers"] for r in p["rounds"]]
    if not rounds:
        raise HeteroNodeError("no replica completed a round; see the logs in the demo's work directory")
    # the swarm's model as full replicas evaluate it; without any, as the virtual replicas' pipelines do
    evaluators = [p for p in report["peers"] if p["role"] == "full"] or report["peers"]
    evals = sorted((r["round"], r["eval_loss"]) for p in evaluators for r in p["rounds"] if r["eval_loss"] is not None)
    vr_evals = sorted(
        (r["round"], r["eval_loss"])
        for p in report["peers"]
        if p["role"] == "stage"
        for r in p["rounds"]
        if r["eval_loss"] is not None
    )
    by_round: dict[int, dict[str, set[str]]] = {}  # round → shard (or a table) → fingerprints peers hold
    for r in rounds:
        for key, value in r["fingerprints"].items():
            by_round.setdefault(r["round"], {}).setdefault(key, set()).add(value)
    sent = statistics.mean(r["bytes_sent"] for r in rounds)
    dense = (
        statistics.mean(r["dense_allreduce_bytes"] for r in rounds if r["dense_allreduce_bytes"])
        if any(r["dense_allreduce_bytes"] for r in rounds)
        else 0
    )
    return {
        "eval_loss_first_round": evals[0][1] if evals else None,
        "eval_loss_last_round": evals[-1][1] if evals else None,
        **({"virtual_replica_eval_loss_last_round": vr_evals[-1][1]} if vr_evals else {}),
        "bytes_sent_per_round_per_peer": sent,
        "dense_fp32_allreduce_bytes_per_round_per_peer": dense,
        "compression_vs_dense": dense / sent if sent and dense else None,
        "compute_s_per_round": statistics.mean(r["compute_s"] for r in rounds),
        "full_replica_compute_utilisation": _lowest_utilisation(report),
        "comm_s_per_round": statistics.mean(r["comm_s"] for r in rounds),
        "rounds_with_agreeing_fingerprints": sum(
            1 for shards in by_round.values() if all(len(fps) == 1 for fps in shards.values())
        ),
        "rounds": len(by_round),
        **_boundary_summary(report),
    }


def compute_utilisation(rounds: list[dict[str, Any]]) -> float | None:
    """A peer's share of wall time spent in inner steps, from the end of its first trained round to the end of its
    last: Σ compute_s of the rounds after the first over the time between (`trained_at`; None with fewer than two
    trained rounds)."""
    timed = sorted((r["trained_at"], r["compute_s"]) for r in rounds if r.get("trained_at"))
    if len(timed) < 2 or timed[-1][0] <= timed[0][0]:
        return None
    return sum(compute for _, compute in timed[1:]) / (timed[-1][0] - timed[0][0])


def _lowest_utilisation(report: dict[str, Any]) -> float | None:
    """The lowest compute utilisation among the full replicas (None without any that recorded two rounds)."""
    values = [compute_utilisation(p["rounds"]) for p in report["peers"] if p["role"] == "full"]
    return min((v for v in values if v is not None), default=None)


def _boundary_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Pipeline traffic per token a virtual replica trains (all boundaries, both directions), measured on the
    stream, next to the codec's figure for dense boundaries at the same wire dtype."""
    from hetero_node.protocol.boundary_codec import BACKWARD, FORWARD, boundary_bytes_per_token

    stage_rounds = [r for p in report["peers"] if p["role"] == "stage" for r in p["rounds"]]
    trained = sum(r["tokens"] for p in report["peers"] if p["role"] == "stage" and p["stage"] == 0 for r in p["rounds"])
    if not trained:
        return {}
    run = report["run"]
    id_bytes = 2 if run["vocab_size"] <= 1 << 16 else 4
    dense = (run["stages"] - 1) * sum(
        boundary_bytes_per_token(run["d_model"], run["boundary_wire"], d, id_bytes) for d in (FORWARD, BACKWARD)
    )
    measured = sum(r["boundary_bytes_sent"] for r in stage_rounds) / trained
    return {"boundary_bytes_per_token": measured, "boundary_bytes_per_token_dense": dense}


def _live_table(report: dict[str, Any], cfg: DemoConfig) -> Table:
    table = Table(
        title=f"hetero-node demo: {cfg.full} full + {cfg.virtual} virtual replicas ({cfg.stages} stages), "
        f"{cfg.preset}, {cfg.outer}, H={cfg.inner_steps}"
    )
    for column in ("peer", "role", "round", "train loss", "eval loss", "tokens/s", "bytes/round", "fingerprint"):
        table.add_column(column)
    for peer in report["peers"]:
        last = peer["rounds"][-1] if peer["rounds"] else None
        role = peer["role"] if peer["role"] != "stage" else f"vr {peer['vr']} stage {peer['stage']}"
        if last is None:
            table.add_row(peer["peer_id"][-8:], role, "joining", "", "", "", "", "")
            continue
        seconds = last["compute_s"] + last["comm_s"]
        table.add_row(
            peer["peer_id"][-8:],
            role,
            f"{last['round'] + 1}/{cfg.rounds}",
            "" if last["train_loss"] is None else f"{last['train_loss']:.3f}",
            "" if last["eval_loss"] is None else f"{last['eval_loss']:.3f}",
            f"{last['tokens'] / seconds:,.0f}" if seconds else "",
            f"{last['bytes_sent']:,}",
            " ".join(v[:6] for v in last["fingerprints"].values()),
        )
    return table


def run_demo(cfg: DemoConfig, console: Console) -> dict[str, Any]:
    """Run the swarm to completion with a live table; returns the report (summary under "summary")."""
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="hetero-node-demo-"))
    metrics = [workdir / f"{name}.jsonl" for name in cfg.peers]
    console.print(f"[bold]work directory:[/] {workdir}  (logs, metrics, checkpoints)")
    started = time.monotonic()
    with LocalSwarm(workdir) as swarm, Live(console=console, refresh_per_second=2) as live:
        peers = swarm.start_bootstrap(run_args(cfg))
        for name in cfg.peers:
            swarm.start(name, peer_args(cfg, peers, name, workdir))
        running = list(cfg.peers)
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
