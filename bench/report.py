"""From raw run records (`runs/<method>.json`) to `report.json`, `report.md` and the loss plots.

Definitions the table uses:
* wall time: from launching the run's first process to the last round any node finished (start-up included,
  for every method alike); a node's own wall time starts when its first round did (compute_s + comm_s before
  the harness saw it finish), so start-up does not count against its compute utilisation;
* bytes on the wire: transmit/receive counters of each node's interface, everything that crossed its link;
  the swarm's figure adds the bootstrap's. "Counted" bytes are what the program itself reports sending
  (outer-round payloads, plus pipeline-boundary traffic for stage peers);
* tokens: a full replica's (or ddp rank's) are its own; a virtual replica's are split evenly among its stage
  peers, so node tokens add up to the swarm's and the edge nodes' share is well defined;
* start-up: from launch to the earliest first round of any node; a swarm method's ceiling: ddp's time to its
  loss over the method's start-up plus ddp's tokens at the method's tokens/s after it (its rounds' own costs
  included), the most × sooner it could have been had it needed no more tokens than ddp.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from hetero_node.bench import results
from hetero_node.bench.model_check import check_run

logger = logging.getLogger(__name__)

LOSS_VS_WALL = "loss_vs_wall.png"
LOSS_VS_BYTES = "loss_vs_bytes.png"
TIME_TO_LOSS_TOLERANCE = 0.03
"""A method has reached ddp's loss when its eval loss is within 3% above what ddp ends its budget at."""
SCENARIO_KEYS = (
    "preset", "rounds", "swarm_rounds", "inner_steps", "batch_size", "seq_len", "stages", "subspace_rank", "lr",
    "round_s", "overlap", "target_utilisation", "aggregation",
)  # fmt: skip


def eval_curve(run: dict[str, Any]) -> list[dict[str, float]]:
    """Per round with an evaluation: mean eval loss over the nodes that report one, when the last of them
    finished the round, and the swarm's wire bytes sent by then."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for node in run["nodes"]:
        for record in node["rounds"]:
            if record.get("eval_loss") is not None:
                by_round.setdefault(record["round"], []).append(record)
    return [
        {
            "round": r,
            "eval_loss": statistics.mean(rec["eval_loss"] for rec in records),
            "at_s": max(rec["observed"]["at_s"] for rec in records),
            "wire_bytes_sent": max(rec["observed"]["swarm_wire_bytes_sent"] for rec in records),
        }
        for r, records in sorted(by_round.items())
    ]


def _first_round_start_s(rounds: list[dict[str, Any]]) -> float | None:
    """When the node's first round began, from launch (its compute and exchange before the harness saw it end)."""
    if not rounds:
        return None
    first = rounds[0]
    return first["observed"]["at_s"] - first["compute_s"] - first["comm_s"]


