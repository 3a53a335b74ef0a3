"""One contributor set per (round, shard), by construction: a round's roster, its members' seals, and their tally.

hivemind's matchmaking let its leader alone decide a group: a follower that timed out could lead a second group for
the same key while the first leader still counted it, and two groups then applied two aggregates (the fork of
`../shared/reference/round-agreement.md`). Here no group is decided by anyone; the round's truth is in the DHT:

1. **Statement.** Each member of round t of shard s stores what it brings, signed by its key (the DHT's owner
   subkeys, as peer records are): start fingerprint, message size and digest, tokens (size 0: it only receives).
2. **Seal.** Once every member the records show coming has a statement (or at the round's close), a member stores
   the set of statements it sees that start from the round's θ(t): its seal, signed the same way, **once**: a seal
   is a vote and is never changed.
3. **Tally.** Once the members it sealed have sealed too (or a short while later), a member counts, for each
   statement, how many members of the round's quorum base (`protocol/quorum.py`) sealed a set holding it: it is
   **in** once more than half of the base did, **out** once that can no longer happen (its votes plus the base
   members not heard from are at most half). The round's set is every statement that is in (`decided`), once more
   than half of the base has sealed and every statement any of them listed is in or out; its authors are the next
   round's base. A round with no base from a certificate is decided only `unanimous`ly.

Every member that decides the round decides the same set, whatever seals it read and in whatever order, as long as
nobody votes twice and all use one base: a statement in for one reader has more than half of the base's votes, so
no reader sees it out; and a reader that heard from more than half of the base has seen every statement that is in
(two majorities share a member). A statement that reached some sealers late is out, and the rest of the set still
counts: the first rule (a set counted only when more than half sealed exactly it) voided every round in which a
restarted member's statement came late, and restarted peers took 2–5 rounds to contribute. A member that read too
few votes decides nothing and takes the round's result from those that did (`client/roles/catch_up_driver.py:
obtain`). (The first version let a member re-seal a grown union; a re-sealed vote could then count in two quorums,
and the kill soak showed two members applying different sets of one round. A member restarted mid-round keeps the
seal it stored before, `ShardSync.resumed_at`.) This module is the pure part (the wire format
and the rules); `client/outer/roster_round.py` moves it through the DHT.
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
class Vote:
    """A round's decided set of statements, and the base members whose seals the decision read."""

    entries: tuple[Entry, ...]
    sealers: frozenset[str]

    @property
    def authors(self) -> list[str]:
        return [e.author for e in self.entries]


def ballots(seals: Iterable[Seal], start_fp: str, base: frozenset[str]) -> dict[str, frozenset[Entry]]:
    """What each member of `base` that sealed voted for: the statements its seal lists, or none when it sealed
    another start (its vote counts against every statement from `start_fp`)."""
    return {
        x.sealer: frozenset(x.entries) if x.start_fp == start_fp else frozenset() for x in seals if x.sealer in base
    }


def standing(votes: dict[str, frozenset[Entry]], base: frozenset[str]) -> tuple[frozenset[Entry], frozenset[Entry]]:
    """(in, pending): the statements more than half of `base` voted for, and those still undecided (in neither that
    nor out: their votes plus the base members not heard from are more than half). Every other statement listed is
    out."""
    unheard = len(base) - len(votes)
    yes: dict[Entry, int] = defaultdict(int)
    for entries in votes.values():
        for entry in entries:
            yes[entry] += 1
    chosen = frozenset(e for e, n in yes.items() if 2 * n > len(base))
    pending = frozenset(e for e, n in yes.items() if e not in chosen and 2 * (n + unheard) > len(base))
    return chosen, pending


def decided(seals: Iterable[Seal], start_fp: str, base: frozenset[str]) -> Vote | None:
    """The round's set as these seals show it (the module docstring's rule): None while a statement is still
    undecided, or when no statement is in (nothing to apply)."""
    votes = ballots(seals, start_fp, base)
    chosen, pending = standing(votes, base)
    if pending or not chosen:  # (a statement in means more than half of the base sealed: all that is in is seen)
        return None
    return Vote(tuple(sorted(chosen)), frozenset(votes))


def undecidable(seals: Iterable[Seal], start_fp: str, base: frozenset[str]) -> bool:
    """No statement can be in any more, whatever the base members not heard from seal: every one listed is out, and
    those members are too few to bring one in alone."""
    votes = ballots(seals, start_fp, base)
    chosen, pending = standing(votes, base)
    return bool(base) and not chosen and not pending and 2 * (len(base) - len(votes)) <= len(base)


def _named(seals: Iterable[Seal], base: frozenset[str]) -> frozenset[str]:
    """Everyone a round without a quorum base must hear from: the base (the members the records show coming), every
    sealer and every author any seal lists."""
    return base | {x.sealer for x in seals} | {e.author for x in seals for e in x.entries}


def unanimous(seals: Iterable[Seal], start_fp: str, base: frozenset[str]) -> Vote | None:
    """The set of a round no certificate came before (a fresh swarm's first round, or a follower's after a void
    round): every member `_named` sealed exactly this set from `start_fp`; None otherwise.

    The majority rule needs one base for every reader, and without a certificate each member's base is the
    coming members its records show, which differ when members start apart (the frozen-member test's fork of round
    0: two members counted a base of 2, a third one of 3, and they certified two sets). Here two readers that decide
    share an author of their sets, who sealed once: their sets are one. Only members that never saw one another
    (a partition at the very start) could decide two."""
    seals = list(seals)
    by = {x.sealer: x for x in seals}
    voters = _named(seals, base)
    if not voters <= by.keys():
        return None
    sets = {frozenset(by[m].entries) if by[m].start_fp == start_fp else None for m in voters}
    if len(sets) != 1 or None in sets:
        return None
    (entries,) = sets
    return Vote(tuple(sorted(entries)), voters) if entries else None


def split(seals: Iterable[Seal], start_fp: str) -> bool:
    """Two seals differ (or one is from another start): `unanimous` can never decide the round."""
    return len({frozenset(x.entries) if x.start_fp == start_fp else None for x in seals}) > 1


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
