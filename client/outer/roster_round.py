"""One shard's round through the DHT roster (`protocol/roster.py`): our statement, our seal once the round's members
are in, and the tally of the seals once the members we sealed have sealed too; the round's certificate once decided.

Every wait is bounded (hivemind pitfall C): statements by the round's close (its deadline plus grace), seals by
`seal_wait_s` past the later of the close and our own seal. The happy path costs a store and a read more than the
round already had: the statements are read until they are all in, the seals until they are all in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.admission import admitted
from hetero_node.protocol.keys import certificates_key, roster_key, seals_key, verdicts_key
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.roster import Entry, Seal, Vote, decided, split, unanimous, undecidable
from hetero_node.protocol.round_wire import GroupMeta, parse_certificate
from hetero_node.protocol.swarm_key import is_member

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""Between two reads of a round's statements or seals."""
MOVED_ON_EVERY_S = 1.0
"""While waiting for statements, check this often whether the others finished the round without us."""
READ_TIMEOUT_S = 2.0
"""One DHT read of a roster; a DHT that does not answer is read again at the next poll."""
LIFETIME_S = 600.0
"""How long statements and seals stay in the DHT: far longer than a round, so a slow member still reads them."""


@dataclass
class RosterRound:
    """Round `round` of `shard` as this member reads and writes it in the DHT."""

    runtime: PeerRuntime
    run_id: str
    shard: int
    round: int
    max_size: int
    """The largest message the run's outer method makes: a statement claiming more is malformed."""
    stop: threading.Event
    left_out: set[str] = field(default_factory=set)
    """Authors and sealers already logged as left out: the roster is read every POLL_S, the warning said once."""

    def state(self, meta: GroupMeta) -> None:
        """Store our statement: what we bring to this round."""
        self.runtime.store_signed(roster_key(self.run_id, self.shard, self.round), meta.to_wire(), LIFETIME_S)

    def seal(self, seal: Seal) -> None:
        self.runtime.store_signed(seals_key(self.run_id, self.shard, self.round), seal.to_wire(), LIFETIME_S)

    def statements(self) -> dict[str, GroupMeta] | None:
        """Well-formed statements of this round by author; None when the DHT did not answer."""
        found = self.runtime.read_signed(roster_key(self.run_id, self.shard, self.round), READ_TIMEOUT_S)
        if found is None:
            return None
        statements = {}
        for author, raw in found.items():
            meta = GroupMeta.parse(raw, self.max_size)
            if meta is None or meta.round != self.round:
                self._leave_out(author, "malformed or foreign statement")
            elif not is_member(self.runtime.swarm_key, author, meta.proof):
                self._leave_out(author, "not a member of this private swarm")
            else:
                statements[author] = meta
        return statements

    def certify(self, certificate: Certificate) -> None:
        """Store the round's certificate as we decided it: a member that later loads the state this round led to
        reads it (`round_certificate`), even once every member that decided the round is gone."""
        key = certificates_key(self.run_id, self.shard, self.round)
        self.runtime.store_signed(key, certificate.to_dict(), LIFETIME_S)

    def certificates(self) -> Counter[Certificate] | None:
        """The certificates of this round its deciders stored, each with how many stored it (a decider lists itself
        among its members: anything else is left out); None when the DHT did not answer."""
        found = self.runtime.read_signed(certificates_key(self.run_id, self.shard, self.round), READ_TIMEOUT_S)
        if found is None:
            return None
        stated: Counter[Certificate] = Counter()
        for signer, raw in found.items():
            certificate = parse_certificate(raw, self.round)
            if certificate is not None and certificate.round == self.round and signer in certificate.members:
                stated[certificate] += 1
        return stated

    def seals(self) -> dict[str, Seal] | None:
        """Well-formed seals of this round by sealer; None when the DHT did not answer."""
        return self._read_seals(seals_key(self.run_id, self.shard, self.round), "seal")

    def judge(self, verdict: Seal) -> None:
        """Store our loss verdict: the round's entries we admit (`protocol/admission.py`), once."""
        self.runtime.store_signed(verdicts_key(self.run_id, self.shard, self.round), verdict.to_wire(), LIFETIME_S)

    def verdicts(self) -> dict[str, Seal] | None:
        """Well-formed loss verdicts of this round by judge; None when the DHT did not answer."""
        return self._read_seals(verdicts_key(self.run_id, self.shard, self.round), "verdict")

    def _read_seals(self, key: str, kind: str) -> dict[str, Seal] | None:
        found = self.runtime.read_signed(key, READ_TIMEOUT_S)
        if found is None:
            return None
        seals = {}
        for sealer, raw in found.items():
            seal = Seal.parse(sealer, raw, self.max_size)
            if seal is None or seal.round != self.round or not is_member(self.runtime.swarm_key, sealer, seal.proof):
                self._leave_out(f"{sealer}'s {kind}", "malformed, foreign or not a member")
            else:
                seals[sealer] = seal
        return seals

    def await_admitted(
        self, start_fp: str, ours: Seal | None, voters: frozenset[str], candidates: list[Entry], wait_s: float
    ) -> frozenset[Entry] | None:
        """The candidates the round's loss verdicts from `start_fp` admit (`protocol/admission.py: admitted`) once
        they decide every one, read until then or for `wait_s`; `ours`: our own verdict (None: we cast none). None:
        undecided."""
        give_up = time.monotonic() + wait_s
        verdicts: dict[str, Seal] = {}
        while not self.stop.is_set():
            verdicts = self.verdicts() or verdicts
            if ours is not None:
                verdicts[ours.sealer] = ours
            result = admitted(verdicts.values(), start_fp, voters, candidates)
            if result is not None or time.monotonic() >= give_up:
                if result is None:
                    logger.info("shard %d round %d: the loss verdicts of %s decide no set", self.shard, self.round,
                                ", ".join(sorted(v[-6:] for v in verdicts)) or "nobody")  # fmt: skip
                return result
            self.stop.wait(POLL_S)
        return None

    def _leave_out(self, what: str, why: str) -> None:
        if what not in self.left_out:
            self.left_out.add(what)
            logger.warning("shard %d round %d: leaving out %s (%s)", self.shard, self.round, what, why)

    def await_statements(
        self, expected: int, close: Callable[[], float], moved_on: Callable[[], bool]
    ) -> dict[str, GroupMeta] | None:
        """The statements once `expected` are in, or those in at the close (`close()`: seconds left); None when we
        are leaving or the others finished the round without us."""
        statements: dict[str, GroupMeta] = {}
        next_check = time.monotonic() + MOVED_ON_EVERY_S
        while not self.stop.is_set():
            statements = self.statements() or statements
            if len(statements) >= expected or close() <= 0:
                return statements
            if time.monotonic() >= next_check:
                if moved_on():
                    logger.info("shard %d round %d: the others finished it without us", self.shard, self.round)
                    return None
                next_check = time.monotonic() + MOVED_ON_EVERY_S
            self.stop.wait(min(POLL_S, max(0.0, close())))
        return None

    def await_seals(self, ours: Seal, wait_s: float, enough: Callable[[list[Seal]], bool] | None = None) -> list[Seal]:
        """The round's seals once everyone our seal lists has sealed, or once they are `enough` to decide the round
        (a member on a far link seals a second after the others, and the decided set does not depend on its seal),
        or those in after `wait_s`; ours always."""
        give_up = time.monotonic() + wait_s
        expected = {e.author for e in ours.entries}
        seals: dict[str, Seal] = {}

        def gathered() -> list[Seal]:
            return [*(s for name, s in seals.items() if name != ours.sealer), ours]

        while not self.stop.is_set():
            seals = self.seals() or seals
            if expected <= set(seals) | {ours.sealer} or time.monotonic() >= give_up:
                break
            if enough is not None and enough(gathered()):
                return gathered()
            self.stop.wait(POLL_S)
        missing = sorted(expected - set(seals) - {ours.sealer})
        if missing:
            logger.info("shard %d round %d: no seal from %s", self.shard, self.round, ", ".join(missing))
        return gathered()

    def decide(
        self,
        ours: Seal,
        seals: list[Seal],
        base: frozenset[str],
        wait_s: float,
        certified_base: bool = True,
        may_seal: Callable[[frozenset[str]], bool] | None = None,
        longest_s: float = 0.0,
    ) -> Vote | None:
        """The round's set once the seals decide it (`protocol/roster.py`: by a majority of `base`, or, when no
        certificate gave the base, `unanimous`ly); None when none can be any more, or the seals did not decide one
        within `wait_s`, or past it, up to `longest_s`, while `may_seal` says no base member still missing may seal
        (a void is our own conclusion: in the kill soak three members gave a round up after --matchmaking-s, a
        fourth sealed 4 s later, read a majority and applied a set they had voided). Our seal never changes (it is a
        vote); when every seal is alike (the happy path) it returns at once, with no store or read more."""
        started = time.monotonic()
        give_up, next_check, logged = started + wait_s, started + wait_s, False
        while True:
            if certified_base:
                won = decided(seals, ours.start_fp, base)
                hopeless = won is None and undecidable(seals, ours.start_fp, base)
            else:
                won = unanimous(seals, ours.start_fp, base)
                hopeless = won is None and split(seals, ours.start_fp)
            if won is not None or hopeless or self.stop.is_set():
                return won
            now = time.monotonic()
            if now >= give_up:
                missing = base - {s.sealer for s in seals}
                if now >= started + longest_s or may_seal is None or not missing:
                    return None
                if now >= next_check:  # a records read: at most once a second
                    if not may_seal(missing):
                        return None
                    if not logged:
                        logger.info("shard %d round %d: waiting on for the seals of %s (in reach of this round)",
                                    self.shard, self.round, ", ".join(sorted(m[-6:] for m in missing)))  # fmt: skip
                        logged = True
                    next_check = now + MOVED_ON_EVERY_S
            self.stop.wait(POLL_S)
            latest = self.seals()
            if latest is not None:
                seals = [*(s for name, s in latest.items() if name != ours.sealer), ours]


