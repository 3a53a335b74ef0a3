"""The round roster's rules (`protocol/roster.py`): a statement is in the round's set once more than half of the
quorum base sealed a set holding it, so readers of any subsets of one round's seals never decide two sets; the
decision does not depend on the order seals are read in; a late statement is left out while the rest still counts; a
late author sealing itself in, or seals from another start, decide nothing."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_node.protocol.roster import MAX_SEALED, Entry, Seal, decided, split, unanimous, undecidable, widest

START = "ab" * 32
OTHER_START = "cd" * 32
MAX_SIZE = 1 << 20


def entry(author: str, size: int = 100) -> Entry:
    return Entry(author, size, format(hash(author) & (2**256 - 1), "064x") if size else "", 10 * size)


def seal(sealer: str, authors: list[str], start: str = START) -> Seal:
    return Seal(sealer, 3, start, tuple(sorted(entry(a) for a in authors)), "")


PEERS = [f"Qm{i}x" for i in range(6)]


@st.composite
def honest_seals(draw: st.DrawFn) -> list[Seal]:
    """Each sealer lists itself and a random subset of the others (sometimes from another start): what members see
    of an honest round."""
    sealers = draw(st.lists(st.sampled_from(PEERS), min_size=1, max_size=len(PEERS), unique=True))
    return [
        seal(s, sorted({s, *draw(st.lists(st.sampled_from(PEERS), max_size=len(PEERS), unique=True))}),
             draw(st.sampled_from([START, START, START, OTHER_START])))
        for s in sealers
    ]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(honest_seals(), st.frozensets(st.sampled_from(PEERS), min_size=1), st.randoms())
def test_every_reading_order_gives_the_same_decision(
    seals: list[Seal], base: frozenset[str], rng: random.Random
) -> None:
    shuffled = list(seals)
    rng.shuffle(shuffled)
    assert decided(shuffled, START, base) == decided(seals, START, base)


@settings(max_examples=1000, deadline=None)
@given(honest_seals(), st.frozensets(st.sampled_from(PEERS), min_size=1), st.data())
def test_readers_of_any_subsets_of_the_seals_never_decide_two_sets(
    seals: list[Seal], base: frozenset[str], data: st.DataObject
) -> None:
    """The fork the kill soak found: members read different subsets of the round's seals (late, lost, slow reads);
    with one base and votes that never change, every member that decides at all decides the same set."""
    readers = data.draw(st.lists(st.lists(st.sampled_from(seals), unique_by=lambda s: s.sealer), min_size=2))
    sets = {won.entries for view in readers if (won := decided(view, START, base)) is not None}
    assert len(sets) <= 1
    everything = decided(seals, START, base)
    assert sets <= ({everything.entries} if everything is not None else set())  # more seals never undo a decision


@settings(max_examples=500, deadline=None)
@given(honest_seals(), st.frozensets(st.sampled_from(PEERS), min_size=1), st.data())
def test_undecidable_only_when_no_remaining_vote_could_decide(
    seals: list[Seal], base: frozenset[str], data: st.DataObject
) -> None:
    """Giving up early is safe: whatever the base members not heard from seal, nothing is decided."""
    if not undecidable(seals, START, base):
        return
    voted = {s.sealer for s in seals}
    late = [seal(p, data.draw(st.lists(st.sampled_from(PEERS), unique=True))) for p in sorted(base - voted)]
    assert decided([*seals, *late], START, base) is None


def test_without_a_certificate_two_bases_fork_by_majority_and_unanimity_decides_nothing() -> None:
    """The frozen-member test's round 0: r1 started later, so r0 and r2 counted a base of two and r1 one of three.
    By majority each base certifies its own set; unanimity over everyone the seals name certifies neither."""
    seals = [seal("r0", ["r0", "r2"]), seal("r2", ["r0", "r1", "r2"]), seal("r1", ["r0", "r1", "r2"])]
    early, late = frozenset({"r0", "r2"}), frozenset({"r0", "r1", "r2"})
    assert decided(seals, START, early) != decided(seals, START, late)  # two sets: the fork
    assert unanimous(seals, START, early) is None and unanimous(seals, START, late) is None and split(seals, START)
    agreed = [seal(m, ["r0", "r1", "r2"]) for m in ("r0", "r1", "r2")]
    assert unanimous(agreed, START, early) == unanimous(agreed, START, late) is not None
    assert unanimous(agreed[:2], START, early) is None  # r2 is named (a base member, an author) and not heard


@settings(max_examples=1000, deadline=None)
@given(honest_seals(), st.data())
def test_without_a_certificate_readers_of_any_bases_and_seals_never_decide_two_sets_that_share_an_author(
    seals: list[Seal], data: st.DataObject
) -> None:
    """Each reader reads its own subset of the seals and has its own base (the coming members its records show):
    any two that decide, and whose sets share an author, decide one set (that author sealed once)."""
    views = st.lists(st.sampled_from(seals), unique_by=lambda s: s.sealer)
    readers = data.draw(st.lists(st.tuples(views, st.frozensets(st.sampled_from(PEERS))), min_size=2))
    sets = [won.entries for view, base in readers if (won := unanimous(view, START, base)) is not None]
    for one in sets:
        for other in sets:
            assert one == other or not {e.author for e in one} & {e.author for e in other}


def test_a_statement_some_sealers_missed_is_left_out_and_the_rest_still_counts() -> None:
    """A restarted member's statement reached half the sealers: the first rule (a set sealed exactly by more than
    half) voided such rounds; now that statement is out and the others are the round's set."""
    base = frozenset({"QmA", "QmB", "QmC", "QmD"})
    seals = [seal("QmA", ["QmA", "QmB"]), seal("QmB", ["QmA", "QmB", "QmC"]), seal("QmC", ["QmA", "QmB", "QmC"])]
    assert decided(seals, START, base) is None and not undecidable(seals, START, base)  # QmD could bring QmC in
    every = [*seals, seal("QmD", ["QmA", "QmB", "QmD"])]
    won = decided(every, START, base)
    assert won is not None and won.authors == ["QmA", "QmB"] and won.sealers == base


