"""A round's contributors come from the DHT roster (`protocol/roster.py`): a member frozen in any phase of a round
(training it, between its statement and its seal, sealing, fetching) must not split the others, and it comes back to
their weights.

Real `hetero-node join` processes on 127.0.0.1. The freeze (SIGSTOP to the member's process group) lasts longer
than the others wait for its seal (`--matchmaking-s`) and for its message (`--fetch-timeout-s`), so they seal it in
(it was on time) and then drop its message together.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from swarm_helpers import assert_all_exit_cleanly, rounds_of, start_replicas

from hetero_node.client.cli.local_swarm import LocalSwarm

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(420)]

FREEZE_S = 15.0
"""Past the tests' seal wait (3 s) and fetch deadline (10 s)."""


def swarm_logs(tmp_path: Path) -> str:
    return "".join(path.read_text() for path in tmp_path.rglob("*.log"))


def wait_for_log(swarm: LocalSwarm, name: str, text: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in swarm.log_path(name).read_text():
        assert time.monotonic() < deadline, f"{name} never logged {text!r}"
        time.sleep(0.05)


def seal_time(swarm: LocalSwarm, name: str, round_: int) -> float:
    """The DHT time (Unix time here: one machine) by which `name` seals shard 1 of `round_`, from its log."""
    wait_for_log(swarm, name, f"shard 1 round {round_}: ")
    found = re.search(rf"shard 1 round {round_}: .* sealing by DHT time ([0-9.]+)", swarm.log_path(name).read_text())
    assert found, f"{name} logged no sealing time for round {round_}"
    return float(found.group(1))


def freeze_when(swarm: LocalSwarm, name: str, round_: int, phase: str) -> None:
    """Return at the moment to freeze `name` in `phase` of `round_`: training it, after its statement (stored, not
    sealed), while sealing (the seal wait runs from the sealing time), or fetching and applying the messages."""
    if phase == "training":
        wait_for_log(swarm, name, f"hetero_node.rounds: round {round_ - 1}: ")  # the round before ended
        return
    sealing = seal_time(swarm, name, round_)
    if phase == "stated":
        time.sleep(0.5)  # its statements are being stored by its DHT process, which the freeze stops too
        return
    time.sleep(max(0.0, sealing + {"sealing": 0.1, "fetching": 1.0}[phase] - time.time()))


# long: about 70 s each. Before the heal step the "stated" case failed whenever one member fetched the frozen member's
# message in the half second before the freeze and another did not (2 of 3 runs on 2026-11-26): the roster gave
# everyone the same set, but a message one member got and another timed out on split the result, and the 1-1 tie
# voided later rounds.
@pytest.mark.long
@pytest.mark.parametrize("phase", ["training", "stated", "sealing", "fetching"])
def test_a_member_frozen_in_any_phase_of_a_round_does_not_split_the_others_and_comes_back(
    tmp_path: Path, phase: str
) -> None:
    rounds, frozen_at = 8, 2
    with LocalSwarm(tmp_path) as swarm:
        start_replicas(swarm, 3, tmp_path, rounds=rounds)
        freeze_when(swarm, "r2", frozen_at, phase)
        group = swarm.processes["r2"].pid
        os.killpg(group, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.killpg(group, signal.SIGCONT)
        assert_all_exit_cleanly(swarm, ["r0", "r1", "r2"])
    r0, r1, r2 = (rounds_of(tmp_path, i) for i in range(3))
    assert set(r0) == set(r1) == set(range(rounds))
    healed = swarm_logs(tmp_path)
    for t in range(rounds):  # the two never frozen hold the same weights after every round, or the next one healed it
        if r0[t]["fingerprints"] != r1[t]["fingerprints"]:
            assert t + 1 < rounds and f"healed round {t} " in healed, f"round {t}: the others split and never healed"
            assert r0[t + 1]["fingerprints"] == r1[t + 1]["fingerprints"], f"round {t + 1}: still split after a heal"
    # it ends with the swarm's θ: by the last round, or (the others ran the remaining rounds during its freeze) by
    # loading the final state in the round it woke up in
    last = r2[max(r2)]
    assert last["fingerprints"] == r0[rounds - 1]["fingerprints"], "the frozen member did not come back"
