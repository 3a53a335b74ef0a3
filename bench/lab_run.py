"""One benchmark run: one method on one topology, every process in its own shaped namespace, torn down after.

The harness only starts processes, watches their metrics files and reads interface counters. When a node's
metrics file gains a round, the harness stamps it with the time since launch and with the bytes that had crossed
every link so far (`observed`), which is what the loss-vs-time and loss-vs-bytes plots need. A run ends when
every node process has exited; it fails when one exits non-zero, and is cut short after `timeout_s`, or when no
node finishes a round for `stall_timeout_s`. Whatever happens (Ctrl-C included), the lab's processes and
namespaces go with the `NetLab` context.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, TaskID

from hetero_node.bench.commands import bootstrap_argv, ddp_argv, join_argv, node_role
from hetero_node.bench.config import BenchConfig
from hetero_node.bench.cpu_quota import CpuQuota
from hetero_node.bench.netns import NODE_IF, LabNode, NetLab
from hetero_node.bench.topology import NodeSpec, Topology
from hetero_node.bootstrap.join_line import JOIN_LINE

logger = logging.getLogger(__name__)

POLL_S = 0.5
BOOTSTRAP_START_S = 120.0
LOG_TAIL_LINES = 20


class MetricsTail:
    """Follows a node's metrics JSONL while the node appends to it: each call returns only what is new."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read_new(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the last header line seen now, or None; the round lines appended since the last call). A line still
        being written waits for the next call; a line that is not JSON is skipped with a warning."""
        if not self.path.exists():
            return None, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        header, fresh = None, []
        for line in complete.decode(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s: skipping a line that is not JSON: %.80s", self.path, line)
                continue
            if isinstance(obj, dict) and "header" in obj:
                header = obj["header"]
            elif isinstance(obj, dict):
                fresh.append(obj)
        return header, fresh


@dataclass
class _Process:
    """A started lab process and what the harness has seen of it."""

    name: str
    lab_node: LabNode
    process: subprocess.Popen
    log: Path
    spec: NodeSpec | None = None
    header: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tail = MetricsTail(self.metrics)

    @property
    def metrics(self) -> Path:
        return self.log.with_suffix(".jsonl")

    def new_rounds(self) -> list[dict[str, Any]]:
        """Round lines the node appended to its metrics file since the last call."""
        header, fresh = self.tail.read_new()
        self.header = header or self.header
        self.rounds += fresh
        return fresh


def run_method(
    cfg: BenchConfig, topology: Topology, method: str, workdir: Path, progress: Progress | None = None
) -> dict[str, Any]:
    """Run `method` on `topology` in a fresh lab and return the raw run record (see `_run_record`).

    `workdir` receives every process's log and metrics file; it is emptied first, since metrics files append.
    """
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    task = progress.add_task(f"{topology.name} · {method}", total=cfg.rounds_for(method)) if progress else None
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads_per_node), "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": NODE_IF}  # fmt: skip
    with NetLab() as lab, contextlib.ExitStack() as quotas:
        slow = {
            spec.name: quotas.enter_context(CpuQuota(spec.name, spec.cpu_quota))
            for spec in topology.nodes
            if spec.cpu_quota is not None
        }
        bootstrap = None
        if method != "ddp":
            bootstrap = lab.add_node("bootstrap", topology.bootstrap_up_mbit, topology.bootstrap_down_mbit,
                                     topology.bootstrap_latency_ms)  # fmt: skip
        lab_nodes = [lab.add_node(spec.name, spec.up_mbit, spec.down_mbit, spec.latency_ms) for spec in topology.nodes]
        lab.start_delays()
        everyone = [*([bootstrap] if bootstrap else []), *lab_nodes]
        baseline = {n.name: lab.counters(n) for n in everyone}
        started = time.monotonic()

        def counters() -> dict[str, tuple[int, int]]:
            """(sent, received) bytes per lab node since launch."""
            return {n.name: _delta(lab.counters(n), baseline[n.name]) for n in everyone}

        def start(name: str, lab_node: LabNode, argv: list[str], spec: NodeSpec | None = None) -> _Process:
            """`argv` in the node's namespace, output to `<name>.log`, pinned to the node's cores and inside its
            CPU cgroup if it has them."""
            log = workdir / f"{name}.log"

            def prepare() -> None:  # runs in the child before it executes: its own children inherit both
                if spec and spec.cpus:
                    os.sched_setaffinity(0, spec.cpus)
                if spec and spec.name in slow:
                    slow[spec.name].enter()

            with open(log, "w") as out:  # the child keeps its own descriptor
                process = lab.popen(lab_node, argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=prepare)
            return _Process(name, lab_node, process, log, spec)

        boot, peers, status = None, None, "ok"
        if bootstrap is not None:
            identity = str(workdir / "bootstrap.id")
            boot = start("bootstrap", bootstrap, bootstrap_argv(cfg, method, bootstrap.address, identity))
            peers = _wait_for_join_line(boot)
            status = "ok" if peers else "failed"
        nodes: list[_Process] = []
        if status == "ok":
            for i, (spec, lab_node) in enumerate(zip(topology.nodes, lab_nodes, strict=True)):
                metrics = str(workdir / f"{spec.name}.jsonl")  # = _Process.metrics
                if method == "ddp":
                    argv = ddp_argv(cfg, i, len(lab_nodes), lab_nodes[0].address, metrics)
                else:
                    argv = join_argv(cfg, method, topology, i, lab_node.address, peers, metrics)
                nodes.append(start(spec.name, lab_node, argv, spec))
            status = _watch(cfg, nodes, started, counters, progress, task)
        ended = time.monotonic()
        wire = counters()
        exit_codes = {p.name: p.process.poll() for p in ([boot] if boot else []) + nodes}
    # the lab is gone: every process stopped, every namespace deleted
    return _run_record(cfg, topology, method, status, ended - started, nodes, wire, exit_codes, boot)


def _delta(now: tuple[int, int], before: tuple[int, int]) -> tuple[int, int]:
    return now[0] - before[0], now[1] - before[1]


def _wait_for_join_line(boot: _Process) -> str | None:
    """The bootstrap's multiaddr once it printed the join line; None if it died or took too long."""
    deadline = time.monotonic() + BOOTSTRAP_START_S
    while time.monotonic() < deadline:
        match = JOIN_LINE.search(boot.log.read_text(errors="replace"))
        if match:
            return match.group(1)
        if boot.process.poll() is not None:
            break
        time.sleep(0.2)
    logger.error("bootstrap did not start; see %s", boot.log)
    return None