def _node_wall_s(rounds: list[dict[str, Any]], start: float | None) -> float | None:
    if start is None:
        return None
    return max(rounds[-1]["observed"]["at_s"] - start, sum(r["compute_s"] for r in rounds))


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    """The per-method figures of report.json (see the module docstring for definitions)."""
    stage_peers = Counter(n["header"].get("vr") for n in run["nodes"] if n["header"].get("role") == "stage")
    nodes: dict[str, dict[str, Any]] = {}
    for node in run["nodes"]:
        rounds, header = node["rounds"], node["header"]
        share = 1 / stage_peers[header.get("vr")] if header.get("role") == "stage" else 1.0
        tokens = share * sum(r["tokens"] for r in rounds)
        started = _first_round_start_s(rounds)
        wall = _node_wall_s(rounds, started)
        compute = sum(r["compute_s"] for r in rounds)
        nodes[node["name"]] = {
            "role": header.get("role", node["requested_role"]),
            "rounds": len(rounds),
            "wire_bytes_sent": node["wire_bytes_sent"],
            "wire_bytes_received": node["wire_bytes_received"],
            "reported_bytes_sent": sum(r["bytes_sent"] + r.get("boundary_bytes_sent", 0) for r in rounds),
            "outer_bytes_per_round": sum(r["bytes_sent"] for r in rounds) / len(rounds) if rounds else None,
            "outer_message_bytes": _message_bytes(rounds),
            "rounds_not_aggregated": sum(1 for r in rounds if r.get("resynced")),
            "rounds_contributed": sum(1 for r in rounds if _contributed_to(r)) if run["method"] != "ddp" else None,
            "inner_steps": sum(r["inner_steps"] for r in rounds),
            "reported_bytes_received": sum(r["bytes_received"] + r.get("boundary_bytes_received", 0) for r in rounds),
            "tokens": tokens,
            "compute_s": compute,
            "started_s": started,
            "wall_s": wall,
            "compute_utilisation": compute / wall if wall else None,
            "tokens_per_s": tokens / wall if wall else None,
            "bytes_per_token": node["wire_bytes_sent"] / tokens if tokens else None,
            "edge": node["name"] in run["edge_nodes"],
        }
    curve = eval_curve(run)
    for point in curve:
        point["tokens"] = _tokens_by_round(run, stage_peers, point["round"])
    observed = [r["observed"]["at_s"] for n in run["nodes"] for r in n["rounds"]]
    wall_s = max(observed) if observed else run["elapsed_s"]
    tokens = sum(n["tokens"] for n in nodes.values())
    bootstrap = run["bootstrap"] or {"wire_bytes_sent": 0, "wire_bytes_received": 0}
    wire_sent = sum(n["wire_bytes_sent"] for n in nodes.values()) + bootstrap["wire_bytes_sent"]
    edge_tokens = sum(n["tokens"] for n in nodes.values() if n["edge"])
    rounds = max((n["rounds"] for n in nodes.values()), default=0)
    started_s = min((n["started_s"] for n in nodes.values() if n["started_s"] is not None), default=None)
    training_s = wall_s - started_s if started_s is not None else 0.0
    return {
        "status": run["status"],
        "final_eval_loss": curve[-1]["eval_loss"] if curve else None,
        "wall_s": wall_s,
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s else None,
        "started_s": started_s,
        "training_tokens_per_s": tokens / training_s if training_s > 0 else None,
        "wire_bytes_sent": wire_sent,
        "wire_bytes_received": sum(n["wire_bytes_received"] for n in nodes.values()) + bootstrap["wire_bytes_received"],
        "reported_bytes_sent": sum(n["reported_bytes_sent"] for n in nodes.values()),
        "bytes_per_token": wire_sent / tokens if tokens else None,
        "edge_token_share": edge_tokens / tokens if run["edge_nodes"] and tokens else None,
        "outer_bytes_per_round_per_node": _mean([n["outer_bytes_per_round"] for n in nodes.values()]),
        "outer_message_bytes": _mean([n["outer_message_bytes"] for n in nodes.values()]),
        "wire_bytes_per_round": wire_sent / rounds if rounds else None,
        "rounds_not_aggregated": sum(n["rounds_not_aggregated"] for n in nodes.values()),
        "lowest_contribution_share": min(
            (
                n["rounds_contributed"] / n["rounds"]
                for n in nodes.values()
                if n["rounds"] and n["rounds_contributed"] is not None
            ),
            default=None,
        ),
        "bootstrap": bootstrap,
        "nodes": nodes,
        "curve": curve,
    }


def _tokens_by_round(run: dict[str, Any], stage_peers: Counter, last_round: int) -> float:
    """The swarm's tokens trained in rounds up to `last_round` (a virtual replica's split among its stages)."""
    total = 0.0
    for node in run["nodes"]:
        header = node["header"]
        share = 1 / stage_peers[header.get("vr")] if header.get("role") == "stage" else 1.0
        total += share * sum(r["tokens"] for r in node["rounds"] if r["round"] <= last_round)
    return total


