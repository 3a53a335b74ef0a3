"""The cost model against a netlab run: predict the run's round from what the lab gave its nodes, compare.

Inputs the model gets, per node: its link rates (the topology's), its training speed (measured in the run:
tokens over compute seconds, a stage's scaled to the full model by its share of the FLOPs), the assignment the run
actually had (roles, virtual replicas and stages from the nodes' metrics headers), and its round trip as its record
would give it (`round_trips_ms`), from which the model estimates every pair's as the nodes do. Nothing is fitted to
the run: matchmaking time and protocol overhead are the model's defaults (the overhead's default came from the
sparseloco run of `make bench-long`, so that row checks nothing about bytes). What is compared: the round period
(time between a node's successive rounds, median over nodes) and the bytes each node sent per round (interface
counters).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from hetero_node.client.swarm.cost_model import Assignment, LinkModel, RunShape, predict_round
from hetero_node.client.swarm.planner import PeerInfo
from hetero_node.protocol.errors import HeteroNodeError
from hetero_node.protocol.run_config import RunConfig


def _assignment(nodes: list[dict[str, Any]], stages: int) -> Assignment | None:
    full = tuple(n["name"] for n in nodes if n["header"].get("role") == "full")
    vrs: dict[int, dict[int, str]] = {}
    for n in nodes:
        if n["header"].get("role") == "stage":
            vrs.setdefault(n["header"]["vr"], {})[n["header"]["stage"]] = n["name"]
    if any(len(held) != stages for held in vrs.values()):
        return None
    return Assignment(full, tuple(tuple(held[s] for s in range(stages)) for _, held in sorted(vrs.items())))


def _period(rounds: list[dict[str, Any]]) -> float | None:
    times = [r["observed"]["at_s"] for r in rounds]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _run_config(run: dict[str, Any]) -> RunConfig | None:
    """The run's config: recorded in the run (since the cost model exists), else in a node's metrics header."""
    if run.get("run"):
        return RunConfig.from_dict(run["run"])
    for node in run["nodes"]:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError, HeteroNodeError):
            metrics = Path(node["log"]).with_suffix(".jsonl")
            return RunConfig.from_dict(json.loads(metrics.read_text().splitlines()[0])["header"]["run"])
    return None


def round_trips_ms(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Each node's round trip to a peer as close to the core as the best-connected node, 2 × (its access latency +
    that node's): from these `cost_model.Latency` recovers every pair's, 2 × (l_a + l_b), exactly."""
    nearest = min((n.get("latency_ms", 0.0) for n in nodes), default=0.0)
    return {n["name"]: 2 * (n.get("latency_ms", 0.0) + nearest) for n in nodes}


def worst_rtt_ms(nodes: list[dict[str, Any]]) -> float:
    """The longest round trip between two of the run's nodes (twice their summed access latencies)."""
    latencies = sorted((n.get("latency_ms", 0.0) for n in nodes), reverse=True)
    return 2 * sum(latencies[:2])


def check_run(run: dict[str, Any]) -> dict[str, Any] | None:
    """Predicted vs measured round period and bytes per node per round; None for ddp, failed runs, runs whose
    config is lost, or with an incomplete virtual replica."""
    config = None if run["method"] == "ddp" or run["status"] != "ok" else _run_config(run)
    if config is None:
        return None
    shape = RunShape.from_run(config)
    assignment = _assignment(run["nodes"], shape.stages)
    if assignment is None or not assignment.replicas or not all(n["rounds"] for n in run["nodes"]):
        return None
    peers, rtts = {}, round_trips_ms(run["nodes"])
    for n in run["nodes"]:
        header, rounds = n["header"], n["rounds"]
        share = shape.stage_compute_share[header["stage"]] if header.get("role") == "stage" else 1.0
        speed = share * sum(r["tokens"] for r in rounds) / max(sum(r["compute_s"] for r in rounds), 1e-9)
        memory = 10**12  # the run's own assignment is checked, not the memory the node advertised
        peers[n["name"]] = PeerInfo(n["name"], memory, n["up_mbit"], n["down_mbit"], speed, rtt_ms=rtts[n["name"]])
    rtt_ms = worst_rtt_ms(run["nodes"])
    prediction = predict_round(peers, assignment, shape, LinkModel())
    periods = [p for p in (_period(n["rounds"]) for n in run["nodes"]) if p is not None]
    measured_period = statistics.median(periods) if periods else None
    sent = {n["name"]: n["wire_bytes_sent"] / len(n["rounds"]) for n in run["nodes"]}
    predicted_sent = {name: node.bytes_up for name, node in prediction.nodes.items()}
    return {
        "rtt_ms": rtt_ms,
        "predicted_round_s": prediction.round_s,
        "measured_round_s": measured_period,
        "round_error": prediction.round_s / measured_period - 1 if measured_period else None,
        "predicted_bytes_sent_per_round": predicted_sent,
        "measured_bytes_sent_per_round": sent,
        "bytes_error": {k: predicted_sent[k] / sent[k] - 1 for k in sent if sent[k]},
    }
