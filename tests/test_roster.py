"""The round roster's rules (`protocol/roster.py`): the union of seals is one set whatever order members read them
in, more honest seals never shrink it, and neither a late author nor an equivocating one decides it."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_node.protocol.roster import MAX_SEALED, Entry, Seal, union, widest

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
    """Each sealer lists itself and a random subset of the others: what members see of an honest round."""
    sealers = draw(st.lists(st.sampled_from(PEERS), min_size=1, max_size=len(PEERS), unique=True))
    return [
        seal(s, sorted({s, *draw(st.lists(st.sampled_from(PEERS), max_size=len(PEERS), unique=True))})) for s in sealers
    ]


@settings(max_examples=300, deadline=None)
@given(honest_seals(), st.randoms())
def test_every_reading_order_gives_the_same_set(seals: list[Seal], rng: random.Random) -> None:
    shuffled = list(seals)
    rng.shuffle(shuffled)
    assert union(shuffled, START) == union(seals, START)


@settings(max_examples=300, deadline=None)
@given(honest_seals(), honest_seals())
def test_more_honest_seals_never_take_a_statement_out(seen: list[Seal], later: list[Seal]) -> None:
    before = set(union(seen, START).entries)
    more = {s.sealer: s for s in seen} | {s.sealer: s for s in later if s.sealer not in {x.sealer for x in seen}}
    assert before <= set(union(list(more.values()), START).entries)


@settings(max_examples=300, deadline=None)
@given(honest_seals())
def test_a_statement_counts_only_if_someone_else_listed_it(seals: list[Seal]) -> None:
    agreed = union(seals, START)
    for e in agreed.entries:
        assert any(e in s.entries and s.sealer != e.author for s in seals)
    assert set(agreed.authors).isdisjoint(agreed.self_listed)


def test_a_late_author_cannot_seal_itself_in() -> None:
    on_time = [seal("QmA", ["QmA", "QmB"]), seal("QmB", ["QmA", "QmB"])]
    late = seal("QmL", ["QmA", "QmB", "QmL"])
    agreed = union([*on_time, late], START)
    assert agreed.authors == ["QmA", "QmB"] and agreed.self_listed == {"QmL"}
    assert union(on_time, START).entries == agreed.entries  # whether or not a member read the late seal


def test_an_author_with_two_statements_is_left_out_and_the_others_stay() -> None:
    honest = [seal("QmA", ["QmA", "QmB", "QmE"]), seal("QmB", ["QmA", "QmB"])]
    second = Seal("QmC", 3, START, (entry("QmA"), entry("QmB"), Entry("QmE", 7, "ef" * 32, 1)), "")
    agreed = union([*honest, second], START)
    assert agreed.equivocators == {"QmE"} and agreed.authors == ["QmA", "QmB"]


def test_seals_from_another_start_do_not_count() -> None:
    agreed = union([seal("QmA", ["QmA", "QmB"]), seal("QmB", ["QmA", "QmB"], start=OTHER_START)], START)
    assert agreed.authors == ["QmB"]  # only QmA's seal starts from START, and it lists QmB (and itself)


def test_a_receive_only_member_is_a_member_with_no_message() -> None:
    both = (entry("QmA"), entry("QmR", 0))
    agreed = union([Seal("QmA", 3, START, both, ""), Seal("QmR", 3, START, both, "")], START)
    assert [(e.author, e.size, e.digest) for e in agreed.entries] == [("QmA", 100, entry("QmA").digest), ("QmR", 0, "")]


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
