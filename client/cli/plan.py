"""`hetero-node plan`: what a described swarm would do with a run, by the cost model, against the live planner."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hetero_node.client.config import OptimConfig, RunOptions
from hetero_node.client.swarm.auto_plan import H_CHOICES, AutoPlan, Choice, auto_plan
from hetero_node.client.swarm.cost_model import EXCHANGES, TABLE_UPKEEPS, Assignment, LinkModel, RunShape, predict_round
from hetero_node.client.swarm.planner import PeerInfo
from hetero_node.client.swarm.swarm_file import load_swarm
from hetero_node.models.config import get_preset
from hetero_node.protocol.errors import ConfigError, positive_int_list
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, RunConfig, SparseLoCoConfig
from hetero_node.protocol.swarm_key import load_swarm_key


@dataclass(frozen=True)
class PlanConfig:
    """The swarm to plan for and how its exchange runs; the run comes from the usual run options."""

    swarm: Path | None = field(
        default=None, metadata={"help": "Swarm description TOML: node kinds with speed, memory and links."}
    )
    peers: list[str] = field(
        default_factory=list,
        metadata={"help": "Plan a live swarm instead: its bootstrap's multiaddr (nodes, roles and run from the DHT)."},
    )
    swarm_key: Path | None = field(
        default=None, metadata={"help": "With --peers: the private swarm's key file (its records are sealed with it)."}
    )
    exchange: str = field(
        default="relay-tree",
        metadata={"help": f"Outer exchange to model: {', '.join(EXCHANGES)} (today's swarm runs relay-tree)."},
    )
    table_upkeep: str = field(
        default="changes",
        metadata={"help": f"How later stages keep T_fixed current: {', '.join(TABLE_UPKEEPS)} (today: changes)."},
    )
    cadence: bool = field(
        default=False,
        metadata={"help": "Model slow replicas contributing once per window of rounds, off the round's critical path "
                          "(modelled only: the protocol does not run it yet)."},
    )  # fmt: skip
    h_choices: str = field(
        default=",".join(map(str, H_CHOICES)), metadata={"help": "H values the planner may choose from."}
    )
    rows: int = field(default=20, metadata={"help": "Replicas listed (the fastest first); the summary covers all."})
    json_out: Path | None = field(default=None, metadata={"help": "Also write the plan and predictions here."})

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ConfigError(f"--exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if self.table_upkeep not in TABLE_UPKEEPS:
            raise ConfigError(f"--table-upkeep must be one of {', '.join(TABLE_UPKEEPS)}, got {self.table_upkeep!r}")
        if self.rows < 0:
            raise ConfigError(f"--rows must be ≥ 0, got {self.rows}")
        positive_int_list(self.h_choices, "--h-choices")  # a bad list fails before any work

    @property
    def h_list(self) -> list[int]:
        return positive_int_list(self.h_choices, "--h-choices")


def sizing_run(
    options: RunOptions, outer: OuterConfig, optim: OptimConfig, sparseloco: SparseLoCoConfig, pipeline: PipelineConfig
) -> RunConfig:
    """The run as the planner needs it: its shapes, not its data (the vocabulary is the tokenizer's when one is
    given, else the preset's own; no corpus is read)."""
    from hetero_node.client.node.run_definition import check_run_shape
    from hetero_node.models.tokenizer import load_tokenizer

    vocab = load_tokenizer(options.tokenizer).vocab_size if options.tokenizer else get_preset(options.preset).vocab_size
    check_run_shape(options, outer, pipeline, get_preset(options.preset, vocab_size=vocab))
    return RunConfig(
        preset=options.preset, vocab_size=vocab, batch_size=options.batch_size, seq_len=options.seq_len,
        seed=options.seed, data_shards=options.data_shards, data_identity="-", tokenizer_identity="-", outer=outer,
        optim=optim, sparseloco=sparseloco, pipeline=pipeline,
    )  # fmt: skip


def run_plan(cfg: PlanConfig, run: RunConfig) -> tuple[AutoPlan, dict[str, PeerInfo], str]:
    """The optimised plan, the nodes, and what the second column shows: the live planner for a swarm file, the
    swarm's own assignment for a live swarm (`--peers`, whose announced run replaces `run`)."""
    if (cfg.swarm is None) == (not cfg.peers):
        raise ConfigError("give --swarm FILE (a described swarm) or --peers ADDR (a live one), not both or neither")
    if cfg.peers:
        run, nodes, current = read_live_swarm(cfg.peers, load_swarm_key(cfg.swarm_key))
        links, where, baseline = LinkModel(), "the live swarm", "now"
    else:
        nodes, links = load_swarm(cfg.swarm, get_preset(run.preset, vocab_size=run.vocab_size).n_params())
        current, where, baseline = None, str(cfg.swarm), "the live planner"
    links = dataclasses.replace(links, exchange=cfg.exchange, table_upkeep=cfg.table_upkeep, cadence=cfg.cadence)
    try:
        result = auto_plan(nodes, run, links, cfg.h_list)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    by_id = {p.peer_id: p for p in nodes}
    if current is not None:  # compare with what the swarm runs, at its own H and rank
        shape = RunShape.from_run(run)
        now = Choice(current, shape.inner_steps, shape.rank, predict_round(by_id, current, shape, links))
        result = dataclasses.replace(result, live=now)
    return result, by_id, baseline


def read_live_swarm(peers: list[str], swarm_key: bytes | None = None) -> tuple[RunConfig, list[PeerInfo], Assignment]:
    """The announced run, every node as the live planner sees it (a relayed one at its share of the relay), and
    the assignment the records hold (virtual replicas with every stage held)."""
    from hetero_node.client.node.run_definition import fetch_run_announcement
    from hetero_node.client.swarm.addresses import parse_peer_multiaddrs
    from hetero_node.client.swarm.membership import peer_info, relay_shares
    from hetero_node.client.swarm.runtime import PeerRuntime

    runtime = PeerRuntime(parse_peer_multiaddrs([p for arg in peers for p in arg.replace(",", " ").split()]),
                          client_mode=True, swarm_key=swarm_key)  # fmt: skip
    try:
        announcement = fetch_run_announcement(runtime)
        if announcement is None:
            raise ConfigError("no peer in --peers announces a run (is it the bootstrap's multiaddr?)")
        runtime.join_run(announcement.run_id, serve=False)
        timed = runtime.read_records_timed()
    finally:
        runtime.shutdown()
    if not timed:
        raise ConfigError("the DHT did not answer, or the run has no peers yet; check --peers and try again")
    run = RunConfig.from_dict(announcement.config)
    records = {pid: record for pid, (record, _) in timed.items()}
    shares = relay_shares(records)
    nodes = [peer_info(record, shares.get(pid)) for pid, record in sorted(records.items())]
    stages = run.outer.stages
    held: dict[int, dict[int, str]] = {}
    for node in nodes:
        if node.role == ROLE_STAGE and node.vr >= 0 and 0 <= node.stage < stages:
            held.setdefault(node.vr, {})[node.stage] = node.peer_id
    virtual = tuple(tuple(vr[s] for s in range(stages)) for _, vr in sorted(held.items()) if len(vr) == stages)
    return run, nodes, Assignment(tuple(n.peer_id for n in nodes if n.role == ROLE_FULL), virtual)


def choice_summary(choice: Choice, peers: dict[str, PeerInfo]) -> dict[str, Any]:
    """The figures of one plan, as `--json-out` and the summary table show them."""
    p = choice.prediction
    solo = sum(peer.tokens_per_s for peer in peers.values())
    used = [n for n in p.nodes.values() if n.steps]
    used_solo = sum(peers[name].tokens_per_s for name, n in p.nodes.items() if n.steps)
    replicas = {n.replica: n for n in used}
    return {
        "full_replicas": len(choice.assignment.full),
        "virtual_replicas": len(choice.assignment.virtual),
        "contributors": p.contributors,
        "aggregated": p.aggregated,
        "inner_steps": choice.inner_steps,
        "rank": choice.rank,
        "round_s": p.round_s,
        "window_s": p.window_s,
        "tokens_per_round": p.tokens_per_round,
        "tokens_per_s": p.tokens_per_s,
        "trained_tokens_per_s": p.trained_tokens_per_s,
        "windowed_replicas": sum(1 for n in replicas.values() if n.every > 1),
        "training_nodes": len(used),
        "weak_scaling": p.tokens_per_s / solo if solo else None,
        "used_scaling": p.tokens_per_s / used_solo if used_solo else None,
        "mean_utilisation": sum(n.compute_s / n.every for n in used) / (len(used) * p.round_s)
        if used and p.round_s
        else None,
        "max_bytes_up_per_peer": max((n.bytes_up for n in p.nodes.values()), default=0.0),
        "max_bytes_down_per_peer": max((n.bytes_down for n in p.nodes.values()), default=0.0),
        "max_exchange_bytes_up_per_peer": max((n.bytes_up - n.boundary_up for n in p.nodes.values()), default=0.0),
        "max_exchange_bytes_down_per_peer": max(
            (n.bytes_down - n.boundary_down for n in p.nodes.values()), default=0.0
        ),
        "accumulation": p.accumulation,
    }


def plan_json(result: AutoPlan, peers: dict[str, PeerInfo]) -> dict[str, Any]:
    best = result.best
    return {
        "best": choice_summary(best, peers),
        "live": choice_summary(result.live, peers),
        "live_tuned": choice_summary(result.live_tuned, peers) if result.live_tuned else None,
        "full": list(best.assignment.full),
        "virtual": [list(vr) for vr in best.assignment.virtual],
        "virtual_round_trips_ms": result.boundary_round_trips_ms(peers),
        "idle": list(result.idle),
        "nodes": {k: vars(v) for k, v in best.prediction.nodes.items()},
    }


def _percent(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def print_plan(
    result: AutoPlan, peers: dict[str, PeerInfo], cfg: PlanConfig, console: Console, baseline: str = "the live planner"
) -> None:
    columns = {"optimised": result.best, baseline: result.live}
    if result.live_tuned is not None:  # what joiners would make of a run set to the optimised H and rank
        columns["the live planner at its H and rank"] = result.live_tuned
    summaries = [choice_summary(choice, peers) for choice in columns.values()]
    windows = ", slow replicas once per window (modelled)" if cfg.cadence else ""
    summary = Table(title=f"plan for {len(peers)} nodes ({cfg.exchange} exchange, {cfg.table_upkeep} T_fixed{windows})")
    summary.add_column("")
    for title in columns:
        summary.add_column(title, justify="right")
    rows = (
        ("full + virtual replicas", lambda s: f"{s['full_replicas']} + {s['virtual_replicas']}"),
        ("replicas that train", lambda s: str(s["contributors"])),
        ("H / boundary rank", lambda s: f"{s['inner_steps']} / {s['rank'] or 'dense'}"),
        ("round s (training window)", lambda s: f"{s['round_s']:,.1f} ({s['window_s']:,.1f})"),
        ("tokens/s (slow and stale ones at their value)", lambda s: f"{s['tokens_per_s']:,.0f}"),
        ("replicas once per window of rounds", lambda s: str(s["windowed_replicas"])),
        ("weak scaling (all nodes / nodes that train)",
         lambda s: f"{_percent(s['weak_scaling'])} / {_percent(s['used_scaling'])}"),
        ("mean compute utilisation", lambda s: "" if s["mean_utilisation"] is None else f"{s['mean_utilisation']:.0%}"),
        ("max MB per peer per round up / down",
         lambda s: f"{_mb(s['max_bytes_up_per_peer'])} / {_mb(s['max_bytes_down_per_peer'])}"),
    )  # fmt: skip
    for label, render in rows:
        summary.add_row(label, *(render(s) for s in summaries))
    console.print(summary)
    table = Table(title="replicas (optimised plan)")
    for column in ("replica", "nodes (stage order)", "steps (batches) / rounds", "compute s", "exchange s", "MB up",
                   "MB down", "boundary RTT ms"):  # fmt: skip
        table.add_column(column, justify="left" if column.startswith(("replica", "nodes")) else "right")
    prediction = result.best.prediction
    first_virtual = len(result.best.assignment.full)  # replicas are numbered full ones first
    trips = {first_virtual + v: ms for v, ms in enumerate(result.boundary_round_trips_ms(peers))}
    replicas: dict[int, list[str]] = {}
    for peer_id, node in prediction.nodes.items():
        replicas.setdefault(node.replica, []).append(peer_id)
    for replica, members in sorted(replicas.items())[: cfg.rows]:
        nodes = [prediction.nodes[m] for m in members]
        kind = "full" if nodes[0].role == "full" else "virtual"
        table.add_row(
            f"{replica} ({kind})", ", ".join(members), f"{nodes[0].steps} ({nodes[0].batches}) / {nodes[0].every}",
            f"{max(n.compute_s for n in nodes):.1f}", f"{max(n.exchange_s for n in nodes):.1f}",
            _mb(max(n.bytes_up for n in nodes)), _mb(max(n.bytes_down for n in nodes)),
            f"{trips[replica]:,.0f}" if replica in trips else "",
        )  # fmt: skip
    console.print(table)
    if len(replicas) > cfg.rows:
        console.print(f"… and {len(replicas) - cfg.rows} more replicas (--rows N lists more)", markup=False)
    if result.idle:
        more = " …" if len(result.idle) > 10 else ""
        console.print(f"idle ({len(result.idle)}): {', '.join(result.idle[:10])}{more}", markup=False)
    if cfg.json_out is not None:
        cfg.json_out.write_text(json.dumps(plan_json(result, peers), indent=2) + "\n")
        console.print(f"wrote {cfg.json_out}", markup=False)
