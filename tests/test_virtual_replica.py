"""Multi-peer tests of virtual replicas: two stage peers form a pipelined replica next to a full replica.

Every peer is a real `hetero-node join` process; stage peers exchange subspace-compressed boundary messages over
hivemind P2P and average their shard with the full replica, exactly as a volunteer's node would.
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import assert_all_exit_cleanly, ef_fingerprint, join_args, rounds_of, run_args, wait_for_round

from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, read_checkpoint
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.protocol.boundary_codec import BACKWARD, FORWARD, boundary_bytes_per_token

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(480)]

FULL, STAGE0, STAGE1 = 0, 10, 11
"""Metrics indices: the full replica r0, the virtual replica's stages r10 and r11 (a replacement: r21)."""


def stage_args(peers: str, index: int, workdir: Path, stage: int, **extra: Any) -> list[str]:
    return join_args(peers, index, workdir, role="stage", stage=stage, stage_timeout_s=10, **extra)


def start_swarm(swarm: LocalSwarm, workdir: Path, rounds: int, inner_steps: int, matchmaking_s: float = 3) -> str:
    """A full replica r0 and a virtual replica (s0, s1); 3 s rounds, so the slower pipeline trains a few steps
    each round (with H steps at the full replica's speed, tiny's rounds would last well under a second)."""
    peers = swarm.start_bootstrap(run_args(rounds, inner_steps, round_s=3))
    swarm.start("r0", join_args(peers, FULL, workdir, min_peers=2, matchmaking_s=matchmaking_s))
    swarm.start("s0", stage_args(peers, STAGE0, workdir, 0))
    swarm.start("s1", stage_args(peers, STAGE1, workdir, 1))
    return peers


def assert_shards_agree(full: dict[str, Any], stage0: dict[str, Any], stage1: dict[str, Any], round_: int) -> None:
    """Shards and both tables agree; stage 1 advertises E_S only while it holds a current copy (not in the round
    it loaded a state or resumed a checkpoint)."""
    fps = full["fingerprints"]
    tables = {"fixed": fps["fixed"], "embed": fps["embed"]}
    assert stage0["fingerprints"] == {"0": fps["0"], **tables}, f"shard 0 disagrees after {round_}"
    assert stage1["fingerprints"] in ({"1": fps["1"], **tables}, {"1": fps["1"], "fixed": fps["fixed"]}), (
        f"shard 1 disagrees after {round_}"
    )


