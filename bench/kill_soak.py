"""`hetero-node-lab kills`: a long loopback run in which random peers are SIGKILLed (and restarted) or frozen
(SIGSTOP, then SIGCONT), with figures on what the swarm did about it.

Peers are real `hetero-node join` processes (full replicas and one virtual replica's stages) with stable
identities and checkpoints, as a volunteer would run them; a killed peer is started again at once with the same
command line. The report says, from the peers' own metrics:

* rounds in which peers that completed the round hold different weights (goal 0);
* rounds whose exchange kept a peer waiting past the longest legitimate wait, `round_timeout_s` plus
  `fetch_timeout_s` (goal 0: nobody hangs);
* for every restart, how many rounds after the swarm's round at the kill the peer contributes again (goal ≤ 2),
  and how much of that went on starting the process (kill to its checkpoint resumed) and how much on the round
  protocol (from then to contributing); a restart whose peer, or a stage of its pipeline, is hit again before it
  contributes is counted apart ("interrupted"): no protocol can bring it back in time;
* of the start, the part before the node's first log line (the interpreter, its imports, p2pd and the DHT), beside
  the same imports timed on the idle machine before the swarm starts (`idle_import_s`): the soak runs five nodes on
  the machine's cores, so a restart's imports share the CPU with four training peers, which a volunteer's do not;
* peers that did not exit 0 within 30 s of SIGTERM at the end, and processes (p2pd included) left running.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import KillSoakConfig
from hetero_node.bench.results import write_report
from hetero_node.client.cli.local_swarm import LocalSwarm, fresh_dir
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.protocol.run_config import OuterConfig

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


def run_configs(
    preset: str, round_s: float, rounds: int = 100_000, inner_steps: int = 30
) -> tuple[RunOptions, OuterConfig, OptimConfig]:
    """A run that never ends by itself (the bench stops it), with time-boxed rounds of `round_s`."""
    return (
        RunOptions(preset=preset, batch_size=8, seq_len=64),
        OuterConfig(rounds=rounds, inner_steps=inner_steps, round_s=round_s, stages=2),
        OptimConfig(warmup_steps=5, lr=3e-3),
    )


def run_args(preset: str, round_s: float) -> list[str]:
    """The bootstrap's run options for `run_configs`."""
    return to_argv(*run_configs(preset, round_s))


def peer_args(
    peers: str, name: str, workdir: Path, index: int, host: str = "127.0.0.1", bandwidth_mbps: float = 1000,
    min_peers: int = 1,
) -> list[str]:  # fmt: skip
    """A peer's `join` command line; the same after a restart (identity, checkpoints, metrics file)."""
    role = ["--role", "full"] if name.startswith("r") else ["--role", "stage", "--stage", name[-1]]
    node = NodeConfig(
        peers=[peers], host=host, replica_id=index, identity=workdir / f"{name}.id",
        checkpoint_dir=workdir / f"{name}.ckpt", metrics=workdir / f"{name}.jsonl", record_refresh_s=3, settle_s=1,
        bandwidth_mbps=bandwidth_mbps, min_peers=min_peers,
    )  # fmt: skip
    timeouts = SyncTimeouts(matchmaking_s=3, round_timeout_s=20, fetch_timeout_s=10, stage_timeout_s=10)
    return ["--log-level", "INFO", "join", *role, *to_argv(node, timeouts), "--quiet"]


def rounds_of(path: Path) -> dict[int, dict[str, Any]]:
    """A peer's round records by round (a restarted peer's later record for the same round wins)."""
    return {r["round"]: r for r in read_metrics(path)[1] if "round" in r}


NODE_MODULES = (
    "hetero_node.client.node.join",
    "hetero_node.client.roles.full_replica",
    "hetero_node.client.roles.stage_peer",
)
"""What a joining node imports before it can run a role (torch and hivemind with them)."""


def time_node_imports() -> float:
    """Wall seconds a fresh interpreter takes to import `NODE_MODULES` (the baseline of a restart's start)."""
    started = time.monotonic()
    statement = "; ".join(f"import {module}" for module in NODE_MODULES)
    subprocess.run([sys.executable, "-c", statement], check=True)
    return round(time.monotonic() - started, 2)


