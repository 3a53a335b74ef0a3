"""Multi-peer tests: a bootstrap and full replicas as separate `hetero-node` processes on 127.0.0.1.

Every peer runs the real CLI (`hetero-node join`), hivemind DHT, matchmaking and libp2p streams; nothing is
mocked. The `tiny` preset with short rounds keeps each scenario under a minute or two on 2 cores.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import assert_all_exit_cleanly, eval_losses, join_args, rounds_of, start_replicas, wait_for_round

from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.plan import sizing_run
from hetero_node.client.config import OptimConfig, RunOptions
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(420)]

FAULTY_PEER = [sys.executable, str(Path(__file__).parent / "peers" / "faulty_peer.py")]


def test_three_replicas_agree_learn_and_stay_sparse(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        start_replicas(swarm, 3, tmp_path, rounds=3)
        assert_all_exit_cleanly(swarm, [f"r{i}" for i in range(3)])
    replicas = [rounds_of(tmp_path, i) for i in range(3)]
    for t in range(3):
        records = [r[t] for r in replicas]
        assert len({json.dumps(r["fingerprints"], sort_keys=True) for r in records}) == 1, f"round {t} disagrees"
        for r in records:
            assert not r["dropped"]
            if r["contributed"]:  # a replica that missed the round (slow start) rebuilt it from the messages
                assert 0 < r["bytes_received"] <= r["dense_allreduce_bytes"] / 20
                phases = r["phases_s"]  # where the round's time went: each phase timed, none negative
                assert set(phases) == {"encode", "agree", "fetch", "outer", "apply", "eval", "checkpoint"}, phases
                assert all(seconds >= 0 for seconds in phases.values()) and phases["outer"] > 0
    # a round's dense all-reduce in the largest group (0 in a record of a round its replica rebuilt alone)
    dense = max(record["dense_allreduce_bytes"] for r in replicas for record in r.values())
    for r in replicas:  # others fetch our messages at their pace, so a round's record may show one late
        sent = sum(record["bytes_sent"] for record in r.values())
        assert 0 < sent <= 3 * dense / 20
    assert any(r[t]["contributors"] == 3 for r in replicas for t in r), "the three never averaged together"
    evals = eval_losses(replicas, range(3))
    assert evals[2] < evals[0] < 5.6  # ln(256) ≈ 5.55 at init


def test_four_replicas_aggregate_three_messages_a_round_through_relay_trees_past_a_lying_relay(
    tmp_path: Path,
) -> None:
    """--max-contributors 3: each shard's round aggregates 3 of the 4 messages, the fourth stays owed; members fetch
    messages from relay parents, and r3, which re-serves others' messages corrupted, is caught by the digest and
    bypassed; nobody downloads more than 3 messages' worth in a round it got from its group."""
    with LocalSwarm(tmp_path) as swarm:
        peers = start_replicas(swarm, 3, tmp_path, rounds=4, run_extra={"max_contributors": 3}, min_peers=4)
        swarm.start("r3", join_args(peers, 3, tmp_path, min_peers=4), program=[*FAULTY_PEER, "bad-relay"])
        assert_all_exit_cleanly(swarm, [f"r{i}" for i in range(4)])
    assert "robust aggregation" in swarm.log_path("bootstrap").read_text()  # a public swarm's default rule
    replicas = [rounds_of(tmp_path, i) for i in range(4)]
    run = sizing_run(RunOptions(preset="tiny", batch_size=8, seq_len=64), OuterConfig(stages=2), OptimConfig(),
                     SparseLoCoConfig(), PipelineConfig())  # fmt: skip
    message = RunShape.from_run(run).message_bytes
    for t in range(4):
        records = [r[t] for r in replicas]
        assert len({json.dumps(r["fingerprints"], sort_keys=True) for r in records}) == 1, f"round {t} disagrees"
        for r in records:
            assert r["contributors"] <= 3 and not r["dropped"]
            if not r["caught_up"]:
                assert r["bytes_received"] <= 3 * message
            assert not (r["deferred"] and (r["contributed"] or r["resynced"]))
    grouped = [rec for r in replicas for rec in r.values() if rec["group_size"] == 4]
    assert grouped, "the four never formed one group"
    assert any(rec["deferred"] for rec in grouped) and any(rec["contributed"] for rec in grouped)
    assert any(rec["messages_relayed"] > 0 for rec in grouped), "no message went through a relay parent"
    assert any(rec["messages_prefetched"] > 0 for rec in grouped), "no message was fetched while the round sealed"
    caught = [  # per honest replica, the rounds in which it caught r3 lying (both shards may fetch at once)
        set(re.findall(r"round (\d+): relay \S+ served bytes that do not match", (tmp_path / f"r{i}.log").read_text()))
        for i in range(3)
    ]
    assert any(caught), "nobody fetched from the lying relay"
    assert all(len(rounds) <= 1 for rounds in caught), f"the lying relay was asked again after being caught: {caught}"
    evals = eval_losses(replicas, range(4))
    assert evals[3] < evals[0] < 5.6


