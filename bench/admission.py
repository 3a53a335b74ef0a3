"""`hetero-node-lab admission`: loss-scored admission in real swarms, against a negating replica.

The byzantine lab (`bench/byzantine.py`) measures the rules in one process; this bench runs the nodes. Each cell is a
fresh swarm on loopback: a `hetero-node bootstrap` announcing the cell's rule (`--aggregation`, and `--admission
loss` for a `+loss` rule), two honest full replicas and, for `negate`, a third that sends −3 × its own Δ
(`bench/negating_peer.py`). Every replica trains exactly H steps a round, so two cells of one rule differ only by
the attacker. The figures come from the honest replicas' own round records: eval loss after each round, who the
round counted, what it dropped and why, and how long judging took (the `judge` phase: scoring each selected message
on the probe batches and agreeing the verdicts through the DHT).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from hetero_node.bench.byzantine import progress_kept, worst_round
from hetero_node.bench.config import AdmissionConfig
from hetero_node.bench.results import write_report
from hetero_node.client.cli.local_swarm import LocalSwarm, fresh_dir
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.models.data import build_token_store, val_batches
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.replica_model import full_model
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.models.trainer import mean_loss
from hetero_node.protocol.run_config import OuterConfig, RunConfig

HONEST = 2
NEGATING_PEER = ["-m", "hetero_node.bench.negating_peer"]
LOSS_RULE = "+loss"
REFUSED = "does not lower the probe loss"
"""What a round record's `dropped` says of a message the loss verdicts left out (`ShardSync._admit`)."""


def run_args(cfg: AdmissionConfig, rule: str) -> list[str]:
    """The bootstrap's run options for `rule` (named explicitly: a public swarm's bootstrap otherwise announces
    robust)."""
    outer = OuterConfig(
        rounds=cfg.rounds, inner_steps=cfg.inner_steps, stages=2, target_utilisation=0.0,
        min_inner_steps=cfg.inner_steps, max_inner_steps=cfg.inner_steps, aggregation=rule.removesuffix(LOSS_RULE),
        admission="loss" if rule.endswith(LOSS_RULE) else "none",
    )  # fmt: skip
    run = RunOptions(preset="tiny", batch_size=8, seq_len=64)
    return to_argv(run, outer, OptimConfig(warmup_steps=5, lr=3e-3), explicit={"aggregation"})


def join_args(peers: str, index: int, workdir: Path, everyone: int) -> list[str]:
    node = NodeConfig(
        peers=[peers], replica_id=index, record_refresh_s=3, settle_s=1, bandwidth_mbps=1000, min_peers=everyone,
        metrics=workdir / f"r{index}.jsonl",
    )  # fmt: skip
    timeouts = SyncTimeouts(matchmaking_s=3, round_timeout_s=20, fetch_timeout_s=10)
    return ["--log-level", "INFO", "join", "--role", "full", *to_argv(node, timeouts), "--quiet"]


def run_cell(cfg: AdmissionConfig, attack: str, rule: str, workdir: Path) -> dict[str, Any]:
    """One swarm; the honest replicas' round records, summarised."""
    everyone = HONEST + (attack == "negate")
    with LocalSwarm(fresh_dir(workdir)) as swarm:
        peers = swarm.start_bootstrap(run_args(cfg, rule))
        for i in range(HONEST):
            swarm.start(f"r{i}", join_args(peers, i, workdir, everyone))
        if attack == "negate":
            swarm.start(
                "negating", join_args(peers, HONEST, workdir, everyone), program=[sys.executable, *NEGATING_PEER]
            )
        for i in range(HONEST):
            code = swarm.wait(f"r{i}", 60.0 + 30.0 * cfg.rounds)
            if code != 0:
                raise RuntimeError(f"r{i} exited with {code}: {swarm.log_path(f'r{i}').read_text()[-2000:]}")
    header, _ = read_metrics(workdir / "r0.jsonl")
    records = [{r["round"]: r for r in read_metrics(workdir / f"r{i}.jsonl")[1]} for i in range(HONEST)]
    attacker = read_metrics(workdir / f"r{HONEST}.jsonl")[0]["peer_id"] if attack == "negate" else None
    return summarise(attack, rule, RunConfig.from_dict(header["run"]), records, range(cfg.rounds), attacker)


