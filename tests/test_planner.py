"""The role and slot planner on synthetic swarms: unit cases, seeded heterogeneous swarms, hypothesis properties.

The planner runs on every node over the records it sees, so the properties that matter most are the ones that make
nodes agree and keep the swarm stable: input order does not matter, no slot gets two holders, settled peers stay put,
and a plan applied and planned again changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_node.client.swarm.planner import (
    ROLE_FULL,
    ROLE_JOINING,
    ROLE_STAGE,
    PeerInfo,
    Plan,
    Requirements,
    decide_role,
    fitting_stages,
    plan,
    round_traffic_seconds,
)

GB = 10**9
MB = 10**6

# Two stages of 6 GB, full model 16 GB, 100 MB per replica per round. At 20k tokens/s a round computes for 204.8 s,
# so the traffic budget is 20.48 s; with r other replicas the traffic takes 800·r / link_mbps seconds.
REQ = Requirements(
    stages=2,
    full_memory_bytes=16 * GB,
    stage_memory_bytes=(6 * GB, 6 * GB),
    replica_round_bytes=100 * MB,
    tokens_per_round=4_096_000,
)
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def peer(peer_id: str, mem_gb: float = 8, link: float = 100, tps: float = 20_000, **changes: object) -> PeerInfo:
    """A record with a symmetric link; `changes` sets any other field."""
    base = PeerInfo(peer_id, int(mem_gb * GB), link, link, tps)
    return dataclasses.replace(base, **changes)


def holder(peer_id: str, vr: int, stage: int, mem_gb: float = 8, link: float = 100, **changes: object) -> PeerInfo:
    return peer(peer_id, mem_gb, link, role=ROLE_STAGE, vr=vr, stage=stage, **changes)


def settle(result: Plan, peers: list[PeerInfo]) -> list[PeerInfo]:
    """The records the peers publish after acting on `result` (a peer that can take no part stays joining)."""
    out = []
    for p in peers:
        role = result.roles[p.peer_id]
        vr, stage = result.slots.get(p.peer_id, (-1, -1))
        out.append(dataclasses.replace(p, role=role or ROLE_JOINING, vr=vr, stage=stage))
    return out


def valid_claims(peers: list[PeerInfo], req: Requirements) -> dict[tuple[int, int], list[str]]:
    """Slot → ids of the stage peers that publish a valid claim on it (the test's own reading of rule 1)."""
    claims: dict[tuple[int, int], list[str]] = {}
    for p in peers:
        pin_ok = p.pinned_stage < 0 or p.pinned_stage == p.stage
        if p.role == ROLE_STAGE and p.vr >= 0 and 0 <= p.stage < req.stages and pin_ok:
            claims.setdefault((p.vr, p.stage), []).append(p.peer_id)
    return claims


def assert_invariants(result: Plan, peers: list[PeerInfo], req: Requirements) -> None:
    """What holds for every plan, whatever the records."""
    by_id = {p.peer_id: p for p in peers}
    assert set(result.roles) == set(by_id), "every input peer has exactly one role entry"
    assert set(result.reasons) == set(by_id)
    assert all(result.reasons[i] for i in by_id)
    assert len(set(result.slots.values())) == len(result.slots), "a slot has two holders"
    assert {i for i, role in result.roles.items() if role == ROLE_STAGE} == set(result.slots)
    for peer_id, (vr, stage) in result.slots.items():
        p = by_id[peer_id]
        assert vr >= 0 and 0 <= stage < req.stages
        assert p.pinned_stage < 0 or stage == p.pinned_stage, f"{peer_id} pinned to {p.pinned_stage}, got {stage}"
        if (p.role, p.vr, p.stage) != (ROLE_STAGE, vr, stage):  # newly placed: must fit
            assert req.stage_memory_bytes[stage] <= p.memory_bytes
    for p in peers:
        if p.role == ROLE_FULL:
            assert result.roles[p.peer_id] == ROLE_FULL, "full is sticky"
        if p.role == ROLE_STAGE:
            assert result.roles[p.peer_id] in (ROLE_STAGE, None), "stage is sticky"
        if result.roles[p.peer_id] == ROLE_FULL and p.role != ROLE_FULL:
            assert p.memory_bytes >= req.full_memory_bytes
    claims = valid_claims(peers, req)
    for slot, claimants in claims.items():
        winner = min(claimants)
        assert result.slots[winner] == slot, "a settled holder moved, or the lowest id lost its slot"
        for loser in claimants:
            if loser != winner:
                assert result.slots.get(loser) != slot


# ------------------------------------------------------------------------------------------------ decide_role


def test_decide_role_big_memory_and_fast_link_is_full() -> None:
    d = decide_role(peer("a", mem_gb=32, link=1000), REQ, replicas=3)
    assert d.role == ROLE_FULL
    assert d.reason.startswith("full: 16.0 GB needed of 32.0 GB")
    assert "2.4 s ≤ 10% of 205 s compute" in d.reason  # 300 MB at 1000 Mbps; 4.096M tokens at 20k/s


def test_decide_role_big_memory_and_slow_link_is_stage() -> None:
    d = decide_role(peer("a", mem_gb=32, link=100), REQ, replicas=3)  # 24 s > 20.48 s
    assert d.role == ROLE_STAGE
    assert "full would fit in memory" in d.reason and "24 s > 10% of 205 s compute" in d.reason


def test_decide_role_traffic_threshold_scales_with_replicas() -> None:
    # 50 Mbps: 16 s per other replica against a 20.48 s budget.
    assert decide_role(peer("a", mem_gb=32, link=50), REQ, replicas=1).role == ROLE_FULL
    assert decide_role(peer("a", mem_gb=32, link=50), REQ, replicas=2).role == ROLE_STAGE
    assert round_traffic_seconds(peer("a", link=50), REQ, 2) == pytest.approx(32.0)


def test_decide_role_uses_the_slower_direction() -> None:
    asymmetric = dataclasses.replace(peer("a", mem_gb=32, link=1000), upload_mbps=40)  # 20 s per replica up
    assert round_traffic_seconds(asymmetric, REQ, 1) == pytest.approx(20.0)
    assert decide_role(asymmetric, REQ, replicas=1).role == ROLE_FULL
    assert decide_role(asymmetric, REQ, replicas=2).role == ROLE_STAGE
    zero_link = dataclasses.replace(asymmetric, download_mbps=0)
    assert round_traffic_seconds(zero_link, REQ, 1) == math.inf
    assert decide_role(zero_link, REQ, replicas=1).role == ROLE_STAGE


def test_decide_role_small_memory_is_stage_and_tiny_is_none() -> None:
    small = decide_role(peer("a", mem_gb=8, link=10_000), REQ, replicas=0)
    assert small.role == ROLE_STAGE and "full needs 16.0 GB, node has 8.0 GB" in small.reason
    tiny = decide_role(peer("a", mem_gb=4), REQ, replicas=0)
    assert tiny.role is None and tiny.reason == "none: smallest stage needs 6.0 GB, node has 4.0 GB"


def test_decide_role_unknown_throughput_is_full_only_without_traffic() -> None:
    unknown = peer("a", mem_gb=32, link=10_000, tps=0)
    first = decide_role(unknown, REQ, replicas=0)
    assert first.role == ROLE_FULL and "no round traffic" in first.reason
    later = decide_role(unknown, REQ, replicas=1)
    assert later.role == ROLE_STAGE and "unknown compute time" in later.reason


def test_decide_role_requested_roles() -> None:
    too_small = decide_role(peer("a", mem_gb=8, requested_role="full"), REQ, replicas=0)
    assert (
        too_small.role is None and "--role full" in too_small.reason and "16.0 GB needed of 8.0 GB" in too_small.reason
    )
    slow_full = decide_role(peer("a", mem_gb=32, link=1, requested_role="full"), REQ, replicas=5)
    assert slow_full.role == ROLE_FULL and slow_full.reason.startswith("full (requested)")
    big_stage = decide_role(peer("a", mem_gb=64, link=10_000, requested_role="stage"), REQ, replicas=0)
    assert big_stage.role == ROLE_STAGE and big_stage.reason.startswith("stage (requested)")
    tiny_stage = decide_role(peer("a", mem_gb=1, requested_role="stage"), REQ, replicas=0)
    assert tiny_stage.role is None
    conflicting = decide_role(peer("a", mem_gb=64, requested_role="full", pinned_stage=0), REQ, replicas=0)
    assert conflicting.role is None and "conflicts with --stage 0" in conflicting.reason
    bogus = decide_role(peer("a", mem_gb=64, requested_role="boss"), REQ, replicas=0)
    assert bogus.role is None and "unknown requested role" in bogus.reason
    with pytest.raises(ValueError):
        decide_role(peer("a"), REQ, replicas=-1)


def test_decide_role_pin_means_stage() -> None:
    req = dataclasses.replace(REQ, stage_memory_bytes=(10 * GB, 4 * GB))
    pinned = decide_role(peer("a", mem_gb=64, link=10_000, pinned_stage=1), req, replicas=0)
    assert pinned.role == ROLE_STAGE and "stage 1 pinned" in pinned.reason
    no_fit = decide_role(peer("a", mem_gb=8, pinned_stage=0), req, replicas=0)  # stage 1 would fit, 0 does not
    assert no_fit.role is None and no_fit.reason == "none: pinned stage 0 needs 10.0 GB, node has 8.0 GB"
    missing = decide_role(peer("a", mem_gb=64, pinned_stage=2), req, replicas=0)
    assert missing.role is None and "pinned stage 2 does not exist" in missing.reason


def test_fitting_stages_respects_memory_and_pin() -> None:
    req = dataclasses.replace(REQ, stages=3, stage_memory_bytes=(10 * GB, 6 * GB, 4 * GB))
    assert fitting_stages(peer("a", mem_gb=7), req) == (1, 2)
    assert fitting_stages(peer("a", mem_gb=7, pinned_stage=2), req) == (2,)
    assert fitting_stages(peer("a", mem_gb=7, pinned_stage=0), req) == ()
    assert fitting_stages(peer("a", mem_gb=3), req) == ()


def test_requirements_are_validated() -> None:
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        dataclasses.replace(REQ, stages=3)
    with pytest.raises(ValueError):
        dataclasses.replace(REQ, stages=0, stage_memory_bytes=())
    with pytest.raises(ValueError):
        dataclasses.replace(REQ, comm_fraction=0)
    assert dataclasses.replace(REQ, stage_memory_bytes=[1, 2]).stage_memory_bytes == (1, 2)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ plan: unit cases


def test_plan_counts_replicas_as_joiners_become_full_in_id_order() -> None:
    # 50 Mbps fits one other replica, not two: the first two ids become full, the third a stage peer.
    result = plan([peer(i, mem_gb=32, link=50) for i in ("c", "a", "b")], REQ)
    assert result.roles == {"a": ROLE_FULL, "b": ROLE_FULL, "c": ROLE_STAGE}
    # An existing VR counts as a replica: with one full and one VR, the 50 Mbps joiner no longer fits.
    swarm = [peer("f", mem_gb=32, role=ROLE_FULL), holder("h", 0, 0), peer("j", mem_gb=32, link=50)]
    assert plan(swarm, REQ).roles["j"] == ROLE_STAGE
    assert plan(swarm[:1] + swarm[2:], REQ).roles["j"] == ROLE_FULL


def test_plan_balance_two_stages_four_joiners_make_two_complete_vrs() -> None:
    result = plan([peer(i) for i in "abcd"], REQ)
    vrs = result.virtual_replicas(2)
    assert sorted(vrs) == [0, 1]
    assert all(sorted(held) == [0, 1] for held in vrs.values())
    assert result.missing(2) == {}


def test_plan_odd_joiners_leave_exactly_one_incomplete_vr() -> None:
    req = dataclasses.replace(REQ, stages=3, stage_memory_bytes=(6 * GB,) * 3)
    result = plan([peer(f"p{i}") for i in range(7)], req)
    assert len(result.virtual_replicas(3)) == 3
    assert result.missing(3) == {2: [1, 2]}


def test_plan_link_pairing_whatever_the_ids() -> None:
    """2 fast + 2 slow joiners, S = 2: the fast pair shares one VR and the slow pair the other. This holds for every
    assignment of ids because placement orders by link (fastest first), not by id: in id order, ids that alternate
    fast, slow, fast, slow would pair each fast peer with a slow one, since completing the open VR comes first."""
    for ids in ("abcd", "acbd", "adbc", "dcba", "bdac"):
        fast1, slow1, fast2, slow2 = ids
        swarm = [peer(fast1, link=1000), peer(slow1, link=10), peer(fast2, link=900), peer(slow2, link=12)]
        result = plan(swarm, REQ)
        assert result.slots[fast1][0] == result.slots[fast2][0], ids
        assert result.slots[slow1][0] == result.slots[slow2][0], ids
        assert result.slots[fast1][0] != result.slots[slow1][0], ids


def test_plan_direct_peers_are_pipeline_neighbours_and_relayed_ones_share_the_other_vr() -> None:
    """2 direct + 2 relayed stage joiners, equal links, S = 2: the direct pair forms one VR, so its boundary never
    crosses a relay, whatever the ids."""
    for ids in ("abcd", "acbd", "dcba", "bdac"):
        relayed1, direct1, relayed2, direct2 = ids
        swarm = [peer(relayed1, relayed=True), peer(direct1), peer(relayed2, relayed=True), peer(direct2)]
        result = plan(swarm, dataclasses.replace(REQ, full_memory_bytes=32 * GB))
        assert result.slots[direct1][0] == result.slots[direct2][0] != result.slots[relayed1][0], ids
        assert result.slots[relayed1][0] == result.slots[relayed2][0], ids


def test_plan_link_pairing_among_equally_complete_vrs() -> None:
    """Rule b: two half-full VRs (one fast holder, one slow); a slow joiner completes the slow VR, a fast one the
    fast VR, whatever the vr ids."""
    for fast_vr, slow_vr in ((0, 1), (1, 0)):
        swarm = [holder("h1", fast_vr, 0, link=1000), holder("h2", slow_vr, 0, link=10)]
        slow = plan([*swarm, peer("z", link=8)], REQ)
        assert slow.slots["z"] == (slow_vr, 1)
        fast = plan([*swarm, peer("z", link=2000)], REQ)
        assert fast.slots["z"] == (fast_vr, 1)


def test_plan_fills_most_complete_vr_first() -> None:
    req = dataclasses.replace(REQ, stages=3, stage_memory_bytes=(6 * GB,) * 3)
    # VR 0 has one holder with a link like the joiner's; VR 1 has two holders with very different links.
    swarm = [holder("a", 0, 0, link=100), holder("b", 1, 0, link=5), holder("c", 1, 2, link=5)]
    result = plan([*swarm, peer("z", link=100)], req)
    assert result.slots["z"] == (1, 1)
    assert "completes VR 1" in result.reasons["z"]


def test_plan_stage_choice_balances_swarm_wide() -> None:
    """Rule c: within the chosen VR, the missing stage fewest peers hold swarm-wide. VR 1 (holding stage 1, link
    like the joiner's) is chosen over VR 2 (one holder on a very slow link); which of its gaps, 0 or 2, the joiner
    fills depends on what VR 2 holds."""
    req = dataclasses.replace(REQ, stages=3, stage_memory_bytes=(6 * GB,) * 3)
    complete = [holder(f"v0s{s}", 0, s) for s in range(3)]
    for slow_stage, expected in ((2, 0), (0, 2)):
        swarm = [*complete, holder("v1", 1, 1), holder("v2", 2, slow_stage, link=1), peer("z")]
        result = plan(swarm, req)
        assert result.slots["z"] == (1, expected), slow_stage


def test_plan_memory_limited_peers_pair_with_flexible_ones() -> None:
    """Stage 0 needs 10 GB, stage 1 needs 5 GB. Two 12 GB and two 6 GB joiners: the 6 GB peers can only run stage
    1, so they are placed first and each 12 GB peer completes a VR with stage 0 — two complete VRs, not one complete
    VR of the big peers plus two unfinishable halves."""
    req = dataclasses.replace(REQ, stage_memory_bytes=(10 * GB, 5 * GB))
    swarm = [peer("a", mem_gb=12, link=1000), peer("b", mem_gb=12, link=1000), peer("c", mem_gb=6), peer("d", 6)]
    result = plan(swarm, req)
    assert result.missing(2) == {}
    assert result.slots["c"][1] == 1 and result.slots["d"][1] == 1
    assert {result.slots["a"][1], result.slots["b"][1]} == {0}


def test_plan_pinned_peers_get_their_stage() -> None:
    req = dataclasses.replace(REQ, stages=3, stage_memory_bytes=(6 * GB,) * 3)
    swarm = [peer("a", pinned_stage=2), peer("b", pinned_stage=2), peer("c"), peer("d", pinned_stage=0)]
    result = plan(swarm, req)
    assert result.slots["a"][1] == 2 and result.slots["b"][1] == 2 and result.slots["d"][1] == 0
    assert result.slots["a"][0] != result.slots["b"][0]
    unfit = plan([peer("e", mem_gb=5, pinned_stage=1)], dataclasses.replace(req, stage_memory_bytes=(4, 6 * GB, 4)))
    assert unfit.roles == {"e": None} and "pinned stage 1 needs 6.0 GB, node has 5.0 GB" in unfit.reasons["e"]


def test_plan_keeps_holders_and_full_replicas() -> None:
    swarm = [peer("f", mem_gb=4, role=ROLE_FULL), holder("h", 3, 1, mem_gb=1), peer("j")]
    result = plan(swarm, REQ)
    assert result.roles["f"] == ROLE_FULL  # sticky even though it would no longer qualify
    assert result.slots["h"] == (3, 1)  # never moved, even though it would no longer fit
    assert result.slots["j"] == (3, 0)  # completes the incomplete VR 3 rather than opening VR 0
    assert result.reasons["h"] == "stage: holds (vr 3, stage 1)"


def test_plan_contested_slot_lowest_id_wins_and_loser_is_placed() -> None:
    """Two nodes join concurrently, each sees only the other VR's holder and claims the free slot; once both claims
    propagate, the lower id keeps it and the other is placed in a fresh slot, not moved back into a conflict."""
    base = [holder("h0", 0, 0)]
    view_x = plan([*base, peer("x")], REQ)
    view_w = plan([*base, peer("w")], REQ)
    assert view_x.slots["x"] == view_w.slots["w"] == (0, 1)  # both claim the same slot
    merged = [*base, holder("x", 0, 1), holder("w", 0, 1)]
    result = plan(merged, REQ)
    assert result.slots["w"] == (0, 1)
    assert result.roles["x"] == ROLE_STAGE and result.slots["x"] == (1, 0)
    assert "lost (vr 0, stage 1) to w" in result.reasons["x"]
    assert "kept it over x" in result.reasons["w"]


def test_plan_contested_slot_goes_to_the_earlier_claim_not_the_lower_id() -> None:
    """H2: an incumbent is not displaced by a later claimant, whatever its peer id (a low id is free to pick)."""
    incumbent, late = holder("z", 0, 1, claimed_at=100.0), holder("a", 0, 1, claimed_at=250.0)
    result = plan([holder("h0", 0, 0, claimed_at=90.0), late, incumbent], REQ)
    assert result.slots["z"] == (0, 1) and result.slots["a"] != (0, 1)
    assert "lost (vr 0, stage 1) to z (the earliest claim wins)" in result.reasons["a"]


def test_plan_contest_loser_that_fits_nothing_gets_none() -> None:
    result = plan([holder("a", 0, 0), holder("b", 0, 0, mem_gb=1)], REQ)
    assert result.slots == {"a": (0, 0)}
    assert result.roles["b"] is None and "cannot be placed" in result.reasons["b"]


def test_plan_replaces_invalid_published_slots() -> None:
    swarm = [holder("a", -1, 0), holder("b", 0, 5), holder("c", 0, 0, pinned_stage=1)]
    result = plan(swarm, REQ)
    assert result.slots["c"][1] == 1
    assert all("is not valid here" in result.reasons[i] for i in "abc")
    assert_invariants(result, swarm, REQ)


def test_plan_takeover_of_expired_holder_slot() -> None:
    swarm = [peer(f"p{i:02d}") for i in range(8)]
    settled = settle(plan(swarm, REQ), swarm)
    gone = next(p for p in settled if p.role == ROLE_STAGE and p.vr == 2)
    survivors = [p for p in settled if p.peer_id != gone.peer_id]
    result = plan([*survivors, peer("new", link=3)], REQ)
    assert result.slots["new"] == (gone.vr, gone.stage)
    assert all(result.slots[p.peer_id] == (p.vr, p.stage) for p in survivors)


def test_plan_reuses_lowest_free_vr_id() -> None:
    swarm = [holder("a", 1, 0), holder("b", 1, 1), holder("c", 3, 0), holder("d", 3, 1)]
    result = plan([*swarm, peer("x"), peer("y"), peer("z")], REQ)
    assert {result.slots[i][0] for i in "xyz"} == {0, 2}
    assert "opens VR 0" in result.reasons["x"]


def test_plan_rejects_duplicate_peer_ids() -> None:
    with pytest.raises(ValueError, match="two records"):
        plan([peer("a"), peer("a", mem_gb=4)], REQ)


def test_plan_empty_and_views() -> None:
    empty = plan([], REQ)
    assert empty.roles == {} and empty.virtual_replicas(2) == {} and empty.missing(2) == {}
    result = plan([holder("a", 4, 1), holder("b", 0, 0), holder("c", 0, 1), peer("f", 32, 1000, role=ROLE_FULL)], REQ)
    assert result.virtual_replicas(2) == {0: {0: "b", 1: "c"}, 4: {1: "a"}}
    assert result.missing(2) == {4: [0]}
    with pytest.raises(ValueError):
        result.virtual_replicas(1)


def test_digest_covers_roles_and_slots_only() -> None:
    a = Plan(roles={"x": ROLE_STAGE, "y": ROLE_FULL}, slots={"x": (0, 1)}, reasons={"x": "1", "y": "2"})
    same = Plan(roles={"y": ROLE_FULL, "x": ROLE_STAGE}, slots={"x": (0, 1)}, reasons={"x": "other", "y": "text"})
    moved = Plan(roles={"x": ROLE_STAGE, "y": ROLE_FULL}, slots={"x": (1, 0)}, reasons={})
    nobody = Plan(roles={"x": ROLE_STAGE, "y": None}, slots={"x": (0, 1)}, reasons={})
    assert a.digest() == same.digest()
    assert len(a.digest()) == 16 and int(a.digest(), 16) >= 0
    assert len({a.digest(), moved.digest(), nobody.digest()}) == 3


def test_describe_lists_every_peer_with_its_reason() -> None:
    result = plan([peer("b", mem_gb=32, link=1000), peer("a"), peer("c", mem_gb=2)], REQ)
    lines = result.describe().splitlines()
    assert [line.split(" → ")[0] for line in lines] == ["a", "b", "c"]
    assert lines[1].startswith("b → full:") and lines[2].startswith("c → none:")


# ------------------------------------------------------------------------------------------------ heterogeneous swarms


def random_swarm(rng: random.Random, n: int) -> list[PeerInfo]:
    """Joiners with log-spread memory (2–64 GB), links (5 Mbps–10 Gbps, asymmetric), throughput (0 for a third)."""
    out = []
    for i in range(n):
        mem = int(2 ** rng.uniform(1, 6) * GB)
        down = 10 ** rng.uniform(0.7, 4)
        up = down * rng.uniform(0.1, 1)
        tps = 0.0 if rng.random() < 1 / 3 else 10 ** rng.uniform(3, 5)
        pin = rng.choice([-1] * 8 + [0, 1, 2])
        out.append(PeerInfo(f"peer-{rng.getrandbits(32):08x}-{i}", mem, up, down, tps, pinned_stage=pin))
    return out


HETERO_REQ = Requirements(
    stages=3,
    full_memory_bytes=24 * GB,
    stage_memory_bytes=(10 * GB, 6 * GB, 8 * GB),
    replica_round_bytes=50 * MB,
    tokens_per_round=4_096_000,
)


@pytest.mark.parametrize("seed", range(6))
def test_heterogeneous_swarm_batch(seed: int) -> None:
    rng = random.Random(seed)
    swarm = random_swarm(rng, rng.randint(40, 60))
    result = plan(swarm, HETERO_REQ)
    assert_invariants(result, swarm, HETERO_REQ)
    for _ in range(5):
        shuffled = swarm[:]
        rng.shuffle(shuffled)
        again = plan(shuffled, HETERO_REQ)
        assert again.digest() == result.digest() and again.reasons == result.reasons
    # Who ends up with nothing really fits nothing.
    for p in swarm:
        if result.roles[p.peer_id] is None:
            assert not fitting_stages(p, HETERO_REQ)
    # The batch uses its peers: some full replicas, some complete VRs.
    assert ROLE_FULL in result.roles.values()
    vrs = result.virtual_replicas(3)
    assert sum(len(held) == 3 for held in vrs.values()) >= 3
    # Settling and planning again changes nothing: nobody moves.
    assert plan(settle(result, swarm), HETERO_REQ).digest() == result.digest()


@pytest.mark.parametrize("seed", range(4))
def test_heterogeneous_swarm_online_arrival_follows_fill_rules(seed: int) -> None:
    """Peers arrive one at a time; each arrival plans over the settled records. Checks rules a and d directly:
    a joiner opens a new VR only if no incomplete VR had a free stage it fits, and otherwise joins an incomplete VR
    with the most holders among those it could join."""
    rng = random.Random(100 + seed)
    arrivals = random_swarm(rng, 50)
    records: list[PeerInfo] = []
    stages = HETERO_REQ.stages
    for newcomer in arrivals:
        before = plan(records, HETERO_REQ).virtual_replicas(stages)
        result = plan([*records, newcomer], HETERO_REQ)
        assert_invariants(result, [*records, newcomer], HETERO_REQ)
        assert all(result.slots.get(p.peer_id) == (p.vr, p.stage) for p in records if p.role == ROLE_STAGE)
        if newcomer.peer_id in result.slots:
            fits = fitting_stages(newcomer, HETERO_REQ)
            joinable = {vr: len(held) for vr, held in before.items() if len(held) < stages and set(fits) - set(held)}
            vr, stage = result.slots[newcomer.peer_id]
            assert stage in fits and stage not in before.get(vr, {})
            if joinable:
                assert joinable.get(vr) == max(joinable.values())
            else:
                assert vr not in before and vr == min(set(range(len(before) + 1)) - set(before))
        records = settle(result, [*records, newcomer])
    final = plan(records, HETERO_REQ)
    assert final.digest() == plan(list(reversed(records)), HETERO_REQ).digest()


# ------------------------------------------------------------------------------------------------ hypothesis


@st.composite
def requirements(draw: st.DrawFn) -> Requirements:
    stages = draw(st.integers(1, 4))
    stage_mem = tuple(draw(st.sampled_from([2, 4, 6, 8])) * GB for _ in range(stages))
    full = max(draw(st.sampled_from([8, 12, 24])) * GB, max(stage_mem))
    return Requirements(
        stages=stages,
        full_memory_bytes=full,
        stage_memory_bytes=stage_mem,
        replica_round_bytes=draw(st.sampled_from([10, 100, 1000])) * MB,
        tokens_per_round=4_096_000,
    )


@st.composite
def swarms(draw: st.DrawFn, min_size: int = 0, max_size: int = 30) -> tuple[Requirements, list[PeerInfo]]:
    """Records in every state: joiners, full replicas, stage holders with valid, contested and invalid slots.

    The size is drawn explicitly (a plain list strategy stays small), ids are unpadded hex so that string order
    differs from numeric order, and a stage peer copies an earlier valid claim half of the time, so contests are
    common.
    """
    req = draw(requirements())
    n = draw(st.integers(min_size, max_size))
    numbers = draw(st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n, unique=True))
    out: list[PeerInfo] = []
    for number in numbers:
        role = draw(st.sampled_from([ROLE_JOINING, ROLE_JOINING, ROLE_FULL, ROLE_STAGE, ROLE_STAGE, "?"]))
        vr, stage = -1, -1
        if role == ROLE_STAGE:
            earlier = list(valid_claims(out, req))
            if earlier and draw(st.booleans()):
                vr, stage = draw(st.sampled_from(earlier))
            else:
                vr, stage = draw(st.integers(-1, 2)), draw(st.integers(-1, req.stages))
        up, down = (draw(st.sampled_from([0, 5, 50, 500, 5000])) for _ in range(2))
        out.append(
            PeerInfo(
                format(number, "x"),
                memory_bytes=draw(st.sampled_from([1, 3, 5, 7, 10, 16, 32])) * GB,
                upload_mbps=up,
                download_mbps=down,
                tokens_per_s=draw(st.sampled_from([0, 5_000, 50_000])),
                role=role,
                vr=vr,
                stage=stage,
                requested_role=draw(st.sampled_from(["auto", "auto", "auto", "full", "stage"])),
                pinned_stage=draw(st.sampled_from([-1, -1, -1, -1, 0, 1, req.stages])),
            )
        )
    return req, out


