"""A reader's memory of whom it saw first, working and answering (`client/swarm/work_ledger.py`): what the view's cap,
the slot order and every vote count instead of records, which cost an attacker one key each."""

from __future__ import annotations

import base58
from factories import peer_id, peer_record

from hetero_node.client.swarm import view
from hetero_node.client.swarm.work_ledger import (
    ALIVE_S,
    ANSWERED,
    ASKING,
    FORGET_S,
    SILENT,
    SILENT_S,
    WORK_MEMORY_S,
    WorkLedger,
)
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE

NOW = 10_000.0


def test_over_the_cap_working_peers_then_incumbents_stay_and_peer_id_order_buys_nothing() -> None:
    """The review's eclipse: 4,097 ids ground below every honest one left 0 of 5 honest records in the view."""
    ledger = WorkLedger()
    honest = [peer_id(f"h{i}") for i in range(5)]
    ledger.note_records([peer_record(f"h{i}") for i in range(5)], NOW - 100)
    ledger.note_work(honest[:2], NOW - 50)
    digits = base58.BITCOIN_ALPHABET.decode()
    ground = [f"111{digits[i // 58 // 58]}{digits[i // 58 % 58]}{digits[i % 58]}".ljust(32, "1") for i in range(4097)]
    assert len(set(ground)) == 4097 and max(ground) < min(honest)  # all below every honest id
    ledger.note_records([peer_record("x", peer_id=pid) for pid in ground], NOW)
    kept = ledger.keep([*ground, *honest], 4096, NOW)
    assert set(honest) <= set(kept) and set(kept[:2]) == set(honest[:2])  # working first, then the incumbents


def test_a_fresh_reader_keeps_an_order_nobody_can_aim_at() -> None:
    """A joiner has seen everyone at once: its order is its own salt's, so ids ground low gain nothing, and two
    readers cut a flood differently (an attacker cannot pick one set of ids every reader keeps)."""
    peers = [peer_id(f"p{i}") for i in range(1000)]
    a, b = WorkLedger(salt=b"a" * 16), WorkLedger(salt=b"b" * 16)
    kept_a, kept_b = set(a.keep(peers, 100, NOW)), set(b.keep(peers, 100, NOW))
    lowest = set(sorted(peers)[:100])
    assert len(kept_a & lowest) < 50 and kept_a != kept_b
    assert a.keep(peers, 100, NOW) == a.keep(list(reversed(peers)), 100, NOW)  # stable for one reader


def test_a_slot_claim_counts_from_when_this_reader_first_saw_it() -> None:
    """`claimed_at = 0` on a late record took the incumbent's slot in every reader's plan (review H2)."""
    ledger = WorkLedger()
    incumbent = peer_record("inc", role=ROLE_STAGE, vr=0, stage=1, claimed_at=NOW - 500, refresh_s=5.0)
    ledger.note_records([incumbent], NOW - 490)
    late = peer_record("late", role=ROLE_STAGE, vr=0, stage=1, claimed_at=0.0, refresh_s=5.0)
    ledger.note_records([incumbent, late], NOW)
    assert ledger.claimed_at(late) == NOW - 15 and ledger.claimed_at(incumbent) == NOW - 500
    dated = {r.peer_id: r.copy(update={"claimed_at": ledger.claimed_at(r)}) for r in (incumbent, late)}
    assert view.slot_holders(dated, 2)[(0, 1)] == incumbent.peer_id
    raced = peer_record("race", role=ROLE_STAGE, vr=0, stage=0, claimed_at=NOW - 4, refresh_s=5.0)
    ledger.note_records([raced], NOW)
    assert ledger.claimed_at(raced) == NOW - 4  # an honest claim read within its refreshes keeps its own time
    ledger.note_challenge(late.peer_id, SILENT, NOW)
    ledger.note_work([incumbent.peer_id], NOW)
    ledger.note_records([], NOW + FORGET_S + 1)
    assert not ledger.claims and not ledger.seen and not ledger.challenged  # long gone: a newcomer if it comes back
    ledger.note_records([], NOW + WORK_MEMORY_S + 1)
    assert not ledger.worked


def test_votes_count_working_peers_else_those_that_answered_else_nobody() -> None:
    """5 honest peers at round 5 and 4 record-only ids with one serving liar at round 6: counting records, the
    joiner followed the liar (review C2); counting voters, round 6 has one voice."""
    honest = {peer_id(f"h{i}"): peer_record(f"h{i}", role=ROLE_FULL, round=5, certified=5) for i in range(5)}
    sybils = {peer_id(f"s{i}"): peer_record(f"s{i}", role=ROLE_FULL, round=6, certified=6) for i in range(5)}
    records = {**honest, **sybils}
    assert view.swarm_round(records, me="") == 6
    ledger = WorkLedger()
    assert ledger.voters(records, NOW) is None  # nothing known: the caller challenges first
    for pid in records:
        ledger.note_challenge(
            pid, ANSWERED if pid in honest or pid == peer_id("s0") else SILENT, NOW
        )  # the liar runs a node
    assert view.swarm_round(ledger.voters(records, NOW), me="") == 5
    assert ledger.to_challenge(records, NOW + 1) == []  # answered and silent ones are not asked again at once
    assert set(ledger.to_challenge(records, NOW + SILENT_S + 1)) == set(sybils) - {peer_id("s0")}
    ledger.note_work(list(honest)[:3], NOW)
    assert set(ledger.voters(records, NOW)) == set(list(honest)[:3])  # work outranks mere liveness
    assert ledger.voters(records, NOW + WORK_MEMORY_S + 1) is None  # work and answers are remembered, not for ever