def test_full_and_virtual_replica_agree_learn_and_send_the_codecs_bytes(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        start_swarm(swarm, tmp_path, rounds=3, inner_steps=6)
        assert_all_exit_cleanly(swarm, ["r0", "s0", "s1"])
    full, s0, s1 = (rounds_of(tmp_path, i) for i in (FULL, STAGE0, STAGE1))
    assert set(full) == set(s0) == set(s1) == {0, 1, 2}
    dense_table = 256 * 128 * 4  # tiny's vocab × d_model, fp32
    for t in range(3):
        assert_shards_agree(full[t], s0[t], s1[t], t)
        assert full[t]["group_size"] == s0[t]["group_size"] == s1[t]["group_size"] == 2, "the VR counts as one"
        assert not s0[t]["resynced"] and not s1[t]["resynced"]
        # stage 1 followed T_fixed from the entries of E_S each step changed, never fetching the table
        assert s1[t]["fingerprints"]["embed"] == full[t]["fingerprints"]["embed"]
        assert 0 < s1[t]["table_bytes_received"] < dense_table / 8, f"round {t}: {s1[t]['table_bytes_received']}"
    # the loss of a round's own batches is noise-sized at this length; the held-out eval is the learning signal
    assert all(math.isfinite(s1[t]["train_loss"]) for t in range(3)), "the last stage computes the loss"
    assert s0[0]["train_loss"] is None, "stage 0 has no loss; the last stage computes it"
    assert s1[2]["eval_loss"] < s1[0]["eval_loss"], "the virtual replica's eval should go down"

    run = read_metrics(tmp_path / f"r{STAGE0}.jsonl")[0]["run"]
    rank = 128 // 8  # tiny's d_model / 8, the default
    formula = {d: boundary_bytes_per_token(rank, "bf16", d, id_bytes=2) for d in (FORWARD, BACKWARD)}
    assert formula == {FORWARD: 34, BACKWARD: 32}  # k bf16 values, plus a u16 token id going forward
    for t in range(3):
        tokens = s0[t]["inner_steps"] * run["batch_size"] * run["seq_len"]  # time-boxed: steps vary by round
        assert s0[t]["tokens"] == s1[t]["tokens"] == tokens > 0
        assert s0[t]["boundary_tokens"] == s1[t]["boundary_tokens"] == tokens
        forward = s0[t]["boundary_bytes_sent"] / tokens
        backward = s1[t]["boundary_bytes_sent"] / tokens
        # measured on the stream (headers and protobuf framing included) within 5% of the codec's formula
        assert forward == pytest.approx(formula[FORWARD], rel=0.05)
        assert backward == pytest.approx(formula[BACKWARD], rel=0.05)
        assert s1[t]["boundary_bytes_received"] == s0[t]["boundary_bytes_sent"]
        assert s0[t]["boundary_bytes_received"] == s1[t]["boundary_bytes_sent"]


# long: a stage's resume; `make test` resumes a full replica from its checkpoint (test_real_network.py)
@pytest.mark.long
def test_a_stopped_stage_resumes_its_shard_and_error_feedback_from_its_checkpoint(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = start_swarm(swarm, tmp_path, rounds=200, inner_steps=6)
        wait_for_round(tmp_path, STAGE1, 1)
        assert swarm.stop("s1", timeout=30) == 0, "SIGTERM should end a stage peer cleanly"
        saved = read_checkpoint(tmp_path / f"r{STAGE1}.ckpt" / CHECKPOINT_NAME)
        saved_ef = ef_fingerprint(tmp_path / f"r{STAGE1}.ckpt")
        before = set(rounds_of(tmp_path, STAGE1))
        swarm.start("s1", stage_args(peers, STAGE1, tmp_path, 1))
        deadline = time.monotonic() + 240
        while not resumed_rounds(tmp_path, before) and time.monotonic() < deadline:
            time.sleep(1)
        for name in ("r0", "s0", "s1"):
            assert swarm.stop(name, timeout=30) == 0, f"{name} did not exit cleanly on SIGTERM"
    full_saved = read_checkpoint(tmp_path / f"r{FULL}.ckpt" / CHECKPOINT_NAME)
    assert saved["slot"] == [0, 1] and saved["round"] >= 1  # (virtual replica, stage)
    assert len(saved["syncs"]) == 1 and 0 < len(saved["model"]) < len(full_saved["model"]), "its shard, not the model"
    assert tuple(saved["embed"].shape) == (256, 128), "stage 1 keeps its copy of E_S (for T_fixed's upkeep)"
    log = (tmp_path / "s1.log").read_text()
    assert f"resumed from checkpoint at round {saved['round']} (error feedback {saved_ef})" in log
    together = resumed_rounds(tmp_path, before)
    assert together, f"the resumed stage did not contribute again:\n{round_table(tmp_path)}"
    full, s0, s1 = (rounds_of(tmp_path, i) for i in (FULL, STAGE0, STAGE1))
    for t in together:
        assert_shards_agree(full[t], s0[t], s1[t], t)


# long: about 60 s; `make test` loads states through the same per-shard path (test_real_network.py's late joiner)
@pytest.mark.long
def test_a_full_replica_where_only_the_virtual_replica_went_on_loads_each_shard_from_its_stage(tmp_path: Path) -> None:
    """The restart deadlock of issue 31: a full replica coming back to a swarm whose only other holders are stage
    peers once waited forever for a full replica to serve it the whole model. Each shard now comes from its holders."""
    with LocalSwarm(tmp_path) as swarm:
        peers = start_swarm(swarm, tmp_path, rounds=200, inner_steps=6)
        wait_for_round(tmp_path, FULL, 1)
        assert swarm.stop("r0", timeout=30) == 0
        shutil.rmtree(tmp_path / f"r{FULL}.ckpt")  # it comes back with nothing: the stages hold the current round
        before = set(rounds_of(tmp_path, FULL))
        wait_for_round(tmp_path, STAGE1, max(before) + 3)
        swarm.start("r0", join_args(peers, FULL, tmp_path, min_peers=2))
        deadline = time.monotonic() + 240
        while len(resumed_rounds(tmp_path, before)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        for name in ("r0", "s0", "s1"):
            assert swarm.stop(name, timeout=30) == 0, f"{name} did not exit cleanly on SIGTERM"
    log = (tmp_path / "r0.log").read_text()
    donors = [re.findall(rf"loaded the swarm's state of shard {shard}, round \d+, from (\w+)", log) for shard in (0, 1)]
    assert all(donors), f"it did not load both shards:\n{log[-3000:]}"
    assert donors[0][0] != donors[1][0], "each shard from its own stage peer (no full replica was there to serve both)"
    together = resumed_rounds(tmp_path, before)
    assert len(together) >= 2, f"the full replica did not contribute again:\n{round_table(tmp_path)}"
    full, s0, s1 = (rounds_of(tmp_path, i) for i in (FULL, STAGE0, STAGE1))
    for t in together:
        assert_shards_agree(full[t], s0[t], s1[t], t)


def resumed_rounds(workdir: Path, before: set[int]) -> list[int]:
    """Rounds after the restart in which both stages contributed and the full replica used the VR's message."""
    full, s0, s1 = (rounds_of(workdir, i) for i in (FULL, STAGE0, STAGE1))
    return [
        t for t in s1
        if t not in before and t in s0 and t in full and s1[t]["contributed"] and s0[t]["contributed"]
        and full[t]["contributors"] == 2
    ]  # fmt: skip


def repaired_rounds(workdir: Path) -> list[int]:
    """Rounds the replacement and stage 0 completed together, and whose VR contribution the full replica used."""
    full, s0, replacement = (rounds_of(workdir, i) for i in (FULL, STAGE0, 21))
    return [
        t for t in replacement
        if t in s0 and t in full and not replacement[t]["resynced"] and not s0[t]["resynced"]
        and full[t]["contributors"] == 2
    ]  # fmt: skip


def round_table(workdir: Path) -> str:
    """Who did what in each round (for a failure message: CI keeps no peer logs)."""
    lines = []
    for index in (FULL, STAGE0, STAGE1, 21):
        for t, r in sorted(rounds_of(workdir, index).items()):
            lines.append(
                f"r{index} round {t}: group {r['group_size']} contributors {r['contributors']} resynced {r['resynced']}"
            )
    return "\n".join(lines)


@pytest.mark.long
def test_killed_stage_is_replaced_and_the_virtual_replica_contributes_again(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        # a full replica finishes a round seconds before the pipeline on a loaded 2-core CI machine: its groups
        # wait longer for the repaired VR, so the test checks repair, not which process the shared CPU favoured
        peers = start_swarm(swarm, tmp_path, rounds=200, inner_steps=6, matchmaking_s=12)
        wait_for_round(tmp_path, STAGE1, 0)
        swarm.stop("s1", sig=signal.SIGKILL)
        killed_after = max(rounds_of(tmp_path, STAGE1))
        wait_for_round(tmp_path, FULL, killed_after + 2)  # the full replica goes on without the pipeline
        time.sleep(10)  # the dead holder's record expires (3 × --record-refresh-s 3): its slot is free
        swarm.start("s1b", stage_args(peers, 21, tmp_path, 1))
        deadline = time.monotonic() + 240
        while len(repaired_rounds(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        # the run is 200 rounds long: stop it here, SIGTERM to each peer's whole process group (p2pd included)
        for name in ("r0", "s0", "s1b"):
            stopped = time.monotonic()
            code = swarm.stop(name, timeout=30)
            assert code == 0 and time.monotonic() - stopped < 30, f"{name} exited with {code} on SIGTERM"
    together = repaired_rounds(tmp_path)
    assert len(together) >= 2, f"the repaired virtual replica did not contribute again:\n{round_table(tmp_path)}"
    # the kill lands mid-round (stage 0 gives the round up) or between rounds (stage 0 waits for the slot)
    assert "this virtual replica does not contribute" in (tmp_path / "s0.log").read_text()
    assert "differs from the group's" not in (tmp_path / "r0.log").read_text(), "the repaired VR started off-state"
    assert "loaded the swarm's state" in (tmp_path / "s1b.log").read_text()
    full, s0, replacement = (rounds_of(tmp_path, i) for i in (FULL, STAGE0, 21))
    for t in together:
        assert_shards_agree(full[t], s0[t], replacement[t], t)