def round_certificate(
    runtime: PeerRuntime, run_id: str, shard: int, round_: int, max_size: int, stop: threading.Event, wait_s: float
) -> Certificate | None:
    """The certificate of round `round_` as most of the members that decided it stored it in the DHT (the next
    round's quorum base for all of them), read until one shows or `wait_s` passed (their stores are on their way
    while the state they lead to is already served); None if none does (or two are stated alike). Only this round:
    an older round's certificate would be another base than the deciders' whenever this one's is merely late (the
    soak's fork of round 9); a void round stores none, and its base comes from the manifests instead."""
    return round_certificates(runtime, run_id, [shard], round_, max_size, stop, wait_s)[shard]


def round_certificates(
    runtime: PeerRuntime,
    run_id: str,
    shards: Sequence[int],
    round_: int,
    max_size: int,
    stop: threading.Event,
    wait_s: float,
) -> dict[int, Certificate | None]:
    """`round_certificate` of several shards, read together within one `wait_s`: a void round stores none, and a node
    holding every shard waited `wait_s` once per shard for it (6 s of a 2 s round for two shards, which made a
    restarted replica sit the next round out)."""
    give_up = time.monotonic() + wait_s
    rosters = {shard: RosterRound(runtime, run_id, shard, round_, max_size, stop) for shard in shards}
    found: dict[int, Certificate | None] = dict.fromkeys(shards)
    while not stop.is_set():
        for shard, roster in list(rosters.items()):
            best = (roster.certificates() or Counter()).most_common(2)
            if best:
                found[shard] = best[0][0] if len(best) == 1 or best[1][1] < best[0][1] else None
                del rosters[shard]
        if not rosters or time.monotonic() >= give_up:
            break
        stop.wait(POLL_S)
    return found
