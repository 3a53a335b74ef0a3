"""Loss-scored admission (`--admission loss`): the rule, the tally of the judges' verdicts, the run's probe shard, and
over real peers a round whose judges leave a step that raises the loss out, every member applying the same set."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from factories import run_config
from shard_rounds import SHAPES, contribute

from hetero_node.bench.poison import swarm
from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.shard_sync import Drops, Member, PendingRound, Received, ShardSync
from hetero_node.client.roles.loss_judge import LossJudge
from hetero_node.models.data import ShardBatches, TokenStore, data_shard, probe_batches
from hetero_node.models.replica_model import full_model
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.admission import admitted, loss_admitted, probe_draw
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.roster import Entry, Seal
from hetero_node.protocol.round_wire import GroupMeta
from hetero_node.protocol.run_config import OuterConfig

FP = "ab" * 16
OTHER_FP = "cd" * 16


def test_a_step_is_admitted_only_if_it_lowers_the_probe_loss_by_a_share_of_the_median_drop() -> None:
    drops = {"a": 0.10, "b": 0.08, "c": 0.03, "negates": -0.2, "dilutes": 1e-6, "nan": float("nan")}
    assert loss_admitted(drops) == {"a", "b", "c"}  # floor: 0.25 × the median of the finite drops (0.03)
    assert loss_admitted({"a": -0.1, "b": -0.2}) == set()  # a floor below 0 admits no step that raises the loss
    assert loss_admitted({"a": float("inf"), "b": float("nan")}) == set()
    assert loss_admitted({}) == set()


def _verdict(judge: str, *admits: Entry, start_fp: str = FP) -> Seal:
    return Seal(judge, 3, start_fp, tuple(sorted(admits)), "")


def test_verdicts_decide_each_entry_by_more_than_half_of_the_voters_or_not_yet() -> None:
    a, b, c = (Entry(name, 10, "00" * 16, 64) for name in "abc")
    voters = frozenset({"v1", "v2", "v3", "v4"})
    v1, v2 = _verdict("v1", a, b), _verdict("v2", a)
    assert admitted([v1], FP, voters, [a, b, c]) is None  # 1 yes + 3 unheard: each could still be in
    assert admitted([v1, v2], FP, voters, [a, b, c]) is None  # a: 2 of 4 is not yet more than half
    # a: 3 of 4; b and c: 1 yes + 1 unheard can no longer be more than half
    assert admitted([v1, v2, _verdict("v3", a, c)], FP, voters, [a, b, c]) == {a}
    late = [v1, _verdict("v3", a, b), _verdict("v4", b)]
    assert admitted(late, FP, voters, [a, b]) is None  # a: 2 yes + v2 unheard
    assert admitted([*late, v2], FP, voters, [a, b]) == {a, b}  # whatever order the verdicts came in


def test_verdicts_from_outsiders_or_another_start_admit_nothing() -> None:
    a = Entry("a", 10, "00" * 16, 64)
    voters = frozenset({"v1", "v2", "v3"})
    outsiders = [_verdict(f"sybil{i}", a) for i in range(10)]
    assert admitted([_verdict("v1"), _verdict("v2"), *outsiders], FP, voters, [a]) == frozenset()
    other_start = [_verdict("v1", a, start_fp=OTHER_FP), _verdict("v2", a, start_fp=OTHER_FP), _verdict("v3", a)]
    assert admitted(other_start, FP, voters, [a]) == frozenset()  # 1 of 3: out
    assert admitted([], FP, voters, []) == frozenset()  # nothing selected: nothing to wait for


def test_loss_admission_keeps_the_last_data_shard_for_probing_and_needs_a_sparse_method() -> None:
    run = run_config(outer=OuterConfig(admission="loss"))
    assert run.training_shards == run.data_shards - 1 and run_config().training_shards == run.data_shards
    with pytest.raises(ConfigError, match="sparse"):
        OuterConfig(outer="diloco", admission="loss")
    with pytest.raises(ConfigError, match="admission must be one of"):
        OuterConfig(admission="vibes")
    with pytest.raises(ConfigError, match="data-shards"):
        run_config(outer=OuterConfig(admission="loss"), data_shards=1)
    assert run.run_id != run_config().run_id  # peers that disagree on it never share a round


def test_the_probe_draw_is_the_same_for_every_judge_and_unknown_until_every_message_is_committed() -> None:
    a, b = Entry("a", 10, "01" * 16, 64), Entry("b", 10, "02" * 16, 64)
    assert probe_draw([a, b]) == probe_draw([b, a]) >= 0
    assert probe_draw([a, b]) != probe_draw([a, Entry("b", 10, "03" * 16, 64)])  # another message: other batches


def test_probe_batches_come_from_the_shard_no_replica_trains_on_and_are_the_same_for_every_judge() -> None:
    store = TokenStore(np.arange(160_000) % 256, np.arange(5_000) % 256, 256, "test")
    run = run_config(outer=OuterConfig(admission="loss"))
    lo, hi = data_shard(store, run.data_shards - 1, run.data_shards)
    probe = probe_batches(store, run.data_shards, run.batch_size, run.seq_len, run.seed, 5, 4)
    again = probe_batches(store, run.data_shards, run.batch_size, run.seq_len, run.seed, 5, 4)
    assert len(probe) == 4 and all(torch.equal(x, y) for (x, _), (y, _) in zip(probe, again, strict=True))
    assert not torch.equal(probe[0][0], probe_batches(store, 16, 8, 64, 0, 6, 4)[0][0])  # another draw
    trained = {replica % run.training_shards for replica in range(64)}
    assert run.data_shards - 1 not in trained
    shard = ShardBatches(store, 0, run.data_shards, run.batch_size, run.seq_len, run.seed)
    assert shard.end <= lo < hi  # the probe windows lie past every trained shard


def test_a_full_replicas_judge_scores_a_trained_step_above_its_negation_and_leaves_the_model_alone() -> None:
    run = run_config(outer=OuterConfig(admission="loss"), batch_size=4, seq_len=32)
    store = TokenStore(np.arange(160_000) % 256, np.arange(5_000) % 256, 256, "test")
    model, _ = full_model(run, torch.device("cpu"))
    names = shard_parameter_names(model.cfg, run.outer.stages)
    start = {s: [p.detach().clone() for p in shard_tensors(model, n)] for s, n in enumerate(names)}
    judge = LossJudge(model, names, store, run)

    trained = copy.deepcopy(model)
    trainer = InnerTrainer(trained, run.optim, 100, torch.device("cpu"))
    batches = ShardBatches(store, 0, run.data_shards, run.batch_size, run.seq_len, run.seed)
    for step in range(20):
        trainer.train_step(*batches.batch(step))
    moved = [p.detach() for p in shard_tensors(trained, names[1])]
    negated = [2 * s - m for s, m in zip(start[1], moved, strict=True)]
    drops = judge.for_shard(1, lambda: start)(0, start[1], iter([("trained", moved), ("negated", negated)]))
    assert drops["trained"] > 0 > drops["negated"]
    assert loss_admitted(drops) == {"trained"}
    assert all(torch.equal(p, s) for p, s in zip(shard_tensors(model, names[1]), start[1], strict=True))


def _quadratic_judge(target: list[torch.Tensor]) -> Drops:
    """A real loss (squared distance to `target`) on the candidates' real θ(t+1): what a full replica's judge does
    with its model and probe batches, at the size of a test."""

    def loss(tensors: list[torch.Tensor]) -> float:
        return sum(float(((t - g) ** 2).sum()) for t, g in zip(tensors, target, strict=True))

    return lambda draw, start, candidates: {a: loss(start) - loss(new) for a, new in candidates}


def _failing(draw: int, start: list[torch.Tensor], candidates: object) -> dict[str, float]:
    raise torch.OutOfMemoryError("CUDA out of memory (the judge's copy did not fit)")


def _towards(start: list[torch.Tensor], target: list[torch.Tensor], share: float, seed: int) -> list[torch.Tensor]:
    """Δ = θ(t) − θ_local of a replica that moved `share` of the way to `target` (negative: away), with noise."""
    gen = torch.Generator().manual_seed(seed)
    return [share * (s - g) + 1e-3 * torch.randn(s.shape, generator=gen) for s, g in zip(start, target, strict=True)]


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_the_judges_leave_a_step_that_raises_the_loss_out_and_every_member_applies_the_same_set() -> None:
    with swarm(4) as runtimes:
        stop = threading.Event()
        run = run_config(outer=OuterConfig(admission="loss"))
        timeouts = SyncTimeouts(matchmaking_s=5.0, fetch_timeout_s=5.0)
        syncs = [ShardSync(r, run, 0, SHAPES, timeouts, stop) for r in runtimes]
        start = [torch.full(s, 0.25) for s in SHAPES]
        target = [torch.zeros(s) for s in SHAPES]
        judge = _quadratic_judge(target)
        for sync in syncs[:3]:  # the fourth judges nothing (a pipeline stage holds some layers only)
            sync.loss_judge = judge

        honest = [_towards(start, target, 0.5, seed=i) for i in range(4)]
        round0 = contribute(syncs, 0, start, seed=0, deltas=honest)
        assert [o.contributors for o in round0] == [4, 4, 4, 4]
        theta = round0[0].new_tensors
        assert theta is not None and len({fingerprint(o.new_tensors) for o in round0 if o.new_tensors}) == 1

        # round 1: member 2 negates the others' step at 6× their size, and its own judge admits everything
        syncs[2].loss_judge = lambda draw, start, candidates: {a: 1.0 for a, _ in candidates}
        syncs[3].loss_judge = _failing  # a judge that fails casts no verdict: the others still decide
        deltas = [_towards(theta, target, 0.5, seed=10 + i) for i in range(4)]
        deltas[2] = _towards(theta, target, -3.0, seed=12)
        round1 = contribute(syncs, 1, theta, seed=100, deltas=deltas)
        assert [o.contributors for o in round1] == [3, 3, 3, 3]
        assert [o.contributed for o in round1] == [True, True, False, True]
        assert [o.deferred for o in round1] == [False, False, True, False]  # a refused Δ stays owed, not lost
        assert all(any(syncs[2].me in reason for reason in o.dropped) for o in round1)
        assert len({fingerprint(o.new_tensors) for o in round1 if o.new_tensors is not None}) == 1
        new = round1[0].new_tensors
        assert new is not None and judge(1, theta, [("x", new)])["x"] > 0  # the honest step lowered the loss
        verdicts = syncs[0].roster(1).verdicts()
        assert verdicts is not None and set(verdicts) == {s.me for s in syncs[:3]}  # one each; none from the 4th

        # the same attack where the round admits by the rule alone (mean): it is counted, and raises the loss
        for sync in syncs:
            sync.admits_by_loss = False
        unjudged = contribute(syncs, 2, new, seed=200, deltas=[_towards(new, target, 0.5, 20 + i) for i in range(2)]
                              + [_towards(new, target, -3.0, 22), _towards(new, target, 0.5, 23)])  # fmt: skip
        assert [o.contributors for o in unjudged] == [4, 4, 4, 4]
        after = unjudged[0].new_tensors
        assert after is not None and judge(2, new, [("x", after)])["x"] < 0

        # too few judges to decide (one of four): nobody applies a set of its own, so no member forks
        for sync in syncs:
            sync.admits_by_loss = True
            sync.loss_judge = None
        syncs[0].loss_judge = judge
        steps = [_towards(after, target, 0.5, 30 + i) for i in range(4)]
        undecided = contribute(syncs, 3, after, seed=300, deltas=steps)
        assert all(o.new_tensors is None for o in undecided)


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_restarted_judge_keeps_the_verdict_it_cast_before_the_restart() -> None:
    with swarm(1) as runtimes:
        run = run_config(outer=OuterConfig(admission="loss"))
        sync = ShardSync(runtimes[0], run, 0, SHAPES, SyncTimeouts(matchmaking_s=3.0), threading.Event())
        sync.loss_judge = lambda draw, start, candidates: {a: 1.0 for a, _ in candidates}  # admits everyone
        start = [torch.full(s, 0.25) for s in SHAPES]
        payload = sync.method.encode([1e-2 * torch.ones(s) for s in SHAPES]).payload
        message = sync.method.decode(payload)
        metas = {a: GroupMeta(3, FP, len(payload), d * 16, 64, "") for a, d in (("alice", "aa"), ("bob", "bb"))}
        members = [Member(a, None, meta) for a, meta in metas.items()]

        def admit(round_: int) -> list[str]:
            pending = PendingRound(round_, start, GroupMeta(round_, FP, 0, "", 0, ""), None, roster=sync.roster(round_))
            received = [Received(a, message, 64, meta.digest) for a, meta in metas.items()]
            return [r.name for r in sync._admit(pending, received, members, frozenset({sync.me}), [])]

        assert admit(3) == ["alice", "bob"]  # a judge that never restarted judges
        alice = Entry("alice", len(payload), "aa" * 16, 64)
        sync.roster(4).judge(Seal(sync.me, 4, FP, (alice,), ""))  # its vote of round 4, cast before a restart
        while not (sync.roster(4).verdicts() or {}):
            time.sleep(0.1)
        sync.resumed_at = 4
        assert admit(4) == ["alice"]  # the vote stands: judging again could count two verdicts of one member
        assert sync.roster(4).verdicts() == {sync.me: Seal(sync.me, 4, FP, (alice,), "")}
