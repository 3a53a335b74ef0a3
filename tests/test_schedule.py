"""Time-boxed rounds, in process: the round length, the deadline replicas agree on, and how many steps fit."""

from __future__ import annotations

import pytest
from factories import peer_id, peer_record

from hetero_node.client.roles.schedule import RoundClock
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE
from hetero_node.protocol.round_stretch import MAX_ACCUMULATION, MAX_STRETCH
from hetero_node.protocol.run_config import OuterConfig

ME = peer_id("me")


def clock(cadence: bool = False, **outer: object) -> RoundClock:
    return RoundClock(
        OuterConfig(inner_steps=10, **outer),
        matchmaking_s=2.0,
        straggler_fraction=0.5,
        cadence=cadence,
        full=True,
    )


def replica(name: str, round_: int = 4, train_round: int = 4, deadline: float = 0.0, step_s: float = 0.0):
    return peer_id(name), peer_record(
        name, role=ROLE_FULL, round=round_, train_round=train_round, deadline=deadline, step_s=step_s
    )


def test_a_round_lasts_h_steps_of_the_fastest_replica_or_round_s() -> None:
    records = dict([replica("fast", step_s=0.5), replica("slow", step_s=1.5)])
    assert clock().round_length(records) == pytest.approx(5.0)  # H = 10 steps of the fastest
    assert clock(round_s=7.0).round_length(records) == 7.0
    assert clock().round_length({}) is None  # nobody measured yet: an untimed round of H steps
    mine = clock()
    mine.record_speed(steps=4, seconds=1.0)
    assert mine.round_length(records) == pytest.approx(2.5)  # we are the fastest


def test_synchronous_rounds_have_no_deadline_so_a_late_replica_still_trains_its_steps() -> None:
    synchronous = clock(min_inner_steps=10, max_inner_steps=10)
    synchronous.record_speed(steps=10, seconds=10.0)
    records = dict([replica("early", deadline=1001.0, step_s=0.1)])  # another replica's deadline is long past
    plan = synchronous.plan(4, records, ME, now=1010.0)
    assert plan.deadline is None and not plan.sit_out and plan.min_steps == plan.max_steps == 10
    timed = clock(min_inner_steps=10, max_inner_steps=10, round_s=5.0).plan(4, records, ME, now=1000.0)
    assert timed.deadline == 1001.0  # --round-s asks for a time box even then


def test_replicas_adopt_the_earliest_deadline_announced_for_the_round() -> None:
    records = dict([replica("a", deadline=1005.0, step_s=0.5), replica("b", deadline=1003.0, step_s=0.5),
                    replica("c", round_=5, train_round=5, deadline=1010.0)])  # fmt: skip
    plan = clock().plan(4, records, ME, now=1000.0)
    assert plan.deadline == 1003.0 and plan.length_s == pytest.approx(5.0)  # c's round 5 implies 1005 for round 4
    assert clock().plan(4, {}, ME, now=1000.0).deadline is None
    earlier = {**records, **dict([replica("d", deadline=1001.5, step_s=0.5)])}
    assert clock().refresh(plan, earlier, ME).deadline == 1001.5


def test_overlapped_rounds_follow_a_fixed_cadence() -> None:
    records = dict([replica("a", train_round=-1, step_s=0.5)])
    steady = clock(cadence=True)
    first = steady.plan(4, records, ME, now=1000.0)
    second = steady.plan(5, records, ME, now=1006.0)  # started a second late: the cadence holds
    assert first.deadline == pytest.approx(1005.0) and second.deadline == pytest.approx(1010.0)
    plain = clock()
    plain.plan(4, records, ME, now=1000.0)
    assert plain.plan(5, records, ME, now=1006.0).deadline == pytest.approx(1011.0)  # start + L


def test_steps_fit_between_the_minimum_and_the_deadline() -> None:
    mine = clock(min_inner_steps=2, max_inner_steps=0)
    mine.record_speed(steps=1, seconds=1.0)
    records = dict([replica("a", deadline=1004.5, step_s=1.0)])
    plan = mine.plan(4, records, ME, now=1000.0)
    assert not plan.sit_out
    assert plan.keep_training(0, 1004.0, 1.0) and plan.keep_training(1, 1004.0, 1.0)  # the minimum, whatever the time
    assert plan.keep_training(2, 1003.0, 1.0) and not plan.keep_training(2, 1003.6, 1.0)
    capped = clock(min_inner_steps=3, max_inner_steps=3).plan(4, records, ME, now=1000.0)
    assert not capped.keep_training(3, 1000.0, 0.1)
    late = mine.plan(4, records, ME, now=1010.0)  # the minimum no longer fits before deadline + grace
    assert late.sit_out and late.grace_s == pytest.approx(max(2.0, 0.5 * late.length_s, 1.5))
    # a round whose members wait 20 s for every statement (no certificate came before it): 2 steps still fit
    assert not mine.plan(4, records, ME, now=1010.0, waited_s=20.0).sit_out
    assert mine.plan(4, records, ME, now=1023.0, waited_s=20.0).sit_out  # 1023 + 2 > 1004.5 + 20