def time_to_ddp_loss(methods: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """When each method first reached the eval loss ddp ends its budget at (within `TIME_TO_LOSS_TOLERANCE`),
    and how much sooner than ddp itself; None without a finished ddp run."""
    ddp = methods.get("ddp")
    if not ddp or ddp["status"] != "ok" or ddp["final_eval_loss"] is None:
        return None
    target = ddp["final_eval_loss"] * (1 + TIME_TO_LOSS_TOLERANCE)
    reached = {m: next((p for p in s["curve"] if p["eval_loss"] <= target), None) for m, s in methods.items()}
    ddp_s, ddp_tokens = reached["ddp"]["at_s"], reached["ddp"]["tokens"]  # ddp's last point is within tolerance
    rows = {
        m: {
            "reached": p is not None,
            **(p or {}),
            "times_sooner_than_ddp": ddp_s / p["at_s"] if p else None,
            "ceiling_times_sooner": _ceiling(ddp_s, ddp_tokens, methods[m]) if m != "ddp" else None,
        }
        for m, p in reached.items()
    }
    return {"ddp_final_eval_loss": ddp["final_eval_loss"], "target_eval_loss": target, "methods": rows}


def _ceiling(ddp_s: float, ddp_tokens: float, method: dict[str, Any]) -> float | None:
    """A swarm method's ceiling (module docstring); what it falls short of it by is the tokens it needed beyond
    ddp's."""
    started, rate = method.get("started_s"), method.get("training_tokens_per_s")
    if started is None or not rate:
        return None
    return ddp_s / (started + ddp_tokens / rate)


def _contributed_to(record: dict[str, Any]) -> bool:
    """The node's message is in a group's aggregate (metrics from before `contributed` existed: it did not
    re-sync and was in a group of two or more)."""
    if "contributed" in record:
        return bool(record["contributed"])
    return not record.get("resynced") and record.get("group_size", 0) > 1


def _message_bytes(rounds: list[dict[str, Any]]) -> float | None:
    """A node's round message as sent: its outer-round bytes per peer that fetched them, over rounds in a group."""
    return _mean([r["bytes_sent"] / (r["group_size"] - 1) for r in rounds if r["group_size"] > 1 and r["bytes_sent"]])


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's benchmark targets, each with the measured figure and whether it is met (None: a method it
    needs did not run, or did not finish)."""
    ok = {m: s for m, s in methods.items() if s["status"] == "ok"}

    def get(method: str, key: str) -> Any:
        return ok.get(method, {}).get(key)

    rows = []

    def add(target: str, measured: float | None, met: bool | None, fmt: str) -> None:
        rows.append({"target": target, "measured": measured, "met": met, "format": fmt})

    per_round = _ratio(get("diloco", "outer_message_bytes"), get("sparseloco", "outer_message_bytes"))
    add("sparseloco sends ≥ 30× fewer bytes per round than fp32 diloco (counted, per receiving peer)", per_round,
        None if per_round is None else per_round >= 30, "{:,.0f}×")  # fmt: skip
    per_token = _ratio(get("ddp", "bytes_per_token"), get("sparseloco", "bytes_per_token"))
    add("sparseloco moves ≥ 500× fewer wire bytes per token than ddp (stated for H = 30)", per_token,
        None if per_token is None else per_token >= 500, "{:,.0f}×")  # fmt: skip
    loss_gap = _ratio(get("hetero", "final_eval_loss"), get("ddp", "final_eval_loss"))
    add("hetero's final eval loss within 3% of ddp's (ratio)", loss_gap,
        None if loss_gap is None else loss_gap <= 1.03, "{:.3f}")  # fmt: skip
    speed = _ratio(get("ddp", "wall_s"), get("hetero", "wall_s"))
    add("hetero takes ≤ 1/5 of ddp's wall time (ddp / hetero)", speed, None if speed is None else speed >= 5,
        "{:.2f}×")  # fmt: skip
    versus = _ratio(get("compress-all", "final_eval_loss"), get("hetero", "final_eval_loss"))
    add("hetero's eval loss below compress-all's (compress-all / hetero)", versus,
        None if versus is None else versus > 1, "{:.3f}")  # fmt: skip
    sooner = (time_to_ddp_loss(ok) or {}).get("methods", {}).get("hetero")
    if sooner is not None:
        factor = sooner["times_sooner_than_ddp"]
        add("hetero reaches ddp's final eval loss (within 3%) ≥ 10× sooner than ddp", factor,
            factor is not None and factor >= 10, "{:.2f}×")  # fmt: skip
    hetero_nodes = ok.get("hetero", {}).get("nodes", {}).values()
    utilisation = [n["compute_utilisation"] for n in hetero_nodes if n["role"] == "full"]
    lowest = min((u for u in utilisation if u is not None), default=None)
    add("hetero: every full replica's compute utilisation ≥ 90% (lowest)", lowest,
        None if lowest is None else lowest >= 0.9, "{:.0%}")  # fmt: skip
    share = get("hetero", "edge_token_share")
    add("hetero: edge nodes contribute ≥ 25% of the swarm's tokens", share, None if share is None else share >= 0.25,
        "{:.0%}")  # fmt: skip
    return rows


def write_report(runs: list[dict[str, Any]], out: Path) -> Path:
    """Write report.json, report.md and the two plots under `out`; returns report.json's path."""
    swarm = [run for run in runs if run["method"] != "ddp"]  # the round settings are the swarm methods'
    settings = (swarm or runs)[0]["config"] if runs else {}
    scenario = {
        "topology": runs[0]["topology"] if runs else None,
        **{k: settings.get(k) for k in SCENARIO_KEYS},
    }
    methods = {run["method"]: summarize_run(run) for run in runs}
    checks = {run["method"]: check for run in runs if (check := check_run(run)) is not None}
    report = {"scenario": scenario, "methods": methods, "targets": targets(methods),
              "time_to_ddp_loss": time_to_ddp_loss(methods), "cost_model": checks}  # fmt: skip
    results.write_report(out, report, render_markdown(report))
    _plot(methods, out)
    logger.info("report written to %s", out / "report.json")
    return out / "report.json"