def test_our_own_work_is_no_vote_and_does_not_stop_the_count_at_ourselves() -> None:
    """A stage peer whose known workers were itself and a full replica that left counted itself alone: every vote it
    took had no other voice, and it never learnt that its sibling stage was rounds ahead (the VR stalled for good)."""
    me, sibling, gone = peer_id("s1"), peer_id("s0"), peer_id("r0")
    records = {pid: peer_record(name, role=ROLE_STAGE) for pid, name in ((me, "s1"), (sibling, "s0"))}
    ledger = WorkLedger()
    ledger.note_work([me, gone], NOW)  # the certificates of our shard: ourselves and the full replica
    assert ledger.voters(records, NOW, me) == {me: records[me]}  # nobody else is known: the caller challenges
    ledger.note_challenge(sibling, ANSWERED, NOW)
    assert set(ledger.voters(records, NOW, me)) == {me, sibling}  # those that answered, our own record kept
    ledger.note_work([sibling], NOW)
    assert set(ledger.voters(records, NOW + ALIVE_S + 1, me)) == {me, sibling}  # work lasts longer than an answer


def test_a_round_waits_for_every_peer_but_those_that_did_not_answer_their_last_challenge() -> None:
    """Thousands of full-replica records with no node behind them made a fresh swarm's first round wait for (and need
    the seal of) every one of them; a peer being asked, or never asked, still counts."""
    records = {peer_id(name): peer_record(name, role=ROLE_FULL) for name in ("a", "b", "c", "d")}
    ledger = WorkLedger()
    ledger.note_challenge(peer_id("b"), ASKING, NOW)
    ledger.note_challenge(peer_id("c"), SILENT, NOW)
    ledger.note_challenge(peer_id("d"), SILENT, NOW)
    ledger.note_work([peer_id("d")], NOW)  # it certified rounds with us: a failed dial does not drop it
    assert set(ledger.running(records, NOW)) == {peer_id("a"), peer_id("b"), peer_id("d")}
    assert set(ledger.running(records, NOW + SILENT_S + 1)) == set(records)  # asked again, it may answer
    assert ledger.to_challenge(records, NOW) == [peer_id("a")]


def test_a_vote_knows_which_answers_are_still_due() -> None:
    """`PeerRuntime.voters` waits on these before it counts: a liar and one of two honest donors that answered first
    were a vote the liar won (the upper median of two rounds is the larger)."""
    ledger = WorkLedger()
    for name, outcome in (("a", ASKING), ("b", ANSWERED), ("c", SILENT), ("d", ASKING)):
        ledger.note_challenge(peer_id(name), outcome, NOW)
    assert ledger.asking([peer_id(n) for n in "abc"], NOW) == {peer_id("a")}
    ledger.note_challenge(peer_id("a"), ANSWERED, NOW + 1)
    assert ledger.asking([peer_id(n) for n in "abcd"], NOW + 1) == {peer_id("d")}
    assert not ledger.asking([peer_id("d")], NOW + SILENT_S + 1)  # an answer that never came is no longer due


def test_claimants_of_a_contested_slot_are_challenged_first_and_silent_peers_are_kept_last() -> None:
    """A joiner reads an incumbent's claim and 16 ground-low claims dated 0 at once: the tie went to the lowest id
    (bench-sybil: "incumbent keeps its slot: no" for a joiner). Asking the contested slot's claimants first tells the
    planner, which drops silent peers (`running`), who holds it."""
    incumbent = peer_record("inc", role=ROLE_STAGE, vr=0, stage=1, claimed_at=NOW - 500)
    sybils = [peer_record(f"s{i}", role=ROLE_STAGE, vr=0, stage=1, claimed_at=0.0) for i in range(16)]
    others = [peer_record(f"f{i}", role=ROLE_FULL) for i in range(40)]
    others.append(peer_record("own", role=ROLE_STAGE, vr=1, stage=0))  # an uncontested slot
    records = {r.peer_id: r for r in [incumbent, *sybils, *others]}
    ledger = WorkLedger()
    ledger.note_records(records.values(), NOW)
    asked = ledger.to_challenge(records, NOW)
    contested = {incumbent.peer_id, *(r.peer_id for r in sybils)}
    assert set(asked[:17]) == contested and len(asked) == len(records)
    for sybil in sybils:
        ledger.note_challenge(sybil.peer_id, SILENT, NOW)
    ledger.note_challenge(incumbent.peer_id, ANSWERED, NOW)
    assert view.slot_holders(ledger.running(records, NOW), 2)[(0, 1)] == incumbent.peer_id
    assert view.slot_holders(records, 2)[(0, 1)] != incumbent.peer_id  # counting every record, a Sybil won the tie
    kept = ledger.keep(records, len(records) - len(sybils), NOW)
    assert set(kept) == records.keys() - contested | {incumbent.peer_id}  # over the cap, the silent ones went first
