"""A swarm cut in two and joined again: four replicas in network namespaces; the ports of some are moved to a bridge
of their own (`NetLab.partition`: they still reach each other, not the rest), then back (`NetLab.rejoin`). A side
that holds no majority of the last certificate's members never applies a round of its own (`protocol/quorum.py`),
so when the link is back there is one θ to go on from, not two models. Needs root and network namespaces; long (about
2 minutes each): `make test-long`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import assert_all_exit_cleanly, rounds_of, start_replicas, wait_for_round

from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import netns_unavailable_reason

UNAVAILABLE = netns_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}"),
    pytest.mark.multipeer,
    pytest.mark.long,
    pytest.mark.timeout(480),
]

REPLICAS = 4
ROUNDS = 12
ROUND_S = 3.0
CUT_S = 4 * ROUND_S
"""How long the sides stay apart: about 2 rounds (a round takes 5-7 s here: 3 s of training, then its exchange, which
is where a cut is felt). Shorter than `--quorum-patience` (5) rounds, after which a side whose peers' records are all
gone from its view would count only those it still sees, and than the rounds whose messages peers keep serving
(KEPT_ROUNDS, 4: the one cut off rebuilds what it missed from them, no state download)."""


def applied(record: dict[str, Any]) -> bool:
    """The replica applied a round's result from its own reading of the seals (not a void, not caught up)."""
    return record["caught_up"] == "" and not record["uncertified"] and record["group_size"] >= 1


def fingerprint_of(rounds: dict[int, dict[str, Any]], t: int) -> str:
    return json.dumps(rounds[t]["fingerprints"], sort_keys=True)


@pytest.mark.parametrize("cut", [("r2", "r3"), ("r3",)], ids=["2-2", "3-1"])
def test_a_side_without_a_majority_never_applies_a_round_and_the_swarm_agrees_once_joined(
    tmp_path: Path, cut: tuple[str, ...]
) -> None:
    with LabSwarm(tmp_path, 1000.0) as swarm:
        start_replicas(swarm, REPLICAS, tmp_path, ROUNDS, inner_steps=4, run_extra={"round_s": ROUND_S})
        wait_for_round(tmp_path, 0, 1, timeout=180)
        assert swarm.lab is not None
        swarm.lab.partition(cut)
        cut_from = time.time()
        time.sleep(CUT_S)
        swarm.lab.rejoin()
        assert_all_exit_cleanly(swarm, [f"r{i}" for i in range(REPLICAS)], timeout=300)
    replicas = {f"r{i}": rounds_of(tmp_path, i) for i in range(REPLICAS)}
    last = ROUNDS - 1
    assert len({r[last]["fingerprints"]["0"] for r in replicas.values()}) == 1, "the sides never joined again"
    assert len({r[last]["fingerprints"]["1"] for r in replicas.values()}) == 1

    # a round applied by a side alone has a set of at most that side, and the other side holds another θ after it;
    # a set of at most half that every replica applied alike was decided by a majority's seals (statements that
    # reached some sealers late after the rejoin are out of the set, not out of the vote)
    for name, rounds in replicas.items():
        small = [t for t, r in rounds.items() if applied(r) and 2 * r["group_size"] <= REPLICAS]
        alone = [t for t in small if len({fingerprint_of(r, t) for r in replicas.values() if t in r}) > 1]
        assert not alone, f"{name} applied rounds {alone} without a majority"
    minority = cut if len(cut) < REPLICAS / 2 else tuple(replicas)  # 2|2: neither side is a majority
    after = {name: {t: r for t, r in rounds.items() if r["ended_at"] > cut_from} for name, rounds in replicas.items()}
    missed = ("void", "behind", "messages")  # its last record of a round it could not apply itself
    for name in minority:  # the cut was felt: a round it could not certify, so did not apply
        felt = [t for t, r in after[name].items() if r["uncertified"] or r["caught_up"] in missed]
        assert felt, f"{name} applied every round though cut off: {after[name]}"
    if len(cut) < REPLICAS / 2:  # 3|1: the majority goes on without the one
        went_on = [t for t, r in after["r0"].items() if applied(r) and r["group_size"] == REPLICAS - 1]
        assert went_on, f"the majority applied no round while r3 was cut off: {after['r0']}"
        rebuilt = [t for t, r in after["r3"].items() if r["caught_up"] == "messages"]
        assert rebuilt, f"r3 did not rebuild the rounds it missed from their messages: {after['r3']}"
    # 2|2: nobody moved on, so there is no state to download; 3|1: the missed rounds' messages are still served
    loaded = {name: [t for t, r in rs.items() if r["caught_up"] == "state"] for name, rs in replicas.items()}
    assert not any(loaded.values()), f"a state download where the messages were at hand: {loaded}"