# long: `make test` keeps a keyless peer out of a private swarm (test_trust.py) and tests the robust rule's
# arithmetic (test_aggregation.py)
@pytest.mark.long
def test_a_private_swarm_with_robust_aggregation_trains_and_agrees_and_refuses_a_keyless_joiner(
    tmp_path: Path,
) -> None:
    key = tmp_path / "swarm.key"
    subprocess.run([sys.executable, "-m", "hetero_node.client.cli", "swarm-key", str(key)], check=True)
    with LocalSwarm(tmp_path) as swarm:
        run_extra = {"swarm_key": key, "aggregation": "robust"}
        peers = start_replicas(swarm, 2, tmp_path, rounds=2, run_extra=run_extra, swarm_key=key)
        swarm.start("outsider", join_args(peers, 2, tmp_path))
        assert swarm.wait("outsider", 120) == 1
        assert "this swarm is private: pass --swarm-key" in swarm.log_path("outsider").read_text()
        assert_all_exit_cleanly(swarm, ["r0", "r1"])
    replicas = [rounds_of(tmp_path, i) for i in range(2)]
    for t in range(2):
        assert replicas[0][t]["fingerprints"] == replicas[1][t]["fingerprints"], f"round {t} disagrees"
    assert any(r[t]["contributors"] == 2 for r in replicas for t in r), "the two never averaged together"


# long: `make test` joins late over a real network instead (test_real_network.py)
@pytest.mark.long
@pytest.mark.parametrize("admission", ["none", "loss"])  # loss: it rebuilds rounds from the admitted sets
def test_late_joiner_catches_up(tmp_path: Path, admission: str) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = start_replicas(swarm, 2, tmp_path, rounds=10, run_extra={"round_s": 2, "admission": admission})
        wait_for_round(tmp_path, 0, 0)
        swarm.start("r2", join_args(peers, 2, tmp_path))
        assert_all_exit_cleanly(swarm, ["r0", "r1", "r2"])
    late, early = rounds_of(tmp_path, 2), rounds_of(tmp_path, 0)
    trained = sorted(t for t, r in late.items() if r["inner_steps"] > 0)
    assert trained[0] >= 1, "the late replica should train from the swarm's round, not from 0"
    assert all(late[t]["caught_up"] in ("messages", "state") for t in late if t < trained[0]), "how did it catch up?"
    for t in trained[1:]:  # its first round may be one it joined halfway through: then it catches up again
        assert late[t]["fingerprints"] == early[t]["fingerprints"], f"late joiner disagrees after round {t}"
    assert max(r["contributors"] for r in early.values()) == 3, "the late joiner never contributed"


def run_pair(workdir: Path, faulty_modes: list[str]) -> dict[int, dict[str, Any]]:
    """Two honest replicas plus one faulty peer per mode; returns honest replica 0's rounds."""
    with LocalSwarm(workdir) as swarm:
        everyone = 2 + len(faulty_modes)
        fixed_steps = {"min_inner_steps": 8, "max_inner_steps": 8}  # bit-identical runs need the same steps
        peers = start_replicas(swarm, 2, workdir, rounds=3, run_extra=fixed_steps, min_peers=everyone)
        for j, mode in enumerate(faulty_modes):
            args = join_args(peers, 2 + j, workdir, min_peers=everyone)
            swarm.start(f"faulty{j}", [mode, *args], program=FAULTY_PEER)
        assert_all_exit_cleanly(swarm, ["r0", "r1"])
    return rounds_of(workdir, 0)


