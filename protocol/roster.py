"""One contributor set per (round, shard), by construction: a round's roster, its members' seals, and their tally.

hivemind's matchmaking let its leader alone decide a group: a follower that timed out could lead a second group for
the same key while the first leader still counted it, and two groups then applied two aggregates (the fork of
`../shared/reference/round-agreement.md`). Here no group is decided by anyone; the round's truth is in the DHT:

1. **Statement.** Each member of round t of shard s stores what it brings, signed by its key (the DHT's owner
   subkeys, as peer records are): start fingerprint, message size and digest, tokens (size 0: it only receives).
2. **Seal.** Once every member the records show coming has a statement (or at the round's close), a member stores
   the set of statements it sees that start from the round's θ(t): its seal, signed the same way, **once**: a seal
   is a vote and is never changed.
3. **Tally.** Once the members it sealed have sealed too (or a short while later), a member counts who sealed each
   set (`tally`); the set sealed by more than half of the round's quorum base (`protocol/quorum.py`) is the round's
   (`decided`), and its authors are the next round's base.

Two sets cannot both hold more than half of one base's votes when nobody votes twice, so every member that decides
the round decides the same set, whatever seals it read and in whatever order; a member that read too few votes
decides nothing and takes the round's result from those that did (`client/roles/catch_up_driver.py: obtain`).
(The first version let a member re-seal a grown union; a re-sealed vote could then count in two quorums, and the
kill soak showed two members applying different sets of one round.) This module is the pure part (the wire format
and the rules); `client/outer/roster_round.py` moves it through the DHT.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from hetero_node.protocol.quorum import certifies
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
class Vote:
    """One set of statements of a round and who sealed exactly it."""

    entries: tuple[Entry, ...]
    sealers: frozenset[str]

    @property
    def authors(self) -> list[str]:
        return [e.author for e in self.entries]


def tally(seals: Iterable[Seal], start_fp: str) -> list[Vote]:
    """Every set sealed from `start_fp`, with its sealers, most sealers first (then by entries): the same list for
    every reader of the same seals, whatever order they come in."""
    sealers: dict[tuple[Entry, ...], set[str]] = defaultdict(set)
    for seal in seals:
        if seal.start_fp == start_fp:
            sealers[seal.entries].add(seal.sealer)
    return sorted((Vote(entries, frozenset(by)) for entries, by in sealers.items()),
                  key=lambda v: (-len(v.sealers), v.entries))  # fmt: skip


def decided(votes: list[Vote], base: frozenset[str]) -> Vote | None:
    """The set more than half of `base` sealed (at most one exists: nobody votes twice); None while there is none."""
    return next((vote for vote in votes if certifies(vote.sealers, base)), None)


def undecidable(votes: list[Vote], base: frozenset[str]) -> bool:
    """No set can reach a quorum of `base` any more, even if every base member that has not sealed yet seals it."""
    voted = frozenset().union(*(vote.sealers for vote in votes))
    best = max((len(vote.sealers & base) for vote in votes), default=0)
    return bool(base) and 2 * (best + len(base - voted)) <= len(base)


K = TypeVar("K")
T = TypeVar("T", bound=Hashable)


def widest(sets: Mapping[K, frozenset[T]]) -> K | None:
    """The key whose set contains every other set: the round its members heal to when they applied different sets
    (`client/outer/heal.py`). None when no set contains all the others (nobody holds the union), or when two keys hold
    the same set: the same messages gave two results, which no rebuild can settle."""
    if len(set(sets.values())) != len(sets):
        return None
    every = frozenset().union(*sets.values())
    return next((key for key, members in sets.items() if members == every), None)
