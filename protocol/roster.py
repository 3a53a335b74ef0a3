"""One contributor set per (round, shard), by construction: a round's roster, its members' seals, and their union.

hivemind's matchmaking let its leader alone decide a group: a follower that timed out could lead a second group for
the same key while the first leader still counted it, and two groups then applied two aggregates (the fork of
`../shared/reference/round-agreement.md`). Here no group is decided by anyone; the round's truth is in the DHT:

1. **Statement.** Each member of round t of shard s stores what it brings, signed by its key (the DHT's owner
   subkeys, as peer records are): start fingerprint, message size and digest, tokens (size 0: it only receives).
2. **Seal.** Once every member the records show coming has a statement (or at the round's close), a member stores
   the set of statements it sees that start from the round's θ(t): its seal, signed the same way.
3. **Union.** Once the members it sealed have sealed too (or a short while later), a member reads the seals and
   aggregates their union (`union`), less any author seen with two different statements (it equivocated) and less
   any statement only its own author lists (a late or lying author cannot force itself in).

Every member that reads the same seals computes the same set, in any order it reads them; more seals never take an
honest statement out. A member that read fewer seals than another (it gave up waiting for a slow sealer) applies a
smaller set; the next round shows it (start fingerprints differ) and heals it with `widest`: the set that contains
all the others is the round's, and members holding a smaller one rebuild the round from it (`client/outer/heal.py`).
Sets only grow, so there is no tie to break. This module is the pure part (the wire format and the rules);
`client/outer/roster_round.py` moves it through the DHT.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from hetero_node.protocol.round_wire import HEX, MAX_TOKENS, PROOF

MAX_SEALED = 512
"""Entries one seal may list: ~130 bytes each keeps a seal far below hivemind's ~64 KiB control-message limit
(ARCHITECTURE.md, pitfall A)."""
MAX_ROUND = (1 << 31) - 1
PEER_ID_CHARS = 128
"""A base58 peer id is 46 characters for hetero-node's RSA keys; anything far longer is not one."""


@dataclass(frozen=True, order=True)
class Entry:
    """One author's statement for a round as a seal lists it."""

    author: str
    size: int
    """Bytes of its message (0: it only receives the round's result)."""
    digest: str
    tokens: int

    def to_wire(self) -> list[Any]:
        return [self.author, self.size, self.digest, self.tokens]

    @classmethod
    def parse(cls, raw: Any, max_size: int) -> Entry | None:
        if not (isinstance(raw, list) and len(raw) == 4):
            return None
        author, size, digest, tokens = raw
        if not (isinstance(author, str) and 0 < len(author) <= PEER_ID_CHARS and author.isalnum()):
            return None
        if type(size) is not int or type(tokens) is not int:
            return None
        if not (0 <= size <= max_size and 0 <= tokens <= MAX_TOKENS):
            return None
        if not (isinstance(digest, str) and (digest == "" if size == 0 else bool(HEX.match(digest)))):
            return None
        return cls(author, size, digest, tokens)


@dataclass(frozen=True)
class Seal:
    """The statements of round `round` that one member (`sealer`) saw start from `start_fp`."""

    sealer: str
    round: int
    start_fp: str
    entries: tuple[Entry, ...]
    proof: str
    """The sealer's member proof in a private swarm ("" in a public one)."""

    def to_wire(self) -> dict[str, Any]:
        entries = [e.to_wire() for e in self.entries]
        return {"round": self.round, "start_fp": self.start_fp, "entries": entries, "proof": self.proof}

    @classmethod
    def parse(cls, sealer: str, raw: Any, max_size: int) -> Seal | None:
        """A seal read from the DHT (its `sealer` is the key that signed it), strictly checked; None if malformed:
        one bad seal must never crash a member, it is left out."""
        if not (isinstance(raw, dict) and set(raw) == {"round", "start_fp", "entries", "proof"}):
            return None
        round_, start_fp, raw_entries, proof = raw["round"], raw["start_fp"], raw["entries"], raw["proof"]
        if type(round_) is not int or not (0 <= round_ <= MAX_ROUND):
            return None
        if not (isinstance(start_fp, str) and HEX.match(start_fp)) or not (
            isinstance(proof, str) and PROOF.match(proof)
        ):
            return None
        if not (isinstance(raw_entries, list) and len(raw_entries) <= MAX_SEALED):
            return None
        entries = [Entry.parse(e, max_size) for e in raw_entries]
        if any(e is None for e in entries) or len({e.author for e in entries}) != len(entries):  # type: ignore[union-attr]
            return None
        return cls(sealer, round_, start_fp, tuple(sorted(entries)), proof)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Union:
    """What a member aggregates for a round: the counted entries in author order, and who was left out why."""

    entries: tuple[Entry, ...]
    equivocators: frozenset[str]
    self_listed: frozenset[str]
    """Authors whose statement no member but themselves listed."""

    @property
    def authors(self) -> list[str]:
        return [e.author for e in self.entries]


def union(seals: Iterable[Seal], start_fp: str) -> Union:
    """The round's contributor set from the seals that start from `start_fp` (see the module docstring): the same for
    every reader of the same seals, whatever order they come in."""
    listed_by: dict[Entry, set[str]] = defaultdict(set)
    for seal in seals:
        if seal.start_fp == start_fp:
            for entry in seal.entries:
                listed_by[entry].add(seal.sealer)
    versions: dict[str, set[Entry]] = defaultdict(set)
    for entry in listed_by:
        versions[entry.author].add(entry)
    equivocators = frozenset(author for author, seen in versions.items() if len(seen) > 1)
    self_listed = frozenset(
        e.author for e, sealers in listed_by.items() if e.author not in equivocators and sealers == {e.author}
    )
    counted = sorted(e for e in listed_by if e.author not in equivocators and e.author not in self_listed)
    return Union(tuple(counted), equivocators, self_listed)


def agreeing(seals: Iterable[Seal], counted: Union, start_fp: str) -> frozenset[str]:
    """The sealers whose seal lists exactly the round's union: what a certificate counts (`protocol/quorum.py`).
    Two members that certify each hold more than half of one base, so they share a sealer; its seal only grows
    (a member re-seals its union), so the sets they certified are nested, and the next round joins them."""
    return frozenset(s.sealer for s in seals if s.start_fp == start_fp and s.entries == counted.entries)


K = TypeVar("K")
T = TypeVar("T", bound=Hashable)


def widest(sets: Mapping[K, frozenset[T]]) -> K | None:
    """The key whose set contains every other set: the round its members converge on when they applied different
    sets (sets only grow). None when no set contains all the others (nobody holds the union), or when two keys hold
    the same set: the same messages gave two results, which no rebuild can settle."""
    if len(set(sets.values())) != len(sets):
        return None
    every = frozenset().union(*sets.values())
    return next((key for key, members in sets.items() if members == every), None)
