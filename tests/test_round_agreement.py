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
from swarm_helpers import rounds_of, start_replicas

from hetero_node.client.cli.local_swarm import LocalSwarm

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(420)]

FREEZE_S = 15.0
"""Past the tests' seal wait (3 s) and fetch deadline (10 s)."""
BACK_WITHIN_S = 120.0
"""From the wake to a round the frozen member contributes to and ends with the others' weights."""


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


def rejoined(tmp_path: Path, after: int) -> list[int]:
    """Rounds after `after` in which the frozen member r2 contributed and ended with r0's weights."""
    r0, r2 = rounds_of(tmp_path, 0), rounds_of(tmp_path, 2)
    return [
        t
        for t, r in r2.items()
        if t > after and r["contributed"] and t in r0 and r["fingerprints"] == r0[t]["fingerprints"]
    ]


# long: about 60 s each. Before the heal step the "stated" case failed whenever one member fetched the frozen member's
# message in the half second before the freeze and another did not (2 of 3 runs on 2026-11-26): the roster gave
# everyone the same set, but a message one member got and another timed out on split the result, and the 1-1 tie
# voided later rounds.
@pytest.mark.long
@pytest.mark.parametrize("phase", ["training", "stated", "sealing", "fetching"])
def test_a_member_frozen_in_any_phase_of_a_round_does_not_split_the_others_and_comes_back(
    tmp_path: Path, phase: str
) -> None:
    """The run is long (200 rounds) and stopped once the frozen member is back: with a run of 8 short rounds the
    others sometimes finished it during the freeze (the freeze lands a round or two late when every statement is in
    before the round's close), and a member that wakes with nobody left cannot come back."""
    frozen_at = 2
    with LocalSwarm(tmp_path) as swarm:
        start_replicas(swarm, 3, tmp_path, rounds=200)
        freeze_when(swarm, "r2", frozen_at, phase)
        group = swarm.processes["r2"].pid
        os.killpg(group, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.killpg(group, signal.SIGCONT)
        woke_in = max(rounds_of(tmp_path, 2))
        deadline = time.monotonic() + BACK_WITHIN_S
        while not (back := rejoined(tmp_path, woke_in)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for name in ("r0", "r1", "r2"):
            assert swarm.stop(name, timeout=30) == 0, f"{name} did not exit cleanly on SIGTERM"
    r0, r1 = rounds_of(tmp_path, 0), rounds_of(tmp_path, 1)
    both = sorted(set(r0) & set(r1))
    assert both == list(range(len(both))) and len(both) > woke_in, (sorted(r0), sorted(r1))
    healed = swarm_logs(tmp_path)
    for t in both[:-1]:  # the two never frozen hold the same weights after every round, or the next one healed it
        if r0[t]["fingerprints"] != r1[t]["fingerprints"]:
            assert f"healed round {t} " in healed, f"round {t}: the others split and never healed"
            assert r0[t + 1]["fingerprints"] == r1[t + 1]["fingerprints"], f"round {t + 1}: still split after a heal"
    assert back, (
        f"the frozen member (woken in round {woke_in}) never held the others' weights again: {rounds_of(tmp_path, 2)}"
    )