def p2pd_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "p2pd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def run_kill_soak(cfg: KillSoakConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the scenario and return the report (also written to `out/report.json` and `report.md`)."""
    workdir = fresh_dir(cfg.out / "logs")
    names = [f"r{i}" for i in range(cfg.full)] + [f"vr{v}-s{s}" for v in range(cfg.virtual) for s in range(2)]
    rng = random.Random(cfg.seed)
    faults = ["kill"] * cfg.kills + ["freeze"] * cfg.freezes
    rng.shuffle(faults)
    before_p2pd = p2pd_pids()
    idle_import_s = time_node_imports()
    events: list[dict[str, Any]] = []
    groups: list[int] = []
    started = time.monotonic()
    with LocalSwarm(workdir) as swarm:
        peers = swarm.start_bootstrap(run_args(cfg.preset, cfg.round_s))
        current = {name: name for name in names}  # peer → the name of its running process (a restart gets a new one)
        for index, name in enumerate(names):
            groups.append(swarm.start(name, peer_args(peers, name, workdir, index)).pid)

        def swarm_round() -> int:
            return max(max(rounds_of(workdir / f"{n}.jsonl"), default=-1) for n in names)

        wait_until(lambda: swarm_round() >= 2, 300, "the swarm's first rounds")
        task = progress.add_task("faults", total=len(faults)) if progress else None
        for number, fault in enumerate(faults):
            time.sleep(cfg.interval_s)
            victim = rng.choice(names)
            at_round = swarm_round()
            if fault == "kill":
                swarm.stop(current[victim], sig=signal.SIGKILL)
                current[victim] = f"{victim}.{number}"
                args = peer_args(peers, victim, workdir, names.index(victim))
                groups.append(swarm.start(current[victim], args).pid)
            else:
                pgid = swarm.processes[current[victim]].pid
                os.killpg(pgid, signal.SIGSTOP)
                time.sleep(cfg.freeze_s)
                os.killpg(pgid, signal.SIGCONT)
            events.append({
                "fault": fault, "peer": victim, "at_s": time.monotonic() - started, "at_wall": time.time(),
                "swarm_round": at_round, "process": current[victim],
            })  # fmt: skip
            if progress is not None and task is not None:
                progress.update(task, completed=number + 1)
        last = swarm_round()
        wait_until(lambda: swarm_round() >= last + cfg.settle_rounds, 120, "the swarm to go on after the last fault")
        exits: dict[str, dict[str, Any]] = {}
        for name in names:
            stopped = time.monotonic()
            code = sigterm_and_wait(swarm.processes[current[name]])
            exits[name] = {"code": code, "seconds": round(time.monotonic() - stopped, 1)}
    time.sleep(2)
    leftovers = sum(1 for pgid in groups if _group_alive(pgid)) + len(p2pd_pids() - before_p2pd)
    report = analyse(cfg, names, workdir, events, exits, leftovers, time.monotonic() - started, idle_import_s)
    write_report(cfg.out, report, render_markdown(report))
    return report