def test_a_late_author_cannot_seal_itself_in() -> None:
    base = frozenset({"QmA", "QmB", "QmC"})
    on_time = [seal("QmA", ["QmA", "QmB"]), seal("QmB", ["QmA", "QmB"])]
    late = seal("QmL", ["QmA", "QmB", "QmL"])
    won = decided([*on_time, late], START, base)
    assert won is not None and won.authors == ["QmA", "QmB"] and won.sealers == {"QmA", "QmB"}
    assert decided(on_time, START, base) == won  # whether or not a member read the late seal


def test_seals_from_another_start_count_against_this_one() -> None:
    seals = [seal("QmA", ["QmA", "QmB"]), seal("QmB", ["QmA", "QmB"], start=OTHER_START)]
    assert decided(seals, START, frozenset({"QmA", "QmB"})) is None and undecidable(
        seals, START, frozenset({"QmA", "QmB"})
    )
    assert decided(seals[:1], START, frozenset({"QmA"})) is not None


def test_a_receive_only_member_is_a_member_with_no_message() -> None:
    both = (entry("QmA"), entry("QmR", 0))
    won = decided([Seal("QmA", 3, START, both, ""), Seal("QmR", 3, START, both, "")], START, frozenset({"QmA"}))
    assert won is not None
    assert [(e.author, e.size, e.digest) for e in won.entries] == [("QmA", 100, entry("QmA").digest), ("QmR", 0, "")]


@settings(max_examples=200, deadline=None)
@given(honest_seals())
def test_a_seal_survives_its_wire_format(seals: list[Seal]) -> None:
    for s in seals:
        assert Seal.parse(s.sealer, s.to_wire(), MAX_SIZE) == s


WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(WIRE_VALUES)
def test_any_value_read_from_the_dht_parses_or_is_refused_without_raising(raw: object) -> None:
    assert Seal.parse("QmA", raw, MAX_SIZE) is None or isinstance(Seal.parse("QmA", raw, MAX_SIZE), Seal)


def test_malformed_seals_are_refused() -> None:
    good = seal("QmA", ["QmA", "QmB"]).to_wire()
    assert Seal.parse("QmA", good, MAX_SIZE) is not None
    broken = [
        {**good, "round": -1},
        {**good, "round": True},
        {**good, "start_fp": "xyz"},
        {**good, "entries": [*good["entries"], good["entries"][0]]},  # one author twice
        {**good, "entries": [["QmA", MAX_SIZE + 1, "ab" * 32, 1]]},  # bigger than any message
        {**good, "entries": [["QmA", 0, "ab" * 32, 1]]},  # a receive-only entry with a digest
        {**good, "entries": [["Qm/../x", 5, "ab" * 32, 1]]},
        {**good, "entries": [["QmA", 5, "ab" * 32, 1]] * (MAX_SEALED + 1)},
        {**good, "extra": 1},
    ]
    assert [Seal.parse("QmA", raw, MAX_SIZE) for raw in broken] == [None] * len(broken)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.frozensets(st.sampled_from(PEERS)), min_size=1, max_size=5, unique=True))
def test_the_widest_set_holds_every_other_and_is_the_union(sets: list[frozenset[str]]) -> None:
    """What a heal converges on: the set holding all the others (sets only grow), or nothing when none does."""
    keyed = {f"fp{i}": s for i, s in enumerate(sets)}
    winner = widest(keyed)
    every = frozenset().union(*sets)
    if every in sets:
        assert winner is not None and keyed[winner] == every
        assert all(s <= keyed[winner] for s in sets)
    else:
        assert winner is None


def test_two_results_of_the_same_set_are_not_healed() -> None:
    """The same messages gave two fingerprints (a member's arithmetic differs): no rebuild settles that."""
    assert widest({"fp-a": frozenset({"a", "b"}), "fp-b": frozenset({"a", "b"})}) is None
    assert widest({"fp-a": frozenset({"a", "b"}), "fp-b": frozenset({"a"})}) == "fp-a"
    assert widest({"fp-a": frozenset({"a"}), "fp-b": frozenset({"b"})}) is None