def _watch(
    cfg: BenchConfig,
    nodes: list[_Process],
    started: float,
    counters: Callable[[], dict[str, tuple[int, int]]],
    progress: Progress | None,
    task: TaskID | None,
) -> str:
    """Poll until every node exited (ok), one failed, or a deadline passed; stamps new rounds as they appear."""
    last_progress, furthest = started, {}
    while True:
        now = time.monotonic()
        codes = [n.process.poll() for n in nodes]  # before reading: a node's last round is in its file by exit
        fresh = [(node, record) for node in nodes for record in node.new_rounds()]
        if advanced(fresh, furthest):
            last_progress = now
        if fresh:
            wire = counters()
            swarm_sent = sum(tx for tx, _ in wire.values())
            for node, record in fresh:
                tx, rx = wire[node.name]
                record["observed"] = {"at_s": now - started, "wire_bytes_sent": tx, "wire_bytes_received": rx,
                                      "swarm_wire_bytes_sent": swarm_sent}  # fmt: skip
        if progress is not None and task is not None:
            progress.update(task, completed=min(len(n.rounds) for n in nodes))
        failed = [n.name for n, code in zip(nodes, codes, strict=True) if code not in (None, 0)]
        if failed:
            logger.error("node(s) %s failed; see their logs in %s", ", ".join(failed), nodes[0].log.parent)
            return "failed"
        if all(code == 0 for code in codes):
            return "ok"
        if now - started > cfg.timeout_s or now - last_progress > cfg.stall_timeout_s:
            logger.error("run cut short: %.0f s in, %.0f s since a node last got past its furthest round",
                         now - started, now - last_progress)  # fmt: skip
            return "timed_out"
        time.sleep(POLL_S)


def advanced(fresh: list[tuple[_Process, dict[str, Any]]], furthest: dict[str, int]) -> bool:
    """Whether a node finished a round past the furthest it had finished (updating `furthest`). A node that records
    the same round again and again (a stage whose pipeline never forms) is not progress: a livelocked run is cut
    short after `stall_timeout_s` instead of running to `timeout_s`."""
    moved = False
    for node, record in fresh:
        if record.get("round", -1) > furthest.get(node.name, -1):
            furthest[node.name] = record["round"]
            moved = True
    return moved


def _log_tail(path: Path) -> list[str]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line.rstrip() for line in lines[-LOG_TAIL_LINES:]]


def _run_record(
    cfg: BenchConfig,
    topology: Topology,
    method: str,
    status: str,
    elapsed_s: float,
    nodes: list[_Process],
    wire: dict[str, tuple[int, int]],
    exit_codes: dict[str, int | None],
    boot: _Process | None,
) -> dict[str, Any]:
    """The raw JSON of a run (`runs/<method>.json`), which the report is computed from."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    record: dict[str, Any] = {
        "method": method,
        "topology": topology.name,
        "config": settings,
        "status": status,
        "elapsed_s": elapsed_s,
        "edge_nodes": list(topology.edge_nodes),
        "run": next((p.header["run"] for p in nodes if "run" in p.header), None),
        "nodes": [
            {
                "name": p.name,
                "requested_role": "ddp" if method == "ddp" else node_role(method, p.spec),
                "up_mbit": p.spec.up_mbit,
                "down_mbit": p.spec.down_mbit,
                "cpu_quota": p.spec.cpu_quota,
                "latency_ms": p.spec.latency_ms,
                "address": p.lab_node.address,
                "exit_code": exit_codes[p.name],
                "wire_bytes_sent": wire[p.name][0],
                "wire_bytes_received": wire[p.name][1],
                "header": {k: v for k, v in p.header.items() if k != "run"},
                "rounds": p.rounds,
                "log": str(p.log),
            }
            for p in nodes
        ],
        "bootstrap": None,
        "errors": {},
    }
    if boot is not None:
        record["bootstrap"] = {"wire_bytes_sent": wire["bootstrap"][0], "wire_bytes_received": wire["bootstrap"][1],
                               "exit_code": exit_codes["bootstrap"], "log": str(boot.log)}  # fmt: skip
    if status != "ok":  # the logs that say why: every process's after a timeout, else those that failed
        for p in ([boot] if boot else []) + nodes:
            bootstrap_failed = not nodes
            if status == "timed_out" or bootstrap_failed or exit_codes[p.name] not in (None, 0):
                record["errors"][p.name] = _log_tail(p.log)
    return record