def _plot(methods: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    for filename, key, scale, label, log_x in (
        (LOSS_VS_WALL, "at_s", 1.0, "wall time (s)", False),
        (LOSS_VS_BYTES, "wire_bytes_sent", 1e-6, "bytes on the wire, whole swarm (MB)", True),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for method, summary in methods.items():
            curve = summary["curve"]
            if curve:
                ax.plot([p[key] * scale for p in curve], [p["eval_loss"] for p in curve], marker="o", label=method)
        if log_x and ax.lines:
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("eval loss")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)


def _contributed(node: dict[str, Any]) -> str:
    if node["rounds_contributed"] is None:
        return ""
    return f"{node['rounds_contributed']} / {node['rounds']}"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / 1e6:,.2f}"


def _kb(value: float | None) -> str:
    return "" if value is None else f"{value / 1e3:,.1f}"


def _budget(scenario: dict[str, Any]) -> str:
    swarm_rounds = scenario.get("swarm_rounds")
    if swarm_rounds and swarm_rounds != scenario["rounds"]:
        return f"ddp {scenario['rounds']} rounds, swarm methods {swarm_rounds} rounds"
    return f"{scenario['rounds']} rounds"


def _time_to_loss_table(report: dict[str, Any]) -> list[str]:
    """Markdown lines: when each method reached ddp's final loss, with its whole-run figures beside."""
    reached = report.get("time_to_ddp_loss")
    if not reached:
        return []
    lines = [
        f"## Time to ddp's final eval loss ({reached['ddp_final_eval_loss']:.4f}, reached at ≤ "
        f"{reached['target_eval_loss']:.4f})",
        "",
        "| method | reached at round | wall s | tokens | wire MB by then | × sooner than ddp | final eval loss | "
        "ceiling × | bytes/token (whole run) | mean compute util. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, row in reached["methods"].items():
        m = report["methods"][method]
        utilisation = _mean([n["compute_utilisation"] for n in m["nodes"].values()])
        at = (f"{row['round']} | {row['at_s']:.1f} | {row['tokens']:,.0f} | {_mb(row['wire_bytes_sent'])} | "
              f"{row['times_sooner_than_ddp']:.2f}×" if row["reached"] else "not reached |  |  |  | ")  # fmt: skip
        lines.append(
            f"| {method} | {at} | {_fmt(m['final_eval_loss'], '.4f')} | {_fmt(row['ceiling_times_sooner'], '.2f')} | "
            f"{_fmt(m['bytes_per_token'], ',.0f')} | {_fmt(utilisation, '.0%')} |"
        )
    return [
        *lines,
        "",
        "Rounds count from 0; wall time from launch (start-up included, as above). Ceiling: ddp's time over the "
        "method's start-up plus ddp's tokens at the tokens/s it kept after it (its rounds' costs included): the most "
        "× sooner it could have been had it needed no more tokens than ddp.",
        "",
    ]


def _cost_model_table(checks: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines: the cost model's round period and bytes per node against the run's (`model_check`)."""
    if not checks:
        return []
    lines = [
        "## The cost model against this run",
        "",
        "| method | round s predicted | measured | error | bytes sent per node per round, predicted / measured "
        "(error) |",
        "|---|---|---|---|---|",
    ]
    for method, c in checks.items():
        per_node = ", ".join(
            f"{name} {_kb(c['predicted_bytes_sent_per_round'][name])} / {_kb(sent)} KB "
            f"({_fmt(c['bytes_error'].get(name), '+.0%')})"
            for name, sent in c["measured_bytes_sent_per_round"].items()
        )
        lines.append(
            f"| {method} | {c['predicted_round_s']:.2f} | {_fmt(c['measured_round_s'], '.2f')} | "
            f"{_fmt(c['round_error'], '+.0%')} | {per_node} |"
        )
    rtt = max(c.get("rtt_ms", 0.0) for c in checks.values())
    latency = (
        f"each pair's round trip from its nodes' access latencies (the worst pair's: {rtt:g} ms)"
        if rtt
        else "no latency"
    )
    note = ("Inputs: each node's link and measured training speed, the run's own assignment, "
            f"{latency}; the model's defaults (matchmaking 1 s, 0.53 MB protocol overhead per node per round). "
            "Bytes: interface counters.")  # fmt: skip
    return [*lines, "", note, ""]


def render_markdown(report: dict[str, Any]) -> str:
    scenario = report["scenario"]
    lines = [
        f"# Benchmark: {scenario['topology']} topology, {scenario['preset']} preset",
        "",
        f"{_budget(scenario)} × H = {scenario['inner_steps']} inner steps per node, batch "
        f"{scenario['batch_size']} × {scenario['seq_len']} tokens, {scenario['stages']} stages, peak LR "
        f"{scenario['lr']}. One `swarm` row per method, then one row per node.",
        "",
        "| method | node | role / status | final eval loss | wall s | wire sent MB | wire received MB | "
        "counted sent MB | message KB | rounds not aggregated | contributed / rounds | inner steps | bytes/token | "
        "compute util. | tokens/s | edge token share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in report["methods"].items():
        lines.append(
            f"| {method} | swarm | {m['status']} | {_fmt(m['final_eval_loss'], '.4f')} | {m['wall_s']:.1f} | "
            f"{_mb(m['wire_bytes_sent'])} | {_mb(m['wire_bytes_received'])} | {_mb(m['reported_bytes_sent'])} | "
            f"{_kb(m['outer_message_bytes'])} | {m['rounds_not_aggregated']} | "
            f"{_fmt(m['lowest_contribution_share'], '.0%')} (lowest) |  | "
            f"{_fmt(m['bytes_per_token'], ',.0f')} |  | {_fmt(m['tokens_per_s'], ',.0f')} | "
            f"{_fmt(m['edge_token_share'], '.0%')} |"
        )
        for name, n in m["nodes"].items():
            edge = " (edge)" if n["edge"] else ""
            lines.append(
                f"| {method} | {name}{edge} | {n['role']} |  | {_fmt(n['wall_s'], '.1f')} | "
                f"{_mb(n['wire_bytes_sent'])} | {_mb(n['wire_bytes_received'])} | {_mb(n['reported_bytes_sent'])} | "
                f"{_kb(n['outer_message_bytes'])} | {n['rounds_not_aggregated']} | "
                f"{_contributed(n)} | {n['inner_steps']:,} | "
                f"{_fmt(n['bytes_per_token'], ',.0f')} | {_fmt(n['compute_utilisation'], '.0%')} | "
                f"{_fmt(n['tokens_per_s'], ',.0f')} |  |"
            )
    lines += [
        "",
        "Wall time: swarm rows from launch to the last finished round (start-up included); node rows from the "
        "start of the node's first round. Wire bytes: interface counters (swarm rows add the bootstrap's). "
        "Counted bytes: what the program reports sending. Bytes/token: wire bytes sent per training token. "
        "Message KB: outer-round bytes a node sent per round per peer that fetched them, i.e. the size of its "
        "round message (counted; ddp: its all-reduce traffic per evaluation interval / (W − 1); the swarm row is "
        "the mean over nodes). Rounds not aggregated: node-rounds whose contribution missed its group (the node "
        "re-synced). "
        "Contributed / rounds: rounds whose aggregate holds the node's message (a virtual replica's stages each "
        "count theirs), of the rounds it took part in; the swarm row shows the lowest node's share. Inner steps: "
        "steps trained (rounds are time-boxed, so slower nodes train fewer). "
        "Compute utilisation: compute time / the node's wall time.",
        "",
        *_time_to_loss_table(report),
        *_cost_model_table(report.get("cost_model") or {}),
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(
            f"| {t['target']} | {'' if t['measured'] is None else t['format'].format(t['measured'])} | "
            f"{'n/a' if t['met'] is None else ('yes' if t['met'] else 'no')} |"
            for t in report["targets"]
        ),
        "",
        f"![eval loss vs wall time]({LOSS_VS_WALL})",
        "",
        f"![eval loss vs bytes on the wire]({LOSS_VS_BYTES})",
        "",
    ]
    return "\n".join(lines)
