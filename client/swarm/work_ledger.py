"""Whom this node has seen, and whom it has seen working: what its votes and its view count instead of records.

A peer record costs one RSA key and no running node, so every rule that counted "a majority of records" fell to
record-only Sybils (the security review's C2, C5, N1, N7). A reader therefore remembers, from its own observation:

* **work**: the authors of a round it certified or took from the members that did (`Certificate.members`: their
  messages were stated, sealed by a quorum and verified), and the donors whose state it loaded and checked;
* **liveness**: peers that answered a challenge over an authenticated libp2p connection (`PeerRuntime.challenge`):
  a running node behind the key, which a record alone is not;
* **first sight**: when it first read each peer's record, and each slot claim: an incumbent is what this reader
  saw first, never what a record says of itself (`claimed_at = 0` took any slot; the lowest peer ids, which can be
  ground, took the whole view);
* **introduction**: the peers that the peer it joined through has seen running (`protocol/introduction.py`): a
  joiner has seen nobody work yet, and at 10⁵ record-only ids its own challenges would not find the running nodes
  for minutes.

Votes count working peers; a reader that knows none yet (a joiner, a fresh swarm's first round) counts those that
answered a challenge. Over the record cap, working peers are kept first, then those that answered or were
introduced, then incumbents, then an order this reader's secret salt fixes and nobody else can aim at, and peers
that did not answer their challenge last. Introduced peers are challenged first, then the claimants of a contested
slot: a reader that knows none of them counts the earliest claim it read, and a flood of claims dated 0 all read at
once ties with the incumbent's.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Mapping

from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_STAGE

FORGET_S = 600.0
"""A peer (or slot claim) absent from the records this long is forgotten: back, it is a newcomer again."""
WORK_MEMORY_S = 3600.0
"""How long a peer seen working counts as working: longer than any run of void rounds a partition causes."""
ALIVE_S = 120.0
"""How long an answered challenge counts; a silent peer (or one being asked) is not asked again for `SILENT_S`."""
SILENT_S = 60.0
INTRODUCED_S = 600.0
"""How long an introduction orders challenges and the view: by then a joiner has seen the peers work, or not."""
ASKING, ANSWERED, SILENT = "asking", "answered", "silent"


class WorkLedger:
    """This reader's memory of first sights, work and liveness (times are DHT seconds)."""

    def __init__(self, salt: bytes | None = None) -> None:
        self.salt = os.urandom(16) if salt is None else salt
        self.seen: dict[str, list[float]] = {}
        """peer id → [first read, last read] of its record."""
        self.claims: dict[tuple[str, int, int], list[float]] = {}
        """(peer id, vr, stage) → [first read, last read] of that slot claim."""
        self.worked: dict[str, float] = {}
        self.challenged: dict[str, tuple[float, str]] = {}
        """peer id → (when, how) its last challenge went: ASKING, ANSWERED or SILENT."""
        self.introduced: dict[str, float] = {}
        """peer id → when the peer we joined through last named it running."""

    # ------------------------------------------------------------------------------------------ observations

    def note_records(self, records: Iterable[PeerRecord], now: float) -> None:
        """Records read at `now`: first sights of peers and slot claims; long-absent ones, and judgements too old to
        count, are forgotten."""
        for record in records:
            self.seen.setdefault(record.peer_id, [now, now])[1] = now
            if record.role == ROLE_STAGE and record.vr >= 0:
                self.claims.setdefault((record.peer_id, record.vr, record.stage), [now, now])[1] = now
        for table in (self.seen, self.claims):
            for key in [k for k, (_, last) in table.items() if now - last > FORGET_S]:
                del table[key]
        for peer in [p for p, (at, _) in self.challenged.items() if now - at > max(ALIVE_S, SILENT_S)]:
            del self.challenged[peer]  # judgements this old count for nothing: a flood of ids cannot pile them up
        for peer in [p for p, at in self.worked.items() if now - at > WORK_MEMORY_S]:
            del self.worked[peer]
        for peer in [p for p, at in self.introduced.items() if now - at > INTRODUCED_S]:
            del self.introduced[peer]

    def note_work(self, peers: Iterable[str], now: float) -> None:
        """`peers` did verifiable work: authors of a certified round, a donor whose state checked out."""
        for peer in peers:
            self.worked[peer] = now

    def note_challenge(self, peer: str, outcome: str, now: float) -> None:
        """`outcome`: ASKING (a challenge went out), ANSWERED or SILENT."""
        self.challenged[peer] = (now, outcome)

    def note_introduced(self, peers: Iterable[str], now: float) -> None:
        """The peer we joined through named `peers` running (`protocol/introduction.py`)."""
        for peer in peers:
            self.introduced[peer] = now

    # ------------------------------------------------------------------------------------------ judgements

    def working(self, now: float) -> set[str]:
        return {peer for peer, at in dict(self.worked).items() if now - at <= WORK_MEMORY_S}

    def alive(self, now: float) -> set[str]:
        return self._challenged(ANSWERED, ALIVE_S, now)

    def silent(self, now: float) -> set[str]:
        return self._challenged(SILENT, SILENT_S, now)

    def introduction(self, now: float) -> list[str]:
        """Whom we introduce a joiner to: the peers we saw working, then those that answered a challenge."""
        working = sorted(self.working(now))
        return working + sorted(self.alive(now) - set(working))

    def _introduced(self, now: float) -> set[str]:
        return {peer for peer, at in self.introduced.items() if now - at <= INTRODUCED_S}

    def to_challenge(self, records: Mapping[str, PeerRecord], now: float) -> list[str]:
        """Of `records`' peers, those neither known alive nor asked lately: first those we were introduced to, then
        those claiming a slot another record claims too (which of them runs a node decides who holds it, and where a
        joiner goes), then in this reader's own order."""
        known = self.alive(now) | self.silent(now) | self._challenged(ASKING, SILENT_S, now)
        introduced = self._introduced(now)
        claims = Counter(slot for r in records.values() if (slot := _slot(r)) is not None)

        def order(peer: str) -> tuple[bool, bool, bytes]:
            slot = _slot(records[peer])
            return peer not in introduced, slot is None or claims[slot] < 2, self._rank(peer)

        return sorted((p for p in records if p not in known), key=order)

    def asking(self, peers: Iterable[str], now: float) -> set[str]:
        """Of `peers`, those asked lately whose answer has not come."""
        return self._challenged(ASKING, SILENT_S, now) & set(peers)

    def running(self, records: Mapping[str, PeerRecord], now: float) -> dict[str, PeerRecord]:
        """The records not known to have no node behind them: all but those whose peer did not answer its last
        challenge (and was not seen working). An unknown peer gets the benefit of the doubt until asked."""
        gone = self.silent(now) - self.working(now)
        return {pid: r for pid, r in records.items() if pid not in gone}

    def _challenged(self, outcome: str, within_s: float, now: float) -> set[str]:
        # a copy: challenges are answered (and this is read by an introduction) on the P2P loop's thread
        return {peer for peer, (at, how) in dict(self.challenged).items() if how == outcome and now - at <= within_s}

    def voters(self, records: Mapping[str, PeerRecord], now: float, me: str = "") -> dict[str, PeerRecord] | None:
        """The records whose peers count in a vote (a majority of fingerprints, the swarm's round): the working
        ones when any of them is in `records`, else those that answered a challenge; None when neither is known
        (`PeerRuntime.voters` challenges every peer not known either way first, when none is known working).
        Our own record (`me`) is always returned and never counts as knowing a working peer: a stage peer whose known
        workers were itself and a full replica that left counted itself alone, and never learnt its sibling's round."""
        own = {me: records[me]} if me in records else {}
        for known in (self.working(now), self.alive(now)):
            counted = {pid: r for pid, r in records.items() if pid in known and pid != me}
            if counted:
                return {**counted, **own}
        return own or None

    def keep(self, peers: Iterable[str], limit: int, now: float) -> list[str]:
        """At most `limit` of `peers`: working ones first, then those that answered a challenge or were introduced,
        then those first seen earliest (incumbents), then in an order this reader's salt fixes; those that did not
        answer their last challenge last. Never by peer id: ids can be ground low by anyone."""
        working = self.working(now)
        gone = self.silent(now) - working
        vouched = self.alive(now) | self._introduced(now)

        def order(peer: str) -> tuple[bool, bool, bool, float, bytes]:
            first = self.seen.get(peer, [now])[0]
            return peer not in working, peer in gone, peer not in vouched, first, self._rank(peer)

        return sorted(peers, key=order)[:limit]

    def claimed_at(self, record: PeerRecord) -> float:
        """When `record`'s slot claim counts as made: its own `claimed_at`, but no earlier than this reader first
        read the claim, less the few refreshes a claim takes to reach every reader. A claim dated before its own
        appearance (`claimed_at = 0`) cannot displace a holder this reader saw first."""
        first = self.claims.get((record.peer_id, record.vr, record.stage))
        if record.role != ROLE_STAGE or first is None:
            return record.claimed_at
        return max(record.claimed_at, first[0] - 3 * record.refresh_s)

    def _rank(self, peer: str) -> bytes:
        return hashlib.blake2b(peer.encode(), key=self.salt, digest_size=8).digest()


def _slot(record: PeerRecord) -> tuple[int, int] | None:
    """The (vr, stage) slot a stage peer's record claims (None: no claim)."""
    return (record.vr, record.stage) if record.role == ROLE_STAGE and record.vr >= 0 else None
