"""Who takes part in a round, as every peer reads it from the records: pure functions, no network."""

from __future__ import annotations

from factories import peer_id, peer_record

from hetero_node.client.swarm.view import (
    certified_fingerprint,
    coming_members,
    held_fingerprint,
    replica_count,
    shard_donors,
    shard_members,
    slot_holders,
    swarm_round,
    virtual_replicas,
    vouched_fingerprint,
    vr_stages,
)
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL, ROLE_JOINING, ROLE_STAGE


def full(name: str, round_: int, train_round: int = -1) -> tuple[str, object]:
    return peer_id(name), peer_record(name, role=ROLE_FULL, round=round_, train_round=train_round)


def stage(name: str, vr: int, index: int, round_: int = 3, train_round: int = 3) -> tuple[str, object]:
    return peer_id(name), peer_record(name, role=ROLE_STAGE, vr=vr, stage=index, round=round_, train_round=train_round)


def names(ids: object) -> object:
    back = {peer_id(n): n for n in ("f1", "f2", "f3", "g2", "j1", "c0", "b0", "a9", "d0", "e0", "e1", "x0", "x1")}
    if isinstance(ids, dict):
        return {back.get(k, k): names(v) for k, v in ids.items()}
    if isinstance(ids, list | set):
        return type(ids)(back[i] for i in ids)
    return back.get(ids, ids)  # type: ignore[arg-type]


RECORDS = dict(
    [
        full("f1", 3, train_round=3),
        full("f2", 2, train_round=2),  # lagging a round
        (peer_id("j1"), peer_record("j1", role=ROLE_JOINING, round=3)),
        # vr 0 complete; "b0" and "a9" both claim (0, 1): the lower id wins
        stage("c0", 0, 0),
        stage("b0", 0, 1),
        stage("a9", 0, 1, round_=2, train_round=2),
        # vr 1 incomplete: stage 1 missing
        stage("d0", 1, 0),
        # vr 4 complete, its stage 1 in another round
        stage("e0", 4, 0),
        stage("e1", 4, 1, round_=4, train_round=4),
        # ignored for slots: stage out of range, no vr
        stage("x0", 5, 2),
        (peer_id("x1"), peer_record("x1", role=ROLE_STAGE, stage=0, round=3)),
    ]
)


def test_slots_virtual_replicas_and_group_membership() -> None:
    records = RECORDS
    assert names(slot_holders(records, 2)) == {(0, 0): "c0", (0, 1): "a9", (1, 0): "d0", (4, 0): "e0", (4, 1): "e1"}
    assert names(vr_stages(records, 0, 2)) == {0: "c0", 1: "a9"} and names(vr_stages(records, 1, 2)) == {0: "d0"}
    assert names(virtual_replicas(records, 2)) == {0: {0: "c0", 1: "a9"}, 4: {0: "e0", 1: "e1"}}
    assert names(virtual_replicas(records, 2, complete=False))[1] == {0: "d0"}
    assert virtual_replicas(records, 3) == {}  # no vr has a stage 2
    assert replica_count(records, 2) == 4  # f1, f2, vr 0, vr 4
    assert replica_count(records, 3) == 2
    assert names(shard_members(records, 0, 2)) == ["c0", "e0", "f1", "f2"]
    assert names(shard_members(records, 1, 2)) == ["a9", "e1", "f1", "f2"]


def test_the_members_a_round_waits_for_are_those_training_it() -> None:
    records = RECORDS

    def coming(recs: dict[str, PeerRecord], round_: int, shard: int) -> object:
        return names(set(coming_members(recs, round_, shard, 2)))

    assert coming(records, 3, 0) == {"f1", "c0", "e0", "f2"}  # f2 still finishing round 2 (not d0)
    assert coming(records, 3, 1) == {"f1", "f2", "a9"}  # f2 and a9 finishing round 2 (e1 is in 4)
    assert coming(records, 2, 1) == {"f2", "a9"}  # b0 lost its slot
    assert coming(records, 4, 1) == {"e1", "f1"}  # f1 trains round 3: it will come to 4
    assert coming(records, 9, 0) == set()
    assert coming(records, 5, 1) == {"e1"}  # e1 finishing round 4 (a9 two rounds behind)
    bigger = {**records, **dict([full("f3", 2, 2), full("g2", 2, 2)])}
    assert coming(bigger, 2, 1) == {"f2", "f3", "g2", "a9"}
    just_done = {**records, **dict([full("f3", 3, train_round=2)])}  # applied θ(3), not yet planning round 3
    assert coming(just_done, 3, 0) == {"f1", "c0", "e0", "f2", "f3"}
    receiving = {**records, **dict([full("f3", 3, train_round=-1)])}  # only receives round 3: not waited for
    assert coming(receiving, 3, 0) == {"f1", "c0", "e0", "f2"}
    overlapped = {**records, **dict([full("f3", 2, train_round=3)])}  # its round-2 exchange is in flight
    assert coming(overlapped, 3, 0) == {"f1", "c0", "e0", "f2", "f3"}  # f3 holds θ(2) and already trains round 3
    assert coming({}, 0, 0) == set()