def summarise(
    attack: str,
    rule: str,
    run: RunConfig,
    records: list[dict[int, dict[str, Any]]],
    rounds: range,
    attacker: str | None = None,
) -> dict[str, Any]:
    """A cell's figures from its honest replicas' records (every round's eval loss from whichever evaluated it);
    `attacker`: the negating peer's id. Per record (a replica's round, both shards): the attacker was counted if it
    was in the group and no shard dropped it, refused if a shard's loss verdicts did."""
    curve = [start_loss(run)]
    for t in rounds:
        losses = [r[t]["eval_loss"] for r in records if t in r and r[t]["eval_loss"] is not None]
        if not losses:
            raise RuntimeError(f"no honest replica evaluated round {t}")
        curve.append(losses[0])
    mine = [r[t] for r in records for t in rounds if t in r]
    attacked = [r for r in mine if attacker is not None and r["group_size"] > HONEST and r["contributors"] > 0]
    named = [[d for d in r["dropped"] if attacker is not None and d.startswith(attacker)] for r in attacked]
    return {
        "attack": attack,
        "rule": rule,
        "curves": [curve],
        "finals": [curve[-1]],
        "agree": all(agreed(records, t) for t in rounds),
        "attacked_rounds": len(attacked),
        "attacker_counted": sum(not reasons for reasons in named),
        "attacker_refused": sum(any(REFUSED in d for d in reasons) for reasons in named),
        "judge_s": statistics.fmean(r["phases_s"].get("judge", 0.0) for r in mine) if mine else 0.0,
        "overhead_s": statistics.fmean(r["overhead_s"] for r in mine) if mine else 0.0,
    }


def agreed(records: list[dict[int, dict[str, Any]]], round_: int) -> bool:
    """The replicas that recorded `round_` hold the same θ after it."""
    return len({json.dumps(r[round_]["fingerprints"], sort_keys=True) for r in records if round_ in r}) == 1


def start_loss(run: RunConfig) -> float:
    """Eval loss of θ(0) on the nodes' own held-out batches (every cell starts from the run seed's model)."""
    store = build_token_store(None, load_tokenizer(None), default_cache_dir())
    model, _ = full_model(run, torch.device("cpu"))
    return mean_loss(
        model, val_batches(store, run.batch_size, run.seq_len, NodeConfig().eval_batches), torch.device("cpu")
    )


def run_admission(cfg: AdmissionConfig, progress: Progress) -> dict[str, Any]:
    task = progress.add_task("admission cells", total=len(cfg.cell_list))
    cells = []
    for cell in cfg.cell_list:
        attack, rule = cell.split(":")
        progress.update(task, description=f"{attack} under {rule}")
        cells.append(run_cell(cfg, attack, rule, cfg.out / "swarms" / f"{attack}-{rule}"))
        progress.advance(task)
    report = {"config": {"rounds": cfg.rounds, "inner_steps": cfg.inner_steps, "honest": HONEST}, "cells": cells}
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    """One row per cell: final eval loss, progress kept and worst round against the same rule's clean cell, how
    often the attacker was counted or refused, and what judging cost."""
    clean = {c["rule"]: c for c in report["cells"] if c["attack"] == "none"}
    lines = [
        "| attack | rule | eval loss | progress kept | worst round | attacker counted / refused (replica-rounds in a "
        "group with it) | judge s | overhead s | replicas agree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        base = clean.get(c["rule"])
        kept = f"{progress_kept(c, base):.0%}" if base else "–"
        worst = f"+{worst_round(c, base):.1%}" if base and c is not base else "–"
        seen = (
            f"{c['attacker_counted']} / {c['attacker_refused']} ({c['attacked_rounds']})"
            if c["attack"] != "none"
            else "–"
        )
        lines.append(
            f"| {c['attack']} | {c['rule']} | {c['finals'][0]:.3f} | {kept} | {worst} | {seen} | {c['judge_s']:.2f} | "
            f"{c['overhead_s']:.2f} | {'yes' if c['agree'] else 'NO'} |"
        )
    config = report["config"]
    lines.append(
        f"\n`tiny`, {config['honest']} honest full replicas (and a negating one: −3 × its Δ), {config['rounds']} "
        f"rounds of exactly H = {config['inner_steps']} steps, loopback; progress kept: the eval loss drop from θ(0) "
        "over the same rule's clean swarm's; worst round: the most the eval loss exceeded the clean swarm's after any "
        "round; judge: seconds a round spent scoring messages and agreeing verdicts (slowest shard, mean over rounds)."
    )
    return "\n".join(lines) + "\n"
