"""A whole swarm stopped one peer after another and restarted from its checkpoints, which then hold different rounds:
two full replicas and a virtual replica (two stage peers) in network namespaces; the first full replica is stopped,
a round later both stages, a round later the last full replica, so the checkpoints hold rounds like 4, 5, 5, 6 (the
last one alone could not certify its final round: it voided it). Restarted together, they must get back to one
certified round and one θ within 2 rounds of training again, without rounds that end "failed" (nobody serving what
a peer waits for: the restart deadlock of issue 31). Needs root and network namespaces; long (about 3 minutes):
`make test-long`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import assert_all_exit_cleanly, join_args, rounds_of, run_args, wait_for_round

from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import netns_unavailable_reason
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, read_checkpoint

UNAVAILABLE = netns_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}"),
    pytest.mark.multipeer,
    pytest.mark.long,
    pytest.mark.timeout(600),
]

ROUNDS = 16
STOP_FROM = 3
"""The first full replica stops once it has recorded this round."""
PEERS = {"r0": (0, None), "r1": (1, None), "s0": (10, 0), "s1": (11, 1)}
"""name: (metrics index, stage or None for a full replica)."""
WITHIN_ROUNDS = 2


def start(swarm: LabSwarm, peers: str, workdir: Path, name: str) -> None:
    index, stage = PEERS[name]
    if stage is None:
        swarm.start(name, join_args(peers, index, workdir, min_peers=2))
    else:
        swarm.start(name, join_args(peers, index, workdir, role="stage", stage=stage, stage_timeout_s=10))


def checkpointed(workdir: Path, name: str) -> tuple[int, int]:
    """(round, certified round) in the peer's checkpoint."""
    state = read_checkpoint(workdir / f"r{PEERS[name][0]}.ckpt" / CHECKPOINT_NAME)
    return state["round"], state["certified"]


def restarted(workdir: Path, name: str, since: float) -> dict[int, dict[str, Any]]:
    """The peer's round records written after the restart, by round."""
    return {t: r for t, r in rounds_of(workdir, PEERS[name][0]).items() if r["ended_at"] > since}


def shard_fingerprints(record: dict[str, Any]) -> dict[str, str]:
    return {s: fp for s, fp in record["fingerprints"].items() if s.isdigit()}


def test_a_swarm_restarted_from_checkpoints_of_different_rounds_agrees_again_within_two_rounds(
    tmp_path: Path,
) -> None:
    with LabSwarm(tmp_path, 1000.0) as swarm:
        peers = swarm.start_bootstrap(run_args(ROUNDS, inner_steps=4, round_s=3))
        for name in PEERS:
            start(swarm, peers, tmp_path, name)
        wait_for_round(tmp_path, 0, STOP_FROM, timeout=240)
        for names, after in ((["r0"], None), (["s0", "s1"], "r1"), (["r1"], "r1")):
            if after is not None:  # a round later, by the last record of a peer still running
                index = PEERS[after][0]
                wait_for_round(tmp_path, index, max(rounds_of(tmp_path, index)) + 1, timeout=120)
            for name in names:
                assert swarm.stop(name) == 0, f"{name} did not stop cleanly"
        saved = {name: checkpointed(tmp_path, name) for name in PEERS}
        assert len({certified for _, certified in saved.values()}) > 1, f"the checkpoints do not differ: {saved}"
        restarted_at = time.time()
        for name in PEERS:
            start(swarm, peers, tmp_path, name)
        assert_all_exit_cleanly(swarm, list(PEERS), timeout=420)

    after = {name: restarted(tmp_path, name, restarted_at) for name in PEERS}
    failed = {name: [t for t, r in rounds.items() if r["caught_up"] == "failed"] for name, rounds in after.items()}
    assert not any(failed.values()), f"rounds that ended with nobody serving what was needed: {failed} ({saved})"
    trained = [t for rounds in after.values() for t, r in rounds.items() if r["inner_steps"] > 0]
    assert trained, f"nobody trained after the restart: {after}"
    first = min(trained)

    def agreed(t: int) -> bool:
        """Every peer applied round t from a certified set, and each shard has one fingerprint."""
        records = [rounds.get(t) for rounds in after.values()]
        if any(r is None or r["uncertified"] or r["caught_up"] in ("void", "failed") for r in records):
            return False
        by_shard: dict[str, set[str]] = {}
        for record in records:
            for shard, fp in shard_fingerprints(record).items():
                by_shard.setdefault(shard, set()).add(fp)
        return all(len(fps) == 1 for fps in by_shard.values())

    together = [t for t in range(first, ROUNDS) if agreed(t)]
    summary = {name: {t: (r["caught_up"], r["contributed"]) for t, r in rs.items()} for name, rs in after.items()}
    assert together, f"the restarted swarm never agreed on a round again (checkpoints {saved}): {summary}"
    assert together[0] <= first + WITHIN_ROUNDS, f"agreed first in round {together[0]}, trained from {first}: {summary}"
    assert together[-1] == ROUNDS - 1 and agreed(ROUNDS - 1)
