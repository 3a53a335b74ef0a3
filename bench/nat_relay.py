"""`hetero-node-lab nat`: what a circuit relay costs a swarm, measured on shaped links.

The same run three times: a bootstrap and two full replicas, each on a `--link-mbit` tbf link; first both replicas
public (direct), then the second behind a NAT router of its own (it joins through a relay on the bootstrap), then
both behind NAT routers of their own (every byte between them crosses the relay). Per
scenario the report gives each replica's mean exchange time per round (`comm_s`: waiting for and fetching the
others' messages), the round's wall time (the run's wall time over its rounds), the SparseLoCo bytes each replica
received per round, and the bytes that crossed each node's link per round (interface counters, both directions):
the bootstrap's carries the relayed traffic (each byte twice, in and out) on top of the DHT traffic the direct
run shows.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import NatBenchConfig
from hetero_node.bench.kill_soak import peer_args, rounds_of, run_configs
from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import nat_unavailable_reason
from hetero_node.bench.results import write_report
from hetero_node.client.cli.local_swarm import fresh_dir
from hetero_node.client.cli.options import to_argv
from hetero_node.protocol.errors import ConfigError, HeteroNodeError

REPLICAS = ("r0", "r1")
SCENARIOS = {"direct": frozenset(), "relayed": frozenset({"r1"}), "both relayed": frozenset({"r0", "r1"})}


def run_args(cfg: NatBenchConfig) -> list[str]:
    """Rounds of `round_s`, whatever H steps take."""
    return to_argv(*run_configs(cfg.preset, cfg.round_s, rounds=cfg.rounds, inner_steps=1000))


def run_scenario(cfg: NatBenchConfig, workdir: Path, behind_nat: frozenset[str]) -> dict[str, Any]:
    """One run; the replicas' round records, the bootstrap's link bytes and the wall time."""
    with LabSwarm(workdir, cfg.link_mbit, behind_nat=behind_nat) as swarm:
        assert swarm.lab is not None
        peers = swarm.start_bootstrap(run_args(cfg))
        nodes = ["bootstrap", *REPLICAS]
        for name in REPLICAS:
            swarm.host(name)  # makes its namespace, so its counters start at 0
        before = {name: sum(swarm.lab.counters(swarm.lab.nodes[name])) for name in nodes}
        started = time.monotonic()
        for index, name in enumerate(REPLICAS):
            swarm.start(name, peer_args(peers, name, workdir, index, swarm.host(name), cfg.link_mbit, min_peers=2))
        for name in REPLICAS:
            if swarm.wait(name, 120 + 4 * cfg.rounds * cfg.round_s) != 0:
                raise HeteroNodeError(f"{name} failed; see {swarm.log_path(name)}")
        wall_s = time.monotonic() - started
        link_bytes = {name: sum(swarm.lab.counters(swarm.lab.nodes[name])) - before[name] for name in nodes}
    return {"records": {name: rounds_of(workdir / f"{name}.jsonl") for name in REPLICAS}, "link_bytes": link_bytes,
            "wall_s": wall_s}  # fmt: skip


def summarise(run: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The scenario's figures (see the module docstring) from `run_scenario`'s output."""
    records = run["records"]
    return {
        "rounds_contributed": {n: sum(r["contributed"] for r in records[n].values()) for n in REPLICAS},
        "comm_s": {n: round(statistics.fmean(r["comm_s"] for r in records[n].values()), 3) for n in REPLICAS},
        "received_per_round": {
            n: round(statistics.fmean(r["bytes_received"] for r in records[n].values())) for n in REPLICAS
        },
        "round_wall_s": round(run["wall_s"] / rounds, 2),
        "link_bytes_per_round": {name: round(b / rounds) for name, b in run["link_bytes"].items()},
        "agree": all(
            records["r0"][t]["fingerprints"] == records["r1"][t]["fingerprints"]
            for t in set(records["r0"]) & set(records["r1"])
        ),
    }


def run_nat_bench(cfg: NatBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    if reason := nat_unavailable_reason():
        raise ConfigError(f"the NAT bench needs network namespaces and iptables: {reason}")
    task = progress.add_task("scenarios", total=len(SCENARIOS)) if progress else None
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(cfg).items()}, "scenarios": {}}
    for name, behind_nat in SCENARIOS.items():
        run = run_scenario(cfg, fresh_dir(cfg.out / name), behind_nat)
        report["scenarios"][name] = summarise(run, cfg.rounds)
        if progress is not None and task is not None:
            progress.advance(task)
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"# Relay cost: `{cfg['preset']}`, 2 full replicas, {cfg['rounds']} rounds of {cfg['round_s']} s, "
        f"{cfg['link_mbit']} Mbit/s links",
        "",
        "| scenario | rounds contributed (r0, r1) | comm s per round (r0, r1) | bytes received per round (r0, r1) "
        "| round wall s | link bytes per round (bootstrap, r0, r1) | agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["scenarios"].items():
        lines.append(
            f"| {name} | {_cells(s['rounds_contributed'])} | {_cells(s['comm_s'])} | {_cells(s['received_per_round'])} "
            f"| {s['round_wall_s']} | {_cells(s['link_bytes_per_round'])} | {'yes' if s['agree'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _cells(per_node: dict[str, Any]) -> str:
    """A table cell listing one figure per node, in the dict's order (bootstrap first where it is present)."""
    return ", ".join(f"{value:,}" for value in per_node.values())