@PROPERTY
@given(swarms(), st.randoms(use_true_random=False))
def test_property_invariants_and_order_independence(
    case: tuple[Requirements, list[PeerInfo]], rnd: random.Random
) -> None:
    req, swarm = case
    result = plan(swarm, req)
    assert_invariants(result, swarm, req)
    shuffled = swarm[:]
    rnd.shuffle(shuffled)
    again = plan(shuffled, req)
    assert again.digest() == result.digest()
    assert again == result


@PROPERTY
@given(swarms())
def test_property_settled_plan_is_a_fixed_point(case: tuple[Requirements, list[PeerInfo]]) -> None:
    """Acting on a plan and planning again moves nobody: every holder keeps its slot, every role its value."""
    req, swarm = case
    first = plan(swarm, req)
    second = plan(settle(first, swarm), req)
    assert second.roles == first.roles and second.slots == first.slots


@PROPERTY
@given(swarms(min_size=2))
def test_property_contest_lowest_id_wins_and_losers_move(case: tuple[Requirements, list[PeerInfo]]) -> None:
    """Force a contest: copy the first valid holder's slot onto another stage-capable peer."""
    req, swarm = case
    first = next((p for p in swarm if valid_claims([p], req)), None)
    other = next((p for p in swarm if p is not first and p.pinned_stage < 0), None)
    if first is None or other is None:
        swarm = [holder("m", 0, 0, pinned_stage=-1), peer("k", mem_gb=32)]
        req = REQ
        first, other = swarm
    contested = dataclasses.replace(other, role=ROLE_STAGE, vr=first.vr, stage=first.stage)
    swarm = [contested if p is other else p for p in swarm]
    result = plan(swarm, req)
    claimants = valid_claims(swarm, req)[(first.vr, first.stage)]
    assert len(claimants) >= 2
    winner = min(claimants)
    assert result.slots[winner] == (first.vr, first.stage)
    for loser in set(claimants) - {winner}:
        assert loser not in result.slots or result.slots[loser] != (first.vr, first.stage)
        loser_record = next(p for p in swarm if p.peer_id == loser)
        assert result.roles[loser] == (ROLE_STAGE if fitting_stages(loser_record, req) else None)
    assert_invariants(result, swarm, req)