def test_garbage_and_nan_payloads_are_dropped_and_change_nothing(tmp_path: Path) -> None:
    attacked = run_pair(tmp_path / "attacked", ["garbage", "nan"])
    clean = run_pair(tmp_path / "clean", [])
    assert max(r["group_size"] for r in attacked.values()) == 4, "the faulty peers never made it into a group"
    for t, record in attacked.items():
        faulty_in_group = record["group_size"] - 2
        assert record["contributors"] == 2
        # each faulty member is dropped in every shard group it was in: `group_size` is the larger shard group's,
        # and a faulty member may have reached only one of the two
        assert faulty_in_group <= len(record["dropped"]) <= 2 * faulty_in_group, record["dropped"]
        # the honest pair's result is bit-identical to a run in which the faulty peers never existed
        assert record["fingerprints"] == clean[t]["fingerprints"], f"round {t} was changed by the faulty peers"


# long: `make test` restarts a peer over a real network (test_real_network.py); checkpoints' refusals are unit tests
@pytest.mark.long
def test_a_killed_replica_does_not_stop_the_others_and_a_corrupt_checkpoint_falls_back_to_the_swarm(
    tmp_path: Path,
) -> None:
    with LocalSwarm(tmp_path) as swarm:
        # 10 rounds of 2 s: r1's restart (imports, p2pd, measuring itself: 15-20 s on 2 busy cores) must end
        # before the survivor's run does (with 7 it made the last round by 1 s, or missed it)
        peers = start_replicas(swarm, 3, tmp_path, rounds=10, run_extra={"round_s": 2})
        wait_for_round(tmp_path, 2, 1)
        swarm.stop("r2", sig=signal.SIGKILL)  # mid-round, and never back
        wait_for_round(tmp_path, 1, 2)
        swarm.stop("r1")
        checkpoint = tmp_path / "r1.ckpt" / CHECKPOINT_NAME
        damaged = bytearray(checkpoint.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte inside the weights
        checkpoint.write_bytes(bytes(damaged))
        before = set(rounds_of(tmp_path, 1))
        swarm.start("r1", join_args(peers, 1, tmp_path))
        assert_all_exit_cleanly(swarm, ["r0", "r1"])
    log = (tmp_path / "r1.log").read_text()
    assert f"checkpoint {checkpoint} is corrupt" in log and "loaded the swarm's state" in log
    resumed = sorted(set(rounds_of(tmp_path, 1)) - before)
    assert resumed and resumed[0] >= 2, "it must continue from the swarm's round, not train from scratch"
    r0, r1 = rounds_of(tmp_path, 0), rounds_of(tmp_path, 1)
    assert set(r0) == set(range(10)), "the survivor stopped"
    assert r0[9]["group_size"] == 2, "the dead replica should be gone from the last round's group"
    assert r0[9]["fingerprints"] == r1[9]["fingerprints"]


def test_diloco_baseline_runs_on_the_same_machinery(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        start_replicas(swarm, 2, tmp_path, rounds=2, run_extra={"outer": "diloco", "diloco_wire": "fp16"})
        assert_all_exit_cleanly(swarm, ["r0", "r1"])
    r0, r1 = rounds_of(tmp_path, 0), rounds_of(tmp_path, 1)
    n_params = read_metrics(tmp_path / "r0.jsonl")[0]["n_params"]
    for t in (0, 1):
        assert r0[t]["fingerprints"] == r1[t]["fingerprints"], f"DiLoCo replicas disagree after round {t}"
        assert r0[t]["group_size"] == r0[t]["contributors"] == 2
        # the other replica's dense fp16 message: 2 bytes per parameter plus a 10-byte header per shard
        assert r0[t]["bytes_received"] == 2 * n_params + 2 * 10
    evals = eval_losses([r0, r1], range(2))
    assert evals[1] < evals[0]