def test_a_replica_whose_stores_take_long_stops_that_much_before_the_deadline_at_most_a_tenth_of_the_round() -> None:
    """A home volunteer 150 ms from the others took a second to store its statement, and every member waited for
    it at the round's ready barrier; it now stops training that much earlier, within a tenth of L."""
    mine = clock()
    mine.record_speed(steps=1, seconds=1.0)  # L = 10 steps of 1 s
    records = dict([replica("a", deadline=1010.0, step_s=1.0)])
    near, far = mine.plan(4, records, ME, now=1000.0), mine.plan(4, records, ME, now=1000.0, store_s=0.8)
    assert (near.lead_s, far.lead_s) == (0.0, 0.8) and near.deadline == far.deadline == 1010.0  # ours, not theirs
    assert near.keep_training(5, 1008.5, 1.0) and not far.keep_training(5, 1008.5, 1.0)  # 1009.5 > 1010 − 0.8
    assert mine.plan(4, records, ME, now=1000.0, store_s=30.0).lead_s == pytest.approx(1.0)  # a tenth of L


def test_the_grace_covers_the_slowest_replica_coming_to_the_round() -> None:
    records = dict([replica("a", step_s=0.5), replica("slow", step_s=4.0), replica("gone", train_round=-1, step_s=9.0)])
    plan = clock().plan(4, records, ME, now=1000.0)
    assert plan.grace_s == pytest.approx(6.0)  # 1.5 steps of "slow"; "gone" only receives and is not waited for


def test_a_replica_behind_learns_its_round_is_over_from_replicas_training_a_later_one() -> None:
    mine = clock()
    mine.record_speed(steps=1, seconds=0.5)
    records = dict([replica("a", round_=5, train_round=6, deadline=1003.0, step_s=0.5)])  # L = 5 s
    plan = mine.plan(4, records, ME, now=1000.0)
    assert plan.deadline == pytest.approx(993.0)  # round 4 ended two round lengths before round 6's deadline
    assert plan.sit_out  # 1 step of 0.5 s no longer fits before 993 + the grace


def test_a_round_is_stretched_until_training_fills_the_target_share_next_to_the_swarms_overhead() -> None:
    """On a GPU H steps take a fraction of a second and the exchange seconds: L grows to O·u/(1 − u − 1/(2H)) for
    the upper median overhead O (the half step a replica idles before the deadline counted), so neither one slow link
    nor one lying record among three sets everyone's round."""
    fast = [replica(name, step_s=0.2) for name in ("a", "b", "c")]  # H = 10 steps: 2 s
    overheads = (1.0, 2.0, 500.0)
    records = {pid: record.copy(update={"overhead_s": o}) for (pid, record), o in zip(fast, overheads, strict=True)}
    assert clock().round_length(records) == pytest.approx(2.0 * 0.9 / 0.05)  # median of 1, 2, 500: 2 s; 36 s
    assert clock(target_utilisation=0.5).round_length(records) == pytest.approx(2.0 * 0.5 / 0.45)
    assert clock(target_utilisation=0.0).round_length(records) == pytest.approx(2.0)  # off: H steps
    assert clock(round_s=7.0).round_length(records) == 7.0  # an explicit length wins
    capped = {pid: record.copy(update={"overhead_s": 100.0}) for pid, record in fast}
    assert clock().round_length(capped) == pytest.approx(MAX_STRETCH * 2.0)  # a runaway wait cannot feed back


def test_an_overlapped_round_is_stretched_for_its_own_target_and_no_idle_half_step() -> None:
    """Under --overlap rounds follow at a fixed cadence L and a replica pays its overhead O inside it: training
    fills (L − O)/L, so L = O/(1 − u) for --overlap-utilisation u (0.95 by default; O·u/(1 − u) reached 94.7%)."""
    records = {pid: r.copy(update={"overhead_s": 1.0}) for pid, r in [replica("a", step_s=0.2)]}
    assert clock(overlap=True).round_length(records) == pytest.approx(1.0 / 0.05)
    length = clock(overlap=True, overlap_utilisation=0.9).round_length(records)
    assert length == pytest.approx(10.0) and (length - 1.0) / length == pytest.approx(0.9)
    assert clock(overlap=True, overlap_utilisation=0.0).round_length(records) == pytest.approx(2.0)  # off
    assert clock(overlap=True, target_utilisation=0.0).round_length(records) == pytest.approx(20.0)  # not this one