def test_donors_and_the_swarm_round() -> None:
    records = RECORDS
    assert names(set(shard_donors(records, 0))) == {"f1", "f2", "c0", "d0", "e0", "x1"}  # any stage-0 peer
    assert names(set(shard_donors(records, 1))) == {"f1", "f2", "b0", "a9", "e1"}
    assert shard_donors(records, 1)[peer_id("a9")] is records[peer_id("a9")]
    assert names(set(shard_donors(records, 2))) == {"f1", "f2", "x0"}
    assert virtual_replicas({}, 2) == {} and replica_count({}, 2) == 0
    ahead = dict([full("f1", 5), full("f2", 5), full("f3", 4)])
    assert swarm_round(ahead, peer_id("f3")) == 5  # both others hold round 5
    liar = dict([full("f1", 5), full("f2", 5), full("f3", 10**9)])
    assert swarm_round(liar, peer_id("f1")) == 10**9  # one honest and one liar: the upper median believes it
    assert swarm_round({**liar, **dict([full("g2", 5)])}, peer_id("f1")) == 5  # outvoted by the honest
    assert swarm_round({}, peer_id("f1")) == 0


def test_a_fingerprint_is_vouched_for_by_a_strict_majority_of_the_others_at_its_round() -> None:
    def at(name: str, round_: int, fp: str) -> tuple[str, object]:
        return peer_id(name), peer_record(name, role=ROLE_FULL, round=round_, fingerprints={"0": fp, "fixed": fp})

    records = dict([at("f1", 5, "a" * 32), at("f2", 5, "a" * 32), at("f3", 5, "b" * 32), at("g2", 6, "c" * 32)])
    assert vouched_fingerprint(records, 5, "0", peer_id("x0")) == "a" * 32  # two of three
    assert vouched_fingerprint(records, 5, "fixed", peer_id("x0")) == "a" * 32
    assert vouched_fingerprint(records, 5, "0", peer_id("f1")) is None  # without f1's own word: a tie
    assert vouched_fingerprint(records, 6, "0", peer_id("x0")) == "c" * 32  # alone at its round
    assert vouched_fingerprint(records, 7, "0", peer_id("x0")) is None  # nobody there
    assert vouched_fingerprint(records, 5, "1", peer_id("x0")) is None  # nobody advertises shard 1


def test_a_peer_that_voided_the_rounds_since_its_certified_one_still_vouches_for_their_tables() -> None:
    """A stage 1 that voided round 2 asked for T_fixed(3) from peers at round 3, while its stage 0, alone after the
    full replica left, voided rounds 3, 4, ... and never stood at round 3 when asked: it re-synced round 2 for as
    long as the run lasted. A record holding a certified θ(c) at round r held the same tables at every round in
    between."""

    def at(name: str, round_: int, certified: int, fp: str) -> tuple[str, object]:
        record = peer_record(name, role=ROLE_STAGE, round=round_, certified=certified, fingerprints={"fixed": fp})
        return peer_id(name), record

    alone = dict([at("s0", 13, 2, "a" * 32)])
    assert vouched_fingerprint(alone, 3, "fixed", me="") is None  # nobody stands at round 3
    assert held_fingerprint(alone, 3, "fixed", me="") == "a" * 32  # voided 2..12: its table is that of round 3
    assert held_fingerprint(alone, 1, "fixed", me="") is None  # certified round 2: its table may differ from 1's
    assert held_fingerprint(alone, 14, "fixed", me="") is None  # not there yet
    assert held_fingerprint(alone, 3, "fixed", me=peer_id("s0")) is None  # our own word is no vouching
    moved = {**alone, **dict([at("f1", 4, 3, "b" * 32), at("f2", 3, 3, "b" * 32)])}  # two that certified round 2
    assert held_fingerprint(moved, 3, "fixed", me="") == "b" * 32  # two of three
    assert held_fingerprint(moved, 4, "fixed", me="") is None  # a tie: s0 and f1 voided on from different tables
    assert held_fingerprint(moved, 3, "0", me="") is None  # nobody advertises shard 0


def test_a_tie_of_starts_goes_to_the_start_a_certified_round_led_to() -> None:
    """Two members of a round, one restarted (or cut off) that voided round t−1 which the other certified: their
    records tie at round t, and only the certified holder's start is the swarm's."""

    def at(name: str, certified: int, fp: str) -> tuple[str, object]:
        return peer_id(name), peer_record(name, role=ROLE_FULL, round=5, certified=certified, fingerprints={"0": fp})

    tie = dict([at("f1", 5, "a" * 32), at("f2", 4, "b" * 32)])
    assert vouched_fingerprint(tie, 5, "0", me="") is None
    assert certified_fingerprint(tie, 5, "0") == "a" * 32
    assert certified_fingerprint(tie, 6, "0") is None  # nobody holds round 6
    split = {**tie, **dict([at("f3", 5, "c" * 32)])}  # two certified holders that disagree (a liar among them)
    assert certified_fingerprint(split, 5, "0") is None
    assert certified_fingerprint({**split, **dict([at("g2", 5, "a" * 32)])}, 5, "0") == "a" * 32


def test_the_earlier_claim_holds_a_slot_whatever_the_peer_ids() -> None:
    records = {
        peer_id(name): peer_record(name, role=ROLE_STAGE, vr=0, stage=1, claimed_at=at)
        for name, at in (("a9", 200.0), ("b0", 100.0))
    }
    assert names(slot_holders(records, 2)) == {(0, 1): "b0"}