def sigterm_and_wait(process: subprocess.Popen) -> int | str:
    """SIGTERM to a peer's whole process group: its exit code, or "did not exit" within `STOP_TIMEOUT_S`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        return process.wait(STOP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        return "did not exit"


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` every second until it returns something true (returned), or raise after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s")
        time.sleep(1.0)
    return result


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def analyse(
    cfg: KillSoakConfig,
    names: list[str],
    workdir: Path,
    events: list[dict[str, Any]],
    exits: dict[str, dict[str, Any]],
    leftovers: int,
    wall_s: float,
    idle_import_s: float | None = None,
) -> dict[str, Any]:
    """The figures of the module docstring, from every peer's metrics and logs."""
    per_peer = {name: rounds_of(workdir / f"{name}.jsonl") for name in names}
    disagreeing = disagreeing_rounds(per_peer)
    longest_wait = 20.0 + 10.0  # --round-timeout-s + --fetch-timeout-s above
    waits = [r["comm_s"] for records in per_peer.values() for r in records.values()]
    recoveries = [recovery(event, events, per_peer, workdir) for event in events]
    kills = [r["rounds_to_contribute"] for r in recoveries if r["fault"] == "kill"]
    judged = [r for r in recoveries if r["fault"] == "kill" and not r["interrupted"]]
    after_ready = [r["rounds_after_resuming"] for r in judged if r["rounds_after_resuming"] is not None]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "wall_s": round(wall_s, 1),
        "rounds": max((t for records in per_peer.values() for t in records), default=-1) + 1,
        "rounds_disagreeing": len(disagreeing),
        "disagreeing_rounds": disagreeing,
        "waits_past_deadline": sum(1 for w in waits if w > longest_wait),
        "longest_wait_s": round(max(waits, default=0.0), 1),
        "kills": len(kills),
        "freezes": sum(1 for e in events if e["fault"] == "freeze"),
        "restarts_contributing_within_2_rounds": sum(1 for k in kills if _within(k, 2)),
        "restarts_not_interrupted": len(judged),
        "uninterrupted_within_2_rounds": sum(1 for r in judged if _within(r["rounds_to_contribute"], 2)),
        "startup_s_mean": _mean([r["startup_s"] for r in judged if r["startup_s"] is not None]),
        "startup_rounds_mean": _mean([r["startup_rounds"] for r in judged if r["startup_rounds"] is not None]),
        "process_up_s_mean": _mean([r["process_up_s"] for r in judged if r["process_up_s"] is not None]),
        "idle_import_s": idle_import_s,
        "rounds_after_resuming": {"max": max(after_ready, default=None), "mean": _mean(after_ready)},
        "rounds_to_contribute_after_kill": {
            "max": max((k for k in kills if k is not None), default=None),
            "mean": _mean([k for k in kills if k is not None]),
            "never": sum(1 for k in kills if k is None),
        },
        "not_exiting_0_on_sigterm": [name for name, e in exits.items() if e["code"] != 0],
        "exits": exits,
        "processes_left_running": leftovers,
        "contributed_rounds": {
            name: sum(1 for r in records.values() if r.get("contributed")) for name, records in per_peer.items()
        },
        "faults": recoveries,
    }


def recovery(
    event: dict[str, Any], events: list[dict[str, Any]], per_peer: dict[str, dict[int, dict[str, Any]]], workdir: Path
) -> dict[str, Any]:
    """One fault's figures: rounds from the swarm's round at the fault to the peer's next contribution; for a kill,
    also the restart's startup (kill to checkpoint resumed, in seconds and in the swarm's rounds meanwhile), the
    rounds from then to contributing, and whether another fault hit the peer or its pipeline before it did."""
    records = per_peer[event["peer"]]
    back = [  # a round it contributed to before the fault does not count, though the swarm had not recorded it yet
        t for t, r in sorted(records.items())
        if t >= event["swarm_round"] and r.get("contributed") and r["ended_at"] > event["at_wall"]
    ]  # fmt: skip
    out = {**event, "rounds_to_contribute": (back[0] - event["swarm_round"]) if back else None}
    if event["fault"] != "kill":
        return out
    first_line, resumed = _log_times(workdir / f"{event['process']}.log")
    back_at = records[back[0]]["ended_at"] if back else math.inf
    pipeline = event["peer"].split("-s")[0]  # a stage contributes only with its virtual replica's other stages
    team = {name for name in per_peer if name.split("-s")[0] == pipeline}
    out["interrupted"] = any(e["peer"] in team and event["at_wall"] < e["at_wall"] < back_at for e in events)
    out["process_up_s"] = None if first_line is None else round(first_line - event["at_wall"], 1)
    out["startup_s"] = None if resumed is None else round(resumed - event["at_wall"], 1)
    ready_round = None if resumed is None else _swarm_round_at(per_peer, resumed)
    out["startup_rounds"] = None if ready_round is None else ready_round - event["swarm_round"]
    out["rounds_after_resuming"] = None if not back or ready_round is None else max(0, back[0] - ready_round)
    return out


