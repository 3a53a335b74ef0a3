"""One parameter shard's outer round across peers: agree on a group, exchange the messages, compute the same θ(t+1).

How a round's messages travel (the design choice the README explains):

1. Each member encodes its contribution with the run's outer method (`protocol/outer_methods.py`: SparseLoCo
   through error feedback, or DiLoCo's dense Δ) and serves the message from memory. A member that trained too
   little this round (or whose pipeline broke) joins with no message: it receives, so it still ends the round
   holding θ(t+1).
2. The round's contributor set comes from the DHT, not from a group leader (`roster_round.py`,
   `protocol/roster.py`): each member stores a signed statement (round, start fingerprint, message size and
   digest, tokens trained); once every member the records show in round t has one (a ready barrier), or at the
   round's deadline plus a grace period, each member seals the statements it sees (once: a seal is a vote; a
   statement claiming more tokens than its author's advertised speed allows is left out: `protocol/claims.py`),
   and the set more than half of the round's quorum base sealed is the round's. No round can have two sets.
3. Every member computes the same subset of at most K contributors (`--max-contributors`, a new subset each
   round: `protocol/flat_exchange.py`), fetches each selected message over a P2P stream from its parent in that
   message's relay tree (the author or a member that already verified it; then any member holding a copy; a
   member that cannot get one computes nothing and takes the round's result from the others), checks size and
   digest, decodes it strictly, and combines them weighted by tokens, in peer-id order: every member gets the
   same bits without trusting any peer's arithmetic. A contributor left out keeps its Δ in its error feedback.
4. Each member then serves the round's manifest (who contributed, with which digests and weights, the start and
   result fingerprints) and re-serves the messages, so a member that missed the group can rebuild θ(t+1) from
   them (`catch_up.py`) instead of downloading the model.

The metadata's and the manifest's formats, and the blob kinds, are `protocol/round_wire.py`; this module is the
transport and the order of events.

Each member downloads at most K messages and uploads each at most twice (FANOUT; a fast member more where slow
ones are most of the group), i.e. ≤ K·0.0273·N bytes down and
≤ 2K·0.0273·N up per round for SparseLoCo whatever the group's size R (all-to-all: (R−1)·0.0273·N each way).
A butterfly all-reduce of the same sparse vectors would return the union of all selections
(denser with each peer) and lose the 2-bit value codes; and none of hivemind's partial-average failure modes can
silently change the result here: a message is either received whole and verified, or that peer computes nothing
and takes the round's result from the members that got every message (only bytes that fail to decode are dropped,
by every member alike). (hivemind's butterfly all-reduce of dense tensors was
tried first for DiLoCo: each peer ends with own + (mean − own), which differs from the mean in the last bit from
peer to peer, so replicas never agreed.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.heal import Applied, heal
from hetero_node.client.outer.reveal import RevealGate
from hetero_node.client.outer.roster_round import RosterRound, round_certificate
from hetero_node.client.swarm.runtime import PeerRuntime, not_served
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.admission import loss_admitted, probe_draw
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.flat_exchange import (
    contributor_limit,
    relay_parent,
    selected_contributors,
    selection_seed,
    slow_uplinks,
)
from hetero_node.protocol.outer_methods import OuterMethod, outer_method
from hetero_node.protocol.quorum import Certificate, certifies, quorum_base
from hetero_node.protocol.roster import Entry, Seal, decided
from hetero_node.protocol.round_wire import MANIFEST, PAYLOAD, GroupMeta, digest, encode_manifest, message_kind
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.swarm_key import member_proof

logger = logging.getLogger(__name__)

RELAY_PATIENCE = 0.5
"""Share of the fetch deadline a member waits for its relay parent to hold a message before asking its author."""
RELAY_POLL_S = 0.05
"""First pause between asking a relay parent that does not hold the message yet (doubling up to 1 s)."""
MEMBER_FETCH_S = 5.0
"""One try at a lost message from another member of the round: it is small and that member already holds it."""
VOTES_KEPT = 64
"""Rounds our seals are remembered for: a member comes back at most a few rounds (a round certified late)."""

Drops = Callable[[int, list[Tensor], Iterable[tuple[str, list[Tensor]]]], dict[str, float]]
"""A loss judge (`roles/loss_judge.py`): (the probe draw, the shard's θ(t), each author with the shard's θ(t+1) from
that author's step alone, made one at a time) → author → how much that step lowers the probe loss."""


class Unreachable(Exception):
    """A selected message could not be had from its author nor from any member of the round (or it is ours from
    before a restart): whether the others got it is unknown, so this member takes θ(t+1) from the round's certified
    result instead of computing another."""


class Received(NamedTuple):
    """A verified, decoded message and what the group knows of it."""

    name: str
    message: Any
    tokens: int
    digest: str


class Fetched(NamedTuple):
    """A message's verified bytes, whether they came from a relay parent rather than their author, and whether their
    download started before the round's set was sealed (`ShardSync._prefetch`)."""

    data: bytes
    relayed: bool
    early: bool = False


@dataclass
class Traffic:
    """What fetching a round's messages cost this member."""

    received: int = 0
    relayed: int = 0
    prefetched: int = 0


class Member(NamedTuple):
    """A group member as every member sees it: sorted by `name` (its peer id), the canonical order."""

    name: str
    peer_id: Any
    meta: GroupMeta


@dataclass
class PendingRound:
    """One shard's round between `begin` and `finish`: what this member brought, and when the round closes."""

    round: int
    start: list[Tensor]
    """θ(t) of the shard: what the outer step updates."""
    meta: GroupMeta
    payload: bytes | None
    snapshot: Any = None
    """The method's private state before encoding (restored when the contribution is dropped)."""
    roster: RosterRound | None = None
    """Set by `begin` (None: we take no part in the round's set and get θ(t+1) another way)."""
    expected: int = 0
    close: float = 0.0
    """DHT time by which the round's statements are in: seal what is there then."""
    base: frozenset[str] = frozenset()
    """The round's quorum base (`protocol/quorum.py`): more than half of these must seal it for it to count."""
    certified_base: bool = True
    """The base is a certificate's; else (none came before) the coming members, and the round needs them all."""


@dataclass
class ShardOutcome:
    """What one shard's round produced and cost."""

    new_tensors: list[Tensor] | None
    """θ(t+1) of the shard, or None when this member must get it another way (it missed the group)."""
    group_size: int = 0
    contributors: int = 0
    contributed: bool = False
    """This member's message is part of the aggregate."""
    dropped: list[str] = field(default_factory=list)
    bytes_received: int = 0
    deferred: bool = False
    """This member brought a valid message the round did not select (`--max-contributors`) or its loss verdicts
    refused (`--admission loss`): its Δ stays owed."""
    messages_relayed: int = 0
    """Messages it got from a relay parent rather than from their author."""
    messages_prefetched: int = 0
    """Messages whose download from their author started while the round was being sealed."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds this shard's round spent agreeing on its set, fetching and in the outer step (`RoundRecord.phases_s`)."""
    uncertified: bool = False
    """The round's seals came from no majority of its quorum base: we void it, whatever the seals we read say."""
    sealed_by: frozenset[str] = frozenset()
    """Who sealed the round as we read it (an uncertified round: they are where we are, not worth waiting for)."""


def majority_fingerprint(fingerprints: list[str], vouched: Callable[[], str | None] = lambda: None) -> str:
    """The most common start fingerprint of a group; "" (nobody is included) when a tie cannot be broken.

    A tie is broken only by outside evidence, `vouched()`: the fingerprint a strict majority of the swarm's records
    hold at that round. Never by the fingerprints themselves: a rule like "the smallest string wins" lets a liar
    claiming 000… win every group of two."""
    counts = Counter(fingerprints)
    best = max(counts.values())
    tied = [fp for fp, n in counts.items() if n == best]
    if len(tied) == 1:
        return tied[0]
    outside = vouched()
    return outside if outside in tied else ""


class ShardSync:
    """A replica's membership in one shard's averaging group (transport only: the arithmetic is `self.method`)."""

    def __init__(
        self,
        runtime: PeerRuntime,
        run: RunConfig,
        shard: int,
        shapes: list[tuple[int, ...]],
        timeouts: SyncTimeouts,
        stop: threading.Event,
        device: torch.device | str = "cpu",
    ) -> None:
        self.runtime, self.run, self.shard, self.shapes, self.timeouts = runtime, run, shard, shapes, timeouts
        self.stop = stop
        """The node is leaving: every wait ends at once (its DHT and p2pd may already be gone)."""
        self.method: OuterMethod = outer_method(run, shapes, device)
        """Its arithmetic and outer state on `device`, the shard's parameters' (see `protocol/outer_methods.py`)."""
        self.state_bytes = sum(4 * math.prod(s) for s in shapes)
        self.small_messages = 4 * self.method.max_message_bytes <= self.state_bytes
        """Messages are far smaller than the shard's state (SparseLoCo), so the round's messages are re-served and
        a late member rebuilds θ(t+1) from them; dense ones (DiLoCo) are not: a late member loads the state."""
        self.heals = self.small_messages and not run.pipeline.compressed
        """A round applied with a smaller set can be rebuilt inside the next one (`heal`): its messages are re-served,
        and θ(t+1) is the outer step's result alone. In a subspace run the replica's upkeep (drift transfer, start
        projection) transforms θ(t+1) and T_fixed after the step, which a rebuild inside the round cannot redo: there
        a member that applied another set catches up between rounds, where the upkeep runs."""
        self.applied: Applied | None = None
        """The last round this member applied from its own set (where it `heals`): what `heal` starts from. Set to
        None whenever θ comes from elsewhere (a state load, a catch-up)."""
        self._certificate: Certificate | None = None
        self.resumed_at: int | None = None
        """The round our checkpoint resumed at: we may have sealed it and later ones before the restart, and a seal is
        a vote that never changes (a second one could count in two quorums), so from that round on, until one holds
        no seal of ours, a round keeps the seal the DHT holds."""
        self.votes: dict[int, Seal] = {}
        """The seals we cast, by round (the last `VOTES_KEPT`): a member that comes back to a round it sealed keeps
        that vote. It comes back after rebuilding a round others certified late: it had voided that round and sealed
        the next ones from the voided θ; sealing them again let two members each certify rounds the other had
        voided, and in CI the two chased each other to the end of the run."""
        self.prefetched: dict[tuple[int, str], concurrent.futures.Future[tuple[int, bytes]]] = {}
        """Messages whose download started while the round was still being sealed, by (round, digest): the first
        hop of a relay tree, from an author on a slow link, need not wait for the seals (`_prefetch`)."""
        self.follows = False
        """Our θ came from a state whose round's certificate neither the DHT nor a manifest told us: our base may not
        be the deciders', so we state and seal but take each round's result from the members that decide it, until
        a record or manifest tells us the certificate (`adopt`). Deciding against another base could certify a
        second set."""
        self.reveal = RevealGate(self.roster, lambda: -1 if self.certificate is None else self.certificate.round)
        """Our messages of a round go only to peers that stated theirs, until the round is decided (`reveal.py`)."""
        self.admits_by_loss = run.outer.admission == "loss"
        """The round counts only the messages its members' loss verdicts admit (`protocol/admission.py`)."""
        self.loss_judge: Drops | None = None
        """How we score a round's messages under `admits_by_loss` (`roles/loss_judge.py`); None: we cannot (a
        pipeline stage), and take the others' verdicts."""
        self.judged: dict[int, Seal] = {}
        """The loss verdicts we cast, by round (the last `VOTES_KEPT`): a verdict is a vote, cast once (`_verdict`)."""

    @property
    def certificate(self) -> Certificate | None:
        """The last round of this shard we certified, or whose result we took from members that did (their
        manifest states it): its authors are the next round's quorum base."""
        return self._certificate

    @certificate.setter
    def certificate(self, value: Certificate | None) -> None:
        """Its authors did verifiable work: this node's votes count them from now on (`work_ledger.py`)."""
        from hivemind.utils import get_dht_time

        self._certificate = value
        if value is not None:
            self.runtime.work.note_work(value.members, get_dht_time())

    @property
    def me(self) -> str:
        return str(self.runtime.peer_id)

    @property
    def proof(self) -> str:
        return member_proof(self.runtime.swarm_key, self.me)

    # -------------------------------------------------------------------------------------------------- begin

    def contribution(
        self, round_: int, start: list[Tensor], start_fp: str, deltas: list[Tensor] | None, tokens: int
    ) -> PendingRound:
        """Encode this round's message (`deltas` None: receive only) and serve it; PayloadError when Δ is unusable
        (nothing changed then)."""
        if deltas is None or tokens <= 0:
            return PendingRound(round_, start, GroupMeta(round_, start_fp, 0, "", 0, self.proof), None)
        encoded = self.method.encode(deltas)
        meta = GroupMeta(round_, start_fp, len(encoded.payload), digest(encoded.payload), tokens, self.proof)
        self.runtime.publish(PAYLOAD, self.shard, round_, encoded.payload)
        return PendingRound(round_, start, meta, encoded.payload, encoded.snapshot)

    def roster(self, round_: int) -> RosterRound:
        """Round `round_` of this shard in the DHT: its statements, seals and certificates."""
        return RosterRound(self.runtime, self.run.run_id, self.shard, round_, self.method.max_message_bytes, self.stop)

    def quorum(self, round_: int, coming: list[str], live: list[str]) -> frozenset[str]:
        """The quorum base of round `round_` (`protocol/quorum.py`), from our last certificate, or without one from
        the members the records show `coming`; `live`: the shard's members that have a record."""
        since = round_ - self.certificate.round - 1 if self.certificate is not None else 0
        return quorum_base(self.certificate, since, self.timeouts.quorum_patience, [*live, self.me], [*coming, self.me])

    def begin(self, pending: PendingRound, coming: list[str], live: list[str], scheduled_time: float) -> None:
        """Store our statement for the round: its set is sealed once every member `coming` has one (at least two),
        or at `scheduled_time` (DHT time) with whoever has; in the swarm's first round at least --round-timeout-s
        from now."""
        pending.roster = self.roster(pending.round)
        self.runtime.reveal_gates[self.shard] = self.reveal.allows  # the shard's messages are ours from now on
        # without a certificate the round needs every member's seal on one set (`unanimous`): wait for the statements
        # of every member with a record, not only those the records show coming (one still starting up is not yet)
        waited = coming if self.certificate is not None else {*coming, *live}
        if self.certificate is None and not self.follows:
            # the swarm's first round: a member that seals before a slower member's statement is in votes for
            # another set than that member, and the round is void for all (on a GPU, full replicas finished round 0
            # in 2 s and sealed by their deadline's grace, its stage peers trained H steps in 8 s); wait for them
            from hivemind.utils import get_dht_time

            scheduled_time = max(scheduled_time, get_dht_time() + self.timeouts.round_timeout_s)
        pending.expected, pending.close = max(2, len(waited)), scheduled_time
        if self.follows:  # the deciders may have stored the certificate we lack since (one DHT read, followers only)
            stored = round_certificate(self.runtime, self.run.run_id, self.shard, pending.round - 1,
                                       self.method.max_message_bytes, self.stop, wait_s=0.0)  # fmt: skip
            if stored is not None:
                self.adopt(stored)
        pending.base = self.quorum(pending.round, coming, live)
        pending.certified_base = self.certificate is not None
        since = "none" if self.certificate is None else self.certificate.round
        logger.info("shard %d round %d: %d members expected, sealing by DHT time %.1f; base %s (certificate of round "
                    "%s)", self.shard, pending.round, pending.expected, scheduled_time,
                    ",".join(sorted(m[-6:] for m in pending.base)), since)  # fmt: skip
        pending.roster.state(pending.meta)

    def drop(self, pending: PendingRound) -> None:
        """The round failed for us: forget our Δ and restore the method's private state (error feedback)."""
        if pending.payload is not None:
            self.method.restore(pending.snapshot)
            pending.payload = None

    def defer(self, pending: PendingRound) -> None:
        """The round aggregated others' messages but not ours: our Δ stays owed in the method's private state."""
        if pending.payload is not None:
            self.method.defer(pending.snapshot, pending.payload)
            pending.payload = None

    # ------------------------------------------------------------------------------------------------- finish

    def finish(
        self,
        pending: PendingRound,
        swarm_moved_on: Callable[[], bool],
        vouched: Callable[[], str | None],
        may_seal: Callable[[frozenset[str]], bool] | None = None,
        implausible: Callable[[dict[str, int]], set[str]] | None = None,
    ) -> ShardOutcome:
        """Agree on the round's contributor set, then compute θ(t+1) exactly as every other member does (safe in a
        worker thread).

        While the statements come in, `swarm_moved_on` is polled: once the others finished this round without us,
        waiting longer cannot help. `vouched` breaks a tie of start fingerprints (see `majority_fingerprint`).
        `may_seal` says whether members of the base that have not sealed may still (up to --round-timeout-s).
        `implausible` names the authors whose claimed tokens their advertised speed does not allow
        (`protocol/claims.py`): our seal leaves them out.
        """
        from hivemind.utils import get_dht_time

        roster = pending.roster
        if roster is None:  # `begin` was not called: we take no part
            return ShardOutcome(new_tensors=None)
        started = time.perf_counter()
        statements = roster.await_statements(pending.expected, lambda: pending.close - get_dht_time(), swarm_moved_on)
        if statements is None:
            return ShardOutcome(new_tensors=None)
        self.reveal.note_statements(pending.round, set(statements))
        statements.setdefault(self.me, pending.meta)  # our own, whether or not the DHT showed it to us yet
        healed = heal(self, pending, statements)  # round t−1 applied with different sets: the wider one wins
        if healed is not None:
            majority, counted = healed.start_fp, healed.counted
        else:
            majority = majority_fingerprint([meta.start_fp for meta in statements.values()], vouched)
            counted = frozenset({majority})
        if pending.meta.start_fp != majority:
            logger.error(
                "shard %d round %d: my start fingerprint %s differs from the round's %s; catching up from peers",
                self.shard, pending.round, pending.meta.start_fp, majority or "(a tie no record majority breaks)",
            )  # fmt: skip
            return ShardOutcome(new_tensors=None, group_size=len(statements))
        refused = self._implausible(pending.round, statements, implausible)
        entries = [
            Entry(a, m.size, m.digest, m.tokens)
            for a, m in statements.items()
            if m.start_fp in counted and a not in refused
        ]
        self._prefetch(pending, majority, entries)
        ours = Seal(self.me, pending.round, majority, tuple(sorted(entries)), self.proof)
        owed = pending.payload is not None  # unless the round aggregates it, our Δ stays in the error feedback
        earlier = self._earlier_vote(pending.round, roster)
        if earlier is None:  # not knowing our vote, we cast none: the result comes from those that decide
            return ShardOutcome(new_tensors=None, group_size=len(entries), deferred=owed)
        if self.me in earlier:
            logger.info("shard %d round %d: keeping the seal we cast before (restarting or catching up)", self.shard,
                        pending.round)  # fmt: skip
            ours = earlier[self.me]
            if ours.start_fp != majority:  # that vote was for another start: this one's set comes from others
                return ShardOutcome(new_tensors=None, group_size=len(entries), deferred=owed)
        else:
            roster.seal(ours)
        self._remember(ours)
        if self.follows:  # our seal counts for the deciders; the result comes from them (`obtain`)
            logger.info("shard %d round %d: sealed; taking the result from the members that decide it (our quorum "
                        "base is not known yet)", self.shard, pending.round)  # fmt: skip
            return ShardOutcome(new_tensors=None, group_size=len(entries), deferred=owed)
        # with a certificate's base the decided set is the same whichever seals decide it (`protocol/roster.py`)
        decides = (lambda seals: decided(seals, majority, pending.base) is not None) if pending.certified_base else None
        seals = roster.await_seals(ours, self.timeouts.matchmaking_s, decides)
        won = roster.decide(ours, seals, pending.base, self.timeouts.matchmaking_s, pending.certified_base, may_seal,
                            self.timeouts.round_timeout_s)  # fmt: skip
        if won is None:
            everyone = frozenset(s.sealer for s in seals if s.start_fp == majority)
            self._not_certified(pending, everyone)
            return ShardOutcome(
                new_tensors=None, group_size=len(entries), uncertified=True, sealed_by=everyone, deferred=owed
            )
        members = [self._member(entry, pending.round, majority) for entry in won.entries]
        if [m.name for m in members] in ([], [self.me]):  # a set of one is ours alone: no other member saw it
            logger.warning("shard %d round %d: no other member sealed with us", self.shard, pending.round)
            return ShardOutcome(new_tensors=None, group_size=len(members), deferred=owed)
        self.certificate = Certificate(pending.round, frozenset(won.authors), majority)
        roster.certify(self.certificate)
        agreed_at = time.perf_counter()
        outcome = self._exchange(pending, members, len(members))
        outcome.phases_s["agree"] = agreed_at - started
        return outcome

    def _implausible(
        self, round_: int, statements: dict[str, GroupMeta], judge: Callable[[dict[str, int]], set[str]] | None
    ) -> set[str]:
        """The authors our seal leaves out for claiming more tokens than their speed allows (never ourselves)."""
        if judge is None:
            return set()
        claims = {author: meta.tokens for author, meta in statements.items() if author != self.me and meta.size > 0}
        refused = judge(claims)
        for author in sorted(refused):
            logger.warning("shard %d round %d: %s claims %d tokens, more than its advertised speed allows in the "
                           "round; not sealing its statement", self.shard, round_, author, claims[author])  # fmt: skip
        return refused

    def _prefetch(self, pending: PendingRound, start_fp: str, entries: list[Entry]) -> None:
        """Start downloading, in the background, each message we would fetch from its author once the round's set
        is sealed: those the statements' set selects whose relay tree makes us the author's child. Sealing takes
        a few DHT round trips; a message from a home link takes longer than that, and every member below us in its
        tree waits for it (on the netlab a 5 Mbit/s member lengthened the others' rounds by 7%). We have stated our
        own message (its digest is committed) before we ask for anyone's. The bytes count only once the sealed set
        names the same digest (`_fetch_message` checks them as any fetch)."""
        self.prefetched = {key: f for key, f in self.prefetched.items() if key[0] >= pending.round}
        if not self.small_messages or pending.meta.digest == "":
            return
        names = [e.author for e in entries if e.size > 0]
        seed = selection_seed(self.run.run_id, self.shard, pending.round, start_fp)
        chosen = set(selected_contributors(names, contributor_limit(self.run.outer), seed))
        members = [e.author for e in entries]
        if self.me not in members:  # our own statement is not in this read yet (the 3|1 partition test crashed here)
            return
        slow = slow_uplinks(self.runtime.uplinks, members)
        for entry in entries:
            key = (pending.round, entry.digest)
            if entry.author not in chosen or entry.author == self.me or key in self.prefetched:
                continue
            if relay_parent(members, entry.author, self.me, slow) == entry.author:
                member = self._member(entry, pending.round, start_fp)
                fetch = self.runtime.fetch_with_retries(member.peer_id, PAYLOAD, self.shard, pending.round, entry.size)
                self.prefetched[key] = asyncio.run_coroutine_threadsafe(fetch, self.runtime.loop)

    def _remember(self, seal: Seal) -> None:
        """A seal is a vote, cast once: a member that comes back to its round keeps it (`_earlier_vote`)."""
        self.votes[seal.round] = seal
        for old in [r for r in self.votes if r <= seal.round - VOTES_KEPT]:
            del self.votes[old]

    def _earlier_vote(self, round_: int, roster: RosterRound) -> dict[str, Seal] | None:
        """Our earlier seal of `round_` by our name ({} if we cast none), which stands; None when we cannot know it
        (we restarted and the DHT did not answer)."""
        if round_ in self.votes:
            return {self.me: self.votes[round_]}
        if self.resumed_at is None or round_ < self.resumed_at:
            return {}
        earlier = roster.seals()
        if earlier is not None and self.me not in earlier:  # the rounds we sealed before the restart end here
            self.resumed_at = None
        return earlier

    def adopt(self, certificate: Certificate | None, known: bool = True) -> None:
        """θ came from others: take the certificate its holders hold (`known`: the DHT or a manifest stated it), or,
        not knowing it, follow the deciders until one tells it (`follows`)."""
        self.certificate, self.follows = (certificate, False) if known else (None, True)

    def _not_certified(self, pending: PendingRound, sealers: frozenset[str]) -> None:
        """The seals decided no set (too few of the round's quorum base sealed, or nothing they sealed reached more
        than half of it): we void it, so the minority side of a partition never moves on alone (the majority's
        result, if there is one, comes from `obtain`)."""
        if not pending.certified_base:
            logger.warning("shard %d round %d: not certified: no certificate came before it, and its %d members "
                           "known did not all seal one set (%d did: %s); voiding it unless they did", self.shard,
                           pending.round, len(pending.base), len(sealers),
                           ", ".join(sorted(sealers)) or "-")  # fmt: skip
            return
        logger.warning(
            "shard %d round %d: not certified: no statement sealed by more than half of the %d members of its base "
            "(%d of them sealed: %s); voiding it unless a majority did", self.shard, pending.round, len(pending.base),
            len(sealers & pending.base), ", ".join(sorted(pending.base & sealers)) or "-",
        )  # fmt: skip

    @staticmethod
    def _member(entry: Entry, round_: int, start_fp: str) -> Member:
        from hivemind.p2p import PeerID

        meta = GroupMeta(round_, start_fp, entry.size, entry.digest, entry.tokens, proof="")
        return Member(entry.author, PeerID.from_base58(entry.author), meta)

    def _exchange(self, pending: PendingRound, included: list[Member], group_size: int) -> ShardOutcome:
        """Fetch the selected contributors' messages, combine them in canonical order, take the outer step, and serve
        the round's manifest (what we aggregated) so a member that missed the group can rebuild θ(t+1) from it."""
        announced = Counter(m.meta.digest for m in included if m.meta.size > 0)
        for m in included:
            if m.meta.size > 0 and announced[m.meta.digest] > 1:
                logger.warning("shard %d round %d: leaving out %s's message (another member announced the same "
                               "digest: a copy would count twice)", self.shard, pending.round, m.name)  # fmt: skip
        contributors = [m for m in included if m.meta.size > 0 and announced[m.meta.digest] == 1]
        seed = selection_seed(self.run.run_id, self.shard, pending.round, pending.meta.start_fp)
        chosen = set(selected_contributors([m.name for m in contributors], contributor_limit(self.run.outer), seed))
        selected = [m for m in contributors if m.name in chosen]
        fetch_started = time.perf_counter()
        peers = {m.name: m.peer_id for m in included}
        try:
            messages, dropped, traffic = self._collect_messages(pending, selected, peers)
            fetched_at = time.perf_counter()
            refused: set[str] = set()
            if self.admits_by_loss:
                admitted = self._admit(pending, messages, selected, frozenset(peers), dropped)
                refused = {r.name for r in messages} - {r.name for r in admitted}
                messages = admitted
        except Unreachable as e:
            logger.warning("shard %d round %d: %s; taking the round's result from the members that got it",
                           self.shard, pending.round, e)  # fmt: skip
            return ShardOutcome(new_tensors=None, group_size=group_size, deferred=pending.payload is not None)
        outer_started = time.perf_counter()
        combined = self.method.combine(
            [r.message for r in messages], [float(r.tokens) for r in messages], [r.name for r in messages]
        )
        dropped += [f"{messages[i].name}: {reason}" for i, reason in combined.dropped]
        new = self.method.update(pending.start, combined)
        used = [messages[i] for i in combined.used]
        self._serve_manifest(pending, used, new)
        # our message stays served for KEPT_ROUNDS rounds, so the others fetch it at their pace while we go on
        contributed = any(r.name == self.me for r in used)
        # our message not selected, or refused by the loss verdicts: our Δ stays owed in the error feedback (one that
        # does not decode is dropped, as everyone's)
        deferred = pending.payload is not None and (self.me not in chosen or self.me in refused)
        self._keep_applied(pending, used, pending.payload if deferred else None)
        phases = {"fetch": fetched_at - fetch_started, "outer": time.perf_counter() - outer_started}
        if self.admits_by_loss:  # scoring the messages and agreeing the verdicts
            phases["judge"] = outer_started - fetched_at
        return ShardOutcome(new, group_size, len(used), contributed, dropped, traffic.received, deferred,
                            traffic.relayed, phases_s=phases, messages_prefetched=traffic.prefetched)  # fmt: skip

    def _admit(
        self, pending: PendingRound, messages: list[Received], selected: list[Member], voters: frozenset[str],
        dropped: list[str],
    ) -> list[Received]:  # fmt: skip
        """The `messages` the round's loss verdicts admit (`protocol/admission.py`), after casting ours (`_verdict`);
        `Unreachable` when the verdicts decide no set in time. The others are added to `dropped`."""
        roster = pending.roster
        assert roster is not None  # `finish` came here after `begin`
        sizes = {m.name: m.meta.size for m in selected}
        entries = {r.name: Entry(r.name, sizes[r.name], r.digest, r.tokens) for r in messages}
        started = time.monotonic()
        ours = self._verdict(pending, roster, messages, entries)
        # the others judge once their last message is in (up to the fetch deadline and a retry from another member
        # after ours), and take about as long to judge as we did
        wait_s = self.timeouts.fetch_timeout_s + MEMBER_FETCH_S + max(self.timeouts.matchmaking_s,
                                                                       2 * (time.monotonic() - started))  # fmt: skip
        decided = roster.await_admitted(pending.meta.start_fp, ours, voters, list(entries.values()), wait_s)
        if decided is None:
            raise Unreachable("the round's loss verdicts decided no set in time")
        for r in messages:
            if entries[r.name] not in decided:
                dropped.append(f"{r.name}: its step does not lower the probe loss, as most of the round judged")
        return [r for r in messages if entries[r.name] in decided]

    def _verdict(
        self, pending: PendingRound, roster: RosterRound, messages: list[Received], entries: dict[str, Entry]
    ) -> Seal | None:
        """Our verdict of the round, cast once: the one we cast before (in memory, or in the DHT after a restart), else
        our judge's, stored now; None when we cast none (we cannot judge, our judge failed, or after a restart the DHT
        does not say whether we did: judging again could count two verdicts of ours)."""
        if pending.round in self.judged:
            return self.judged[pending.round]
        if self.resumed_at is not None:
            earlier = roster.verdicts()
            if earlier is None or self.me in earlier:
                return None if earlier is None else earlier[self.me]
        if self.loss_judge is None:
            return None
        # one candidate θ(t+1) at a time (K of them would be K copies of the shard); `update` is pure for the sparse
        # methods `--admission loss` requires (DiLoCo's would advance its momentum)
        steps = (
            (r.name, self.method.update(pending.start, self.method.combine([r.message], [float(r.tokens)], [r.name])))
            for r in messages
        )
        try:
            drops = self.loss_judge(probe_draw(entries.values()), pending.start, steps)
        except Exception as e:  # a judge that fails is one not heard from: the others still decide
            logger.error("shard %d round %d: scoring the messages failed (%s: %s); casting no verdict", self.shard,
                         pending.round, type(e).__name__, e)  # fmt: skip
            return None
        logger.info("shard %d round %d: probe loss drops %s", self.shard, pending.round,
                    ", ".join(f"{a[-6:]} {d:+.4f}" for a, d in sorted(drops.items())))  # fmt: skip
        admissible = loss_admitted(drops)
        ours = Seal(self.me, pending.round, pending.meta.start_fp, tuple(sorted(entries[a] for a in admissible)),
                    self.proof)  # fmt: skip
        roster.judge(ours)
        self.judged[pending.round] = ours
        for old in [r for r in self.judged if r <= pending.round - VOTES_KEPT]:
            del self.judged[old]
        return ours

    def _collect_messages(
        self, pending: PendingRound, selected: list[Member], members: dict[str, Any]
    ) -> tuple[list[Received], list[str], Traffic]:
        """Every selected contributor's decoded message (ours decoded from our own bytes, exactly as the others see
        it), fetched concurrently through the relay trees among `members` and verified; one whose bytes do not
        decode is dropped (every member decodes the same bytes alike); `Unreachable` when one cannot be had."""
        if any(m.name == self.me and m.meta.digest != pending.meta.digest for m in selected):
            raise Unreachable("the round selected a message of ours from before a restart, which we no longer have")
        others = [m for m in selected if m.name != self.me]

        async def fetch_all() -> dict[str, Any]:
            """Each message by the deadline, or its error: one slow fetch never costs the ones already done."""
            jobs = {m.name: asyncio.ensure_future(self._fetch_message(pending.round, m, members)) for m in others}
            if jobs:
                _, late = await asyncio.wait(jobs.values(), timeout=self.timeouts.fetch_timeout_s)
                for job in late:
                    job.cancel()
            return {
                name: (job.exception() or job.result()) if job.done() and not job.cancelled()
                else TimeoutError("fetch deadline passed")
                for name, job in jobs.items()
            }  # fmt: skip

        fetched: dict[str, Any] = self.runtime.run(fetch_all())
        lost = [m for m in others if isinstance(fetched[m.name], BaseException)]
        if lost:  # its author is gone, slow or serves us bytes that fail the digest: a member that verified it may not
            fetched |= self.runtime.run(self._fetch_from_members(pending.round, lost, members))
        unreachable = sorted(m.name for m in others if isinstance(fetched[m.name], BaseException))
        if unreachable:  # dropping it alone would leave us with another aggregate than members that got it
            raise Unreachable(f"no member could serve the message of {', '.join(unreachable)}")
        if pending.payload is not None:
            fetched[self.me] = Fetched(pending.payload, relayed=False)
        messages, dropped, traffic = [], [], Traffic()
        for name, _, meta in selected:
            got = fetched[name]  # ours is in `selected` only with our payload (checked above)
            data = got.data
            if name != self.me:
                traffic.received += len(data)
                traffic.relayed += got.relayed
                traffic.prefetched += got.early
            try:
                messages.append(Received(name, self.method.decode(data), meta.tokens, meta.digest))
            except PayloadError as e:
                dropped.append(f"{name}: {e}")
                continue
            if self.small_messages and name == self.me:
                self.runtime.publish(message_kind(meta.digest), self.shard, pending.round, data)
        for reason in dropped:
            logger.warning("shard %d round %d: dropped contribution %s", self.shard, pending.round, reason)
        return messages, dropped, traffic

    async def _fetch_from_members(
        self, round_: int, lost: list[Member], members: dict[str, Any]
    ) -> dict[str, Fetched | BaseException]:
        """Each of `lost`'s messages from any other member of the round that verified it (each re-serves it by its
        digest), all asked at once; an error for a message none of them serves."""

        async def ask(holder: Any, author: Member) -> bytes:
            kind = message_kind(author.meta.digest)
            _, data = await asyncio.wait_for(
                self.runtime.fetch_async(holder, kind, self.shard, round_, author.meta.size), MEMBER_FETCH_S
            )
            if digest(data) != author.meta.digest or len(data) != author.meta.size:
                raise PayloadError(f"a copy of {author.name}'s message does not match its digest")
            return data

        async def from_anyone(author: Member) -> Fetched | BaseException:
            holders = [members[name] for name in sorted(members) if name not in (self.me, author.name)]
            found = await asyncio.gather(*(ask(holder, author) for holder in holders), return_exceptions=True)
            data = next((d for d in found if isinstance(d, bytes)), None)
            if data is None:
                return LookupError(f"no member of the round serves {author.name}'s message")
            self.runtime.publish(message_kind(author.meta.digest), self.shard, round_, data)
            return Fetched(data, relayed=True)

        found = await asyncio.gather(*(from_anyone(m) for m in lost))
        return {m.name: got for m, got in zip(lost, found, strict=True)}

    async def _fetch_message(self, round_: int, author: Member, members: dict[str, Any]) -> Fetched:
        """`author`'s message, checked against the size and digest the group agreed on, then re-served for our
        children in its relay tree (and for catch-up). Small messages come from our parent in the tree when that is
        not the author; the author itself is the fallback."""
        meta = author.meta
        data = await self._fetch_from_parent(round_, author, members) if self.small_messages else None
        relayed, early = data is not None, False
        if data is None:  # from the author: the bytes we started fetching while the round was sealed, else now
            data = await self._prefetched_copy(round_, author)
            early = data is not None
            if data is None:
                _, data = await self.runtime.fetch_with_retries(author.peer_id, PAYLOAD, self.shard, round_, meta.size)
            if len(data) != meta.size or digest(data) != meta.digest:
                raise PayloadError("payload does not match the size/digest it announced")
        if self.small_messages:
            self.runtime.publish(message_kind(meta.digest), self.shard, round_, data)
        return Fetched(data, relayed, early)

    async def _prefetched_copy(self, round_: int, author: Member) -> bytes | None:
        """The bytes `_prefetch` started downloading from `author`; None when it did not, or the download failed."""
        early = self.prefetched.get((round_, author.meta.digest))
        if early is None:
            return None
        try:
            _, data = await asyncio.wrap_future(early)
        except Exception as e:  # transport errors come in many types: the author is asked again, as without it
            logger.info("shard %d round %d: prefetching %s's message failed (%r)", self.shard, round_, author.name, e)
            return None
        return data

    async def _fetch_from_parent(self, round_: int, author: Member, members: dict[str, Any]) -> bytes | None:
        """`author`'s message from our parent in its relay tree; None when the parent is the author, is known to
        lie, or fails (then the author is asked)."""
        if self.me not in members or author.name not in members:
            return None
        parent = relay_parent(list(members), author.name, self.me, slow_uplinks(self.runtime.uplinks, list(members)))
        if parent == author.name or parent in self.runtime.lying_relays:
            return None
        try:
            return await self._fetch_relayed(members[parent], round_, author.meta)
        except PayloadError as e:  # it altered what it should have verified: never again
            self.runtime.lying_relays.add(parent)
            logger.warning("shard %d round %d: %s; fetching from authors instead of it from now on",
                           self.shard, round_, e)  # fmt: skip
        except Exception as e:  # the parent is gone or too slow
            logger.info("shard %d round %d: relay %s failed for %s's message (%r); asking its author",
                        self.shard, round_, parent, author.name, e)  # fmt: skip
        return None

    async def _fetch_relayed(self, parent: Any, round_: int, meta: GroupMeta) -> bytes:
        """The message with `meta`'s digest from `parent`, polled until the parent has it (it is fetching it from
        its own parent meanwhile) or RELAY_PATIENCE of the fetch deadline has passed."""
        kind = message_kind(meta.digest)
        pending_reply = not_served(kind)
        give_up = time.monotonic() + RELAY_PATIENCE * self.timeouts.fetch_timeout_s
        pause = RELAY_POLL_S
        while True:
            try:  # a parent that trickles bytes is cut off at the same patience as one that has nothing yet
                fetch = self.runtime.fetch_async(parent, kind, self.shard, round_, meta.size)
                _, data = await asyncio.wait_for(fetch, max(0.0, give_up - time.monotonic()))
            except Exception as e:
                if pending_reply not in str(e) or time.monotonic() + pause > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            if digest(data) != meta.digest:
                raise PayloadError(f"relay {parent} served bytes that do not match the agreed digest")
            if len(data) != meta.size:  # the relay served the author's bytes: the author announced another size
                raise ValueError("the message's author announced a size its bytes do not have")
            return data

    # -------------------------------------------------------------------------------------------------- solo

    def solo(self, pending: PendingRound, live: list[str]) -> ShardOutcome:
        """No other replica is alive: apply our own contribution with the same rule (a group of one), and serve
        the round like a group does, so a peer that only receives (a stage of an incomplete virtual replica, a
        joiner) can follow. Only if we alone are a quorum: a peer cut off from the others is not alone."""
        pending.base = self.quorum(pending.round, [], live)
        roster = self.roster(pending.round)
        earlier = self._earlier_vote(pending.round, roster)
        if earlier is None or self.me in earlier:  # we voted in this round before (or cannot know): that vote stands
            logger.info("shard %d round %d: we sealed it before; not deciding it alone again", self.shard,
                        pending.round)  # fmt: skip
            return ShardOutcome(new_tensors=None, group_size=1, uncertified=True, deferred=pending.payload is not None)
        if self.follows or not certifies({self.me}, pending.base):  # cut off (or our base unknown): Δ stays owed
            self._not_certified(pending, frozenset({self.me}))
            return ShardOutcome(new_tensors=None, group_size=1, uncertified=True, deferred=pending.payload is not None)
        meta = pending.meta
        entries = () if pending.payload is None else (Entry(self.me, meta.size, meta.digest, meta.tokens),)
        seal = Seal(self.me, pending.round, meta.start_fp, entries, self.proof)
        roster.seal(seal)
        self._remember(seal)
        self.certificate = Certificate(pending.round, frozenset({self.me}), meta.start_fp)
        roster.certify(self.certificate)
        if pending.payload is None:
            return ShardOutcome([s.clone() for s in pending.start], 1, 0)
        mine = Received(self.me, self.method.decode(pending.payload), pending.meta.tokens, pending.meta.digest)
        combined = self.method.combine([mine.message], [float(mine.tokens)], [mine.name])
        new = self.method.update(pending.start, combined)
        if self.small_messages:
            self.runtime.publish(message_kind(mine.digest), self.shard, pending.round, pending.payload)
        self._serve_manifest(pending, [mine], new)
        self._keep_applied(pending, [mine], None)
        return ShardOutcome(new, 1, 1, contributed=True)

    def serve_void(self, round_: int, start: list[Tensor], start_fp: str, owed: bytes | None = None) -> None:
        """Nobody completed `round_` as we saw it: say so in its manifest, so a member that catches up later keeps
        θ(t) too. `owed`: our message, whose Δ we keep owed (a set that holds it after all counts it once). A
        follower stops following: nobody decided, so no certificate exists that it could be missing (a swarm of
        followers alone would otherwise never decide again)."""
        self.follows = False
        manifest = encode_manifest(round_, start_fp, fingerprint(start), [], self.certificate)
        self.runtime.publish(MANIFEST, self.shard, round_, manifest)
        if self.heals:  # an empty set: any member that completed the round holds a wider one
            self.applied = Applied(round_, start, start_fp, frozenset(), owed)

    def _keep_applied(self, pending: PendingRound, used: list[Received], deferred: bytes | None) -> None:
        """Remember θ(t) and the set we applied for one round, so the next one can heal it (small messages only)."""
        if self.heals:
            members = frozenset((r.name, r.digest, r.tokens) for r in used)
            self.applied = Applied(pending.round, pending.start, pending.meta.start_fp, members, deferred)

    def _serve_manifest(self, pending: PendingRound, used: list[Received], new: list[Tensor]) -> None:
        manifest = encode_manifest(
            pending.round,
            pending.meta.start_fp,
            fingerprint(new),
            [(r.name, r.digest, r.tokens) for r in used],
            self.certificate,
        )
        self.runtime.publish(MANIFEST, self.shard, pending.round, manifest)
