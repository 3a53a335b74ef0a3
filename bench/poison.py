"""`hetero-node-lab poison`: what a joiner loads when some of the donors it can reach lie about their state.

Each scenario starts fresh real peers in this process (hivemind DHT and libp2p streams on loopback): honest full
replicas serving round 5 of a small two-shard state with every weight 1.0, liars serving something else, and a
joiner that, once it sees every donor's record, calls the node's own loader (`ShardStates.load`) with a
`--wait-s` deadline. The liars are the donors with the highest peer ids, so whenever the loader considers one at
the round it picks, it asks the liar first: the order of donors never hides a lie. Each trial's outcome is one of

* honest: the joiner loaded round 5 with the honest weights;
* liar: it loaded a state the honest donors do not hold (goal: 0 wherever the honest donors are a strict majority);
* none: it loaded nothing within the deadline (a joiner then keeps waiting);

with the seconds the load took and whether a liar was asked for its state at all (a liar that served bytes was
stopped by the blob checks, not by the choice of donors). Two ties (as many liars as honest donors) mark where the
guarantee ends: with no honest majority the loader has nothing to prefer the honest state by.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.progress import Progress
from torch import Tensor

from hetero_node.bench.config import PoisonConfig
from hetero_node.bench.results import write_report
from hetero_node.bench.samples import record_fields
from hetero_node.client.outer.shard_state import ShardStates, state_fingerprint
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL

RUN_ID = "0123456789abcdef"
SHAPES = {0: [(4, 3)], 1: [(5,)]}
"""Two shards, small: what is measured is which state is chosen, not how fast it travels."""
HONEST_ROUND, HONEST_WEIGHT, LIAR_WEIGHT = 5, 1.0, 100.0
RECORDS_TIMEOUT_S = 30.0
"""How long a trial waits for the joiner to see every donor's record before it loads anyway."""
OUTCOMES = ("honest", "liar", "none")


@dataclass(frozen=True)
class Scenario:
    """Who the joiner's donors are; the honest ones always serve round 5 with every weight 1.0."""

    description: str
    honest: int
    liars: int
    liar_round: int
    liar_weight: float = LIAR_WEIGHT
    claims_honest: bool = False
    """The liars' records advertise the honest fingerprints, whatever they serve."""
    record_only: int = 0
    """Ids that back the liars with signed records alone (same round and fingerprints) and no running node: each
    cost one key. Counting records, 3 of them beside one liar out-voted 2 honest donors (the review's C2)."""
    expected: str = "honest"
    """What the loader's rules (upper-median round ceiling, strict-majority fingerprint, blob checks) lead to."""


SCENARIOS = {
    "one-ahead": Scenario("one liar a round ahead, its own matching fingerprint", 2, 1, HONEST_ROUND + 1),
    "far-ahead": Scenario("one liar at round 10⁶, its own matching fingerprint", 2, 1, 10**6),
    "same-round": Scenario("one liar at round 5 with other weights, its own matching fingerprint", 2, 1, HONEST_ROUND),
    "claims-honest-fp": Scenario("one liar at round 5 advertising the honest fingerprint, serving other weights",
                                 2, 1, HONEST_ROUND, claims_honest=True),
    "nan-ahead": Scenario("one liar a round ahead serving NaN weights, its own matching fingerprint",
                          2, 1, HONEST_ROUND + 1, liar_weight=math.nan),
    "nan-claims-honest-fp": Scenario("one liar at round 5 advertising the honest fingerprint, serving NaN weights",
                                     2, 1, HONEST_ROUND, liar_weight=math.nan, claims_honest=True),
    "minority-ahead": Scenario("2 liars at round 6 sharing one fingerprint, 3 honest", 3, 2, HONEST_ROUND + 1),
    "tie": Scenario("2 liars at round 5 sharing one fingerprint, 2 honest", 2, 2, HONEST_ROUND, expected="none"),
    "tie-liars-ahead": Scenario("2 liars at round 6 sharing one fingerprint, 2 honest (no honest majority)",
                                2, 2, HONEST_ROUND + 1, expected="liar"),
    "record-only-ahead": Scenario("1 liar at round 6 backed by 3 record-only ids, 2 honest", 2, 1, HONEST_ROUND + 1,
                                  record_only=3),
}  # fmt: skip
"""By the names `--scenarios` takes (`POISON_SCENARIOS`)."""


@contextlib.contextmanager
def swarm(size: int) -> Iterator[list[PeerRuntime]]:
    """`size` peers joined to the run, the first one the others' entry point; all shut down on exit."""
    runtimes = [PeerRuntime([])]
    try:
        entry = [str(runtimes[0].dht.get_visible_maddrs()[0])]
        runtimes += [PeerRuntime(entry) for _ in range(size - 1)]
        for runtime in runtimes:
            runtime.join_run(RUN_ID)
        yield runtimes
    finally:
        for runtime in runtimes:
            runtime.shutdown()


def serve(
    runtime: PeerRuntime,
    round_: int,
    weight: float,
    advertise: dict[str, str] | None = None,
    refresh_s: float = 2.0,
) -> dict[str, str]:
    """Publish a full replica's state of round `round_` (every weight = `weight`) and a record advertising its
    fingerprints, or `advertise` instead (a liar's claim), live 3 × `refresh_s` after each refresh; returns the
    fingerprints of what it serves."""
    tensors = {shard: [torch.full(shape, weight) for shape in shapes] for shard, shapes in SHAPES.items()}
    ShardStates(runtime, SHAPES, None, fetch_timeout_s=10).publish(round_, tensors, None)
    fps = {str(shard): state_fingerprint(ts, None) for shard, ts in tensors.items()}
    fields = record_fields(
        str(runtime.peer_id), role=ROLE_FULL, round=round_, certified=round_, fingerprints=advertise or fps,
        addrs=runtime.advertised_addrs,
    )  # fmt: skip
    runtime.announce(PeerRecord(**fields), refresh_s=refresh_s)
    return fps