def _log_times(log: Path) -> tuple[float | None, float | None]:
    """When a restarted peer logged its first line (its process was up: imports, p2pd, the DHT) and when it had
    loaded its checkpoint (the line saying so), as wall time."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None, None
    stamped = [(_stamp(line), line) for line in lines]
    times = [t for t, _ in stamped if t is not None]
    resumed = next((t for t, line in stamped if t is not None and "resumed from checkpoint" in line), None)
    return (times[0] if times else None), resumed


def _stamp(line: str) -> float | None:
    """A log line's time (`logging`'s default format), None for a line without one (a traceback's)."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def _swarm_round_at(per_peer: dict[str, dict[int, dict[str, Any]]], wall: float) -> int:
    """The swarm's round at wall time `wall` as the bench reads it live: the highest round any peer had recorded."""
    return max((t for records in per_peer.values() for t, r in records.items() if r["ended_at"] <= wall), default=-1)


def _within(rounds: int | None, limit: int) -> bool:
    return rounds is not None and rounds <= limit


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 1) if values else None


NOT_COMPLETED = ("behind", "failed")
"""A round record's `caught_up` when the peer holds no θ(t+1) yet (it still holds an earlier round's and catches up
before its next round): such a peer lags, it does not disagree. A void round does count: it claims θ(t+1) = θ(t)."""


def disagreeing_rounds(per_peer: dict[str, dict[int, dict[str, Any]]]) -> list[int]:
    """Rounds in which two peers that completed them hold different weights for one shard."""
    by_round: dict[int, dict[str, set[str]]] = {}
    for records in per_peer.values():
        for t, record in records.items():
            if record.get("caught_up") in NOT_COMPLETED:
                continue
            for key, value in record["fingerprints"].items():
                by_round.setdefault(t, {}).setdefault(key, set()).add(value)
    return sorted(t for t, shards in by_round.items() if any(len(fps) > 1 for fps in shards.values()))


def render_markdown(report: dict[str, Any]) -> str:
    after = report["rounds_to_contribute_after_kill"]
    rows = [
        ("rounds run", report["rounds"]),
        ("kills / freezes", f"{report['kills']} / {report['freezes']}"),
        ("rounds in which peers disagreed (goal 0)", report["rounds_disagreeing"]),
        ("waits past the longest legitimate wait (goal 0)", report["waits_past_deadline"]),
        ("longest wait for a round's exchange, s", report["longest_wait_s"]),
        (
            "restarted peers contributing again within 2 rounds",
            f"{report['restarts_contributing_within_2_rounds']} / {report['kills']}",
        ),
        ("rounds until a restarted peer contributes (max / mean)", f"{after['max']} / {after['mean']}"),
        (
            "restarts not hit again before contributing: within 2 rounds",
            f"{report['uninterrupted_within_2_rounds']} / {report['restarts_not_interrupted']}",
        ),
        (
            "of which starting the process (kill to checkpoint resumed): s / rounds, mean",
            f"{report['startup_s_mean']} / {report['startup_rounds_mean']}",
        ),
        (
            "of the start, kill to the node's first log line (interpreter, imports, p2pd, the DHT): s, mean",
            report["process_up_s_mean"],
        ),
        ("the same imports in a fresh interpreter on the idle machine (before the swarm), s", report["idle_import_s"]),
        (
            "then rounds until it contributes (max / mean)",
            f"{report['rounds_after_resuming']['max']} / {report['rounds_after_resuming']['mean']}",
        ),
        (
            "peers not exiting 0 within 30 s of SIGTERM (goal none)",
            ", ".join(report["not_exiting_0_on_sigterm"]) or "none",
        ),
        ("processes left running, p2pd included (goal 0)", report["processes_left_running"]),
        ("wall time, s", report["wall_s"]),
    ]
    lines = ["# Kill and freeze soak", "", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"