@PROPERTY
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.data(),
)
def test_property_takeover_and_no_new_vr_while_incomplete_ones_have_room(
    stages: int, n_vrs: int, data: st.DataObject
) -> None:
    """A swarm of complete VRs loses some holders; as many new joiners (or fewer) take exactly the freed slots
    and no new VR is opened; one joiner more than the freed slots opens exactly one new VR."""
    req = dataclasses.replace(REQ, stages=stages, stage_memory_bytes=(6 * GB,) * stages)
    links = st.sampled_from([1, 10, 100, 1000, 10_000])
    swarm = [peer(f"h{i:02d}", link=data.draw(links)) for i in range(stages * n_vrs)]
    settled = settle(plan(swarm, req), swarm)
    assert len({p.vr for p in settled}) == n_vrs and all(p.role == ROLE_STAGE for p in settled)
    gone = data.draw(
        st.lists(st.sampled_from(settled), min_size=1, max_size=len(settled), unique_by=lambda p: p.peer_id)
    )
    survivors = [p for p in settled if p not in gone]
    freed = {(p.vr, p.stage) for p in gone}
    extra = data.draw(st.integers(0, 1))
    joiners = [peer(f"j{i:02d}", link=data.draw(links)) for i in range(len(gone) + extra)]
    result = plan([*survivors, *joiners], req)
    assert all(result.slots[p.peer_id] == (p.vr, p.stage) for p in survivors)
    taken = [result.slots[j.peer_id] for j in joiners]
    assert freed <= set(taken)
    new_vrs = {vr for vr, _ in taken} - {p.vr for p in settled}
    if extra:
        # VRs whose holders all left are reopened first (lowest unused ids); only then does the extra open VR n.
        assert new_vrs == {n_vrs}
        assert len(set(taken) - freed) == 1
    else:
        assert set(taken) == freed and not new_vrs


@PROPERTY
@given(requirements(), st.lists(st.sampled_from([1, 3, 5, 7, 10]), min_size=1, max_size=25))
def test_property_memory_limited_joiners_only_get_stages_that_fit(req: Requirements, mems: list[int]) -> None:
    swarm = [peer(f"p{i:02d}", mem_gb=m, link=1, tps=0) for i, m in enumerate(mems)]
    result = plan(swarm, req)
    for p in swarm:
        slot = result.slots.get(p.peer_id)
        if slot is not None:
            assert req.stage_memory_bytes[slot[1]] <= p.memory_bytes
        elif result.roles[p.peer_id] is None:
            assert p.memory_bytes < min(req.stage_memory_bytes)