def wait_for_records(runtime: PeerRuntime, count: int, timeout_s: float = RECORDS_TIMEOUT_S) -> int:
    """Wait until `runtime` reads at least `count` records (or `timeout_s` passes); how many it read last."""
    deadline = time.monotonic() + timeout_s
    while (seen := len(runtime.read_records() or {})) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return seen


def classify(loaded: tuple[int, dict[int, dict[str, Any]], int] | None) -> str:
    """honest, liar or none (see the module docstring)."""
    if loaded is None:
        return "none"
    round_, shards, _ = loaded
    tensors: list[Tensor] = [t for state in shards.values() for t in state["tensors"]]
    honest = round_ == HONEST_ROUND and all(torch.equal(t, torch.full_like(t, HONEST_WEIGHT)) for t in tensors)
    return "honest" if honest else "liar"


def run_trial(scenario: Scenario, wait_s: float) -> dict[str, Any]:
    """One trial on fresh peers: the outcome, the round loaded, the load's seconds, whether a liar was asked, and
    how many donor records the joiner saw before loading."""
    with swarm(1 + scenario.honest + scenario.liars + scenario.record_only) as (joiner, *donors):
        sybils = donors[len(donors) - scenario.record_only :]
        donors = donors[: len(donors) - scenario.record_only]
        donors.sort(key=lambda runtime: str(runtime.peer_id))  # liars last: the loader asks higher ids first
        honest, liars = donors[: scenario.honest], donors[scenario.honest :]
        for runtime in honest:
            honest_fps = serve(runtime, HONEST_ROUND, HONEST_WEIGHT)  # the same state on every honest donor
        for runtime in liars:
            serve(runtime, scenario.liar_round, scenario.liar_weight, honest_fps if scenario.claims_honest else None)
        for runtime in sybils:  # a record that outlives its node by minutes: the node was only there to sign it
            serve(runtime, scenario.liar_round, scenario.liar_weight, refresh_s=120.0)
        if sybils:  # stored where the others read it, then the node goes before the joiner ever dials it
            wait_for_records(honest[0], len(donors) + len(sybils))
            for runtime in sybils:
                runtime.shutdown()
        seen = wait_for_records(joiner, len(donors) + len(sybils))
        start = time.monotonic()
        states = ShardStates(joiner, SHAPES, None, fetch_timeout_s=10)
        loaded = states.load(lambda: joiner.read_records() or {}, 0, wait_s, threading.Event())
        load_s = time.monotonic() - start
        return {
            "outcome": classify(loaded), "round": None if loaded is None else loaded[0], "load_s": round(load_s, 2),
            "liar_asked": any(runtime.bytes_served_total for runtime in liars), "records_seen": seen,
        }  # fmt: skip


def run_poison(cfg: PoisonConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every chosen scenario `cfg.trials` times; returns the report (also `out/report.json` and `report.md`)."""
    started = time.monotonic()
    scenarios = {}
    for name in cfg.scenario_list:
        task = progress.add_task(name, total=cfg.trials) if progress else None
        trials = []
        for _ in range(cfg.trials):
            trials.append(run_trial(SCENARIOS[name], cfg.wait_s))
            if progress is not None and task is not None:
                progress.advance(task)
        fields = {**asdict(SCENARIOS[name]), "liar_weight": f"{SCENARIOS[name].liar_weight:g}"}  # JSON has no NaN
        scenarios[name] = {**fields, "trials": trials}
    report = {"trials": cfg.trials, "wait_s": cfg.wait_s, "wall_s": round(time.monotonic() - started, 1),
              "scenarios": scenarios}  # fmt: skip
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Poisoned state: {report['trials']} trial(s) per scenario on fresh peers, honest donors at round "
        f"{HONEST_ROUND}, the joiner's deadline {report['wait_s']:g} s; {report['wall_s']:g} s in all.\n",
        "| scenario | honest : liars | expected | honest loaded | liar weights loaded | nothing loaded | liar asked "
        "| load s (median / max) |",
        "|---" * 8 + "|",
    ]
    short = []
    for name, s in report["scenarios"].items():
        trials = s["trials"]
        counts = {outcome: sum(t["outcome"] == outcome for t in trials) for outcome in OUTCOMES}
        seconds = [t["load_s"] for t in trials]
        lines.append(
            f"| {name}: {s['description']} | {s['honest']} : {s['liars']} | {s['expected']} | {counts['honest']} | "
            f"{counts['liar']} | {counts['none']} | {sum(t['liar_asked'] for t in trials)} | "
            f"{statistics.median(seconds):.1f} / {max(seconds):.1f} |"
        )
        short += [f"{name} (saw {t['records_seen']})" for t in trials if t["records_seen"] < s["honest"] + s["liars"]]
    lines.append("\nGoal: no liar weights loaded wherever the honest donors are a strict majority.")
    if short:
        lines.append(f"Trials whose joiner saw fewer records than donors before loading: {', '.join(short)}.")
    return "\n".join(lines) + "\n"
