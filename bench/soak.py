"""`hetero-node-lab soak`: a long, fault-free run that watches each peer's resources.

A bootstrap, full replicas and virtual replicas (real `hetero-node join` processes, as in `hetero-node-lab kills`) train
`tiny` in time-boxed rounds for `--minutes`, each peer in a network namespace of its own on a `--link-mbit`
link shaped with `tc tbf` (or all on loopback with `--link-mbit 0`). Every `--sample-s` the bench reads, for
each peer's whole process group (the node, hivemind's DHT child, p2pd), the resident memory (VmRSS
summed over the group's processes: pages forked children share count once per process, so the level is high but
its growth is what matters), open file descriptors, threads and processes from /proc. The report says, per peer:

* RSS growth from the end of the warm-up to the end (goal < 5%), and the largest RSS seen;
* file descriptors, threads and processes at the end of the warm-up and at the end (goal: stable);
* after SIGTERM: exit codes, processes left running, and files left behind (hivemind sockets in /tmp, the node's
  socket directory) — goal 0.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import SoakConfig
from hetero_node.bench.kill_soak import p2pd_pids, peer_args, rounds_of, run_args, sigterm_and_wait
from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import netns_unavailable_reason
from hetero_node.bench.results import write_report
from hetero_node.client.cli.local_swarm import LocalSwarm, fresh_dir
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.socket_dir import PREFIX


def group_pids(pgid: int) -> list[int]:
    """Processes whose process group is `pgid` (a peer and every child it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def sample_group(pgid: int) -> dict[str, float]:
    """RSS (MB), open fds, threads and processes of one peer's process group."""
    rss_kb = fds = threads = 0
    pids = group_pids(pgid)
    for pid in pids:
        try:
            status = (Path("/proc") / str(pid) / "status").read_text()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss_kb += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": threads, "processes": len(pids)}


def run_soak(cfg: SoakConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the scenario; returns the report (also `out/report.json` and `report.md`)."""
    workdir = fresh_dir(cfg.out / "logs")
    names = [f"r{i}" for i in range(cfg.full)] + [f"vr{v}-s{s}" for v in range(cfg.virtual) for s in range(2)]
    if cfg.link_mbit and (reason := netns_unavailable_reason()):
        raise ConfigError(f"shaped links need network namespaces: {reason}; run with --link-mbit 0 for loopback")
    tmp = Path(tempfile.gettempdir())
    sockets_before, p2pd_before = set(tmp.glob("hivemind-*.sock")), p2pd_pids()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in [*names, "bootstrap"]}
    started = time.monotonic()
    link = cfg.link_mbit or None
    with LabSwarm(workdir, link) if link else LocalSwarm(workdir) as swarm:
        peers = swarm.start_bootstrap(run_args(cfg.preset, cfg.round_s))
        pgids = {
            name: swarm.start(name, peer_args(peers, name, workdir, i, swarm.host(name), link or 1000)).pid
            for i, name in enumerate(names)
        }
        pgids["bootstrap"] = swarm.processes["bootstrap"].pid
        task = progress.add_task("soak", total=cfg.minutes * 60) if progress else None
        while (elapsed := time.monotonic() - started) < cfg.minutes * 60:
            for name, pgid in pgids.items():
                samples[name].append({"t_s": round(elapsed), **sample_group(pgid)})
            if progress is not None and task is not None:
                progress.update(task, completed=min(elapsed, cfg.minutes * 60))
            time.sleep(cfg.sample_s)
        exits = {name: sigterm_and_wait(swarm.processes[name]) for name in pgids}
        time.sleep(2)  # before LocalSwarm's exit SIGKILLs whatever is left
        left_running = sum(len(group_pids(pgid)) for pgid in pgids.values()) + len(p2pd_pids() - p2pd_before)
    left_files = sorted(str(p) for p in set(tmp.glob("hivemind-*.sock")) - sockets_before)
    left_files += sorted(str(p) for pgid in pgids.values() for p in tmp.glob(f"{PREFIX}{pgid}-*"))
    rounds = {name: len(rounds_of(workdir / f"{name}.jsonl")) for name in names}
    report = analyse(cfg, samples, exits, left_running, left_files, rounds)
    write_report(cfg.out, {**report, "samples": samples}, render_markdown(report))
    return report


def analyse(
    cfg: SoakConfig,
    samples: dict[str, list[dict[str, float]]],
    exits: dict[str, Any],
    left_running: int,
    left_files: list[str],
    rounds: dict[str, int],
) -> dict[str, Any]:
    """Per peer: the warm sample (first at or after the warm-up), the last one, RSS growth and peak."""
    peers = {}
    for name, series in samples.items():
        warm = next((s for s in series if s["t_s"] >= cfg.warmup_minutes * 60), series[-1])
        last = series[-1]
        peers[name] = {
            "rounds": rounds.get(name, 0), "exit": exits.get(name),
            "rss_mb_warm": round(warm["rss_mb"], 1), "rss_mb_end": round(last["rss_mb"], 1),
            "rss_growth": round(last["rss_mb"] / warm["rss_mb"] - 1, 4) if warm["rss_mb"] else None,
            "rss_mb_peak": round(max(s["rss_mb"] for s in series), 1),
            "fds": [warm["fds"], last["fds"]], "threads": [warm["threads"], last["threads"]],
            "processes": [warm["processes"], last["processes"]],
        }  # fmt: skip
    return {"minutes": cfg.minutes, "warmup_minutes": cfg.warmup_minutes, "link_mbit": cfg.link_mbit, "peers": peers,
            "processes_left_running": left_running, "files_left": left_files}  # fmt: skip


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Soak: {report['minutes']} min on {_links(report.get('link_mbit', 0))}, figures from minute "
        f"{report['warmup_minutes']} (end of warm-up) to the end.\n",
        "| peer | rounds | RSS MB warm → end (growth) | peak RSS MB | fds | threads | processes | exit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in report["peers"].items():
        growth = "–" if p["rss_growth"] is None else f"{p['rss_growth']:+.1%}"
        lines.append(
            f"| {name} | {p['rounds']} | {p['rss_mb_warm']} → {p['rss_mb_end']} ({growth}) | {p['rss_mb_peak']} | "
            f"{p['fds'][0]} → {p['fds'][1]} | {p['threads'][0]} → {p['threads'][1]} | "
            f"{p['processes'][0]} → {p['processes'][1]} | {p['exit']} |"
        )
    lines.append(f"\nprocesses left running after SIGTERM: {report['processes_left_running']}; "
                 f"files left behind: {len(report['files_left'])}")  # fmt: skip
    return "\n".join(lines) + "\n"


def _links(link_mbit: float) -> str:
    return f"{link_mbit:g} Mbit/s links (tc tbf)" if link_mbit else "loopback"