def test_the_round_is_stretched_for_the_full_replicas_overhead_not_the_stage_peers_smaller_one() -> None:
    """The GPU check's swarm: full replicas spent ~6 s a round outside training (two shards, eval, checkpoint), its
    stage peers ~2 s; the lower median of all four (2.3 s) gave full replicas 70% utilisation. Of a pair of full
    replicas the larger overhead counts: the earliest deadline wins, and the lower one left that replica below its
    target every round."""
    full = [replica(name, step_s=0.5) for name in ("a", "b")]
    stages = [(peer_id(n), peer_record(n, role=ROLE_STAGE, stage=i, vr=0, step_s=0.5)) for i, n in enumerate("cd")]
    overheads = {peer_id(n): o for n, o in {"a": 6.0, "b": 6.4, "c": 2.0, "d": 2.3}.items()}
    records = {pid: record.copy(update={"overhead_s": overheads[pid]}) for pid, record in [*full, *stages]}
    assert clock().round_length(records) == pytest.approx(6.4 * 18)  # upper median of the full replicas'
    only_stages = {pid: r for pid, r in records.items() if r.role == ROLE_STAGE}
    assert clock().round_length(only_stages) == pytest.approx(2.3 * 18)  # no full replica: every peer's


def test_a_replica_folds_its_own_measured_overhead_into_the_round_length() -> None:
    mine = clock()
    records = dict([replica("a", step_s=0.2)])
    assert mine.round_length(records) == pytest.approx(2.0)  # nothing measured yet
    mine.record_overhead(4.0)
    mine.record_overhead(1.0)  # a smaller figure fades in (EMA): 2.5
    assert mine.overhead_s == pytest.approx(2.5)
    mine.record_overhead(3.0)  # a larger one than the estimate counts at once
    assert mine.overhead_s == pytest.approx(3.0)
    assert mine.round_length(records) == pytest.approx(3.0 * 18)


def test_a_full_replicas_own_overhead_floors_the_round_a_stale_record_would_shorten() -> None:
    """The GPU check's overlapped run: one full replica planned round 2 while its peer's record still showed round
    0's 1 s; the lower median of the two was the stale figure, and everyone adopted that replica's short deadline."""
    stale = {pid: r.copy(update={"overhead_s": 1.0}) for pid, r in [replica("peer", step_s=0.2)]}
    mine = clock()
    mine.record_overhead(2.0)
    assert mine.round_length(stale) == pytest.approx(2.0 * 18)  # not 1.0 * 18
    stage = RoundClock(OuterConfig(inner_steps=10), 2.0, 0.5, cadence=False, full=False)
    stage.record_overhead(2.0)  # a stage peer's smaller costs are not the full replicas' round
    assert stage.round_length(stale) == pytest.approx(1.0 * 18)


def test_a_stretched_round_makes_every_replicas_steps_bigger_not_more() -> None:
    """L = 18 s where H steps of the fastest replica take 1 s: each inner step accumulates 18 batches, so the
    fastest trains about H steps (the lab: more steps per round cost far more per token than bigger ones); a
    pipeline stage's steps too (its round trips are paid once per step)."""
    records = {pid: r.copy(update={"overhead_s": 1.0}) for pid, r in [replica("a", step_s=0.1)]}
    plan = clock().plan(4, records, ME, now=1000.0)
    assert plan.length_s == pytest.approx(18.0) and plan.accumulation == 18
    assert plan.keep_training(9, now=1000.0 + 9 * 1.8, step_s=0.1)  # a step of 18 batches: 1.8 s
    assert not plan.keep_training(10, now=1000.0 + 16.3, step_s=0.1)
    stages = RoundClock(OuterConfig(inner_steps=10), 2.0, 0.5, cadence=False, full=False)
    assert stages.plan(4, records, ME, now=1000.0).accumulation == 18
    stretched = {pid: r.copy(update={"overhead_s": 100.0}) for pid, r in [replica("a", step_s=0.1)]}
    assert clock().plan(4, stretched, ME, now=1000.0).accumulation == MAX_ACCUMULATION  # L at its longest
    assert clock(round_s=18.0).plan(4, records, ME, now=1000.0).accumulation == 1  # an explicit length: steps
    assert clock().plan(4, dict([replica("a", step_s=0.1)]), ME, now=1000.0).accumulation == 1  # not stretched


def test_a_replica_that_would_train_under_a_quarter_of_h_big_steps_takes_smaller_ones() -> None:
    """L = 18 s, H = 10, the fastest at 0.1 s a batch: steps of 18 batches. At 0.3 s a batch a replica still fits
    3.3 of them (over ⌈H/4⌉ = 3) and keeps them; at 0.6 s only 1.7, so its steps take 10 batches (3 fit); at 5 s
    a batch, one. The lab: a slow replica's one or two big steps a round hurt, a quarter of H steps helped. Others'
    claims are still bounded by the round's 18 batches a step."""
    records = {pid: r.copy(update={"overhead_s": 1.0}) for pid, r in [replica("a", step_s=0.1)]}

    def planned(batch_s: float) -> tuple[int, int]:
        node = clock()
        node.record_speed(1, batch_s)
        plan = node.plan(4, records, ME, now=1000.0)
        assert plan.length_s == pytest.approx(18.0)
        return plan.accumulation, plan.round_accumulation

    assert planned(0.1) == (18, 18) and planned(0.3) == (18, 18)
    assert planned(0.6) == (10, 18) and planned(5.0) == (1, 18)
