"""Our Δ in a round: encoded for every held shard and served, its group formed (or a step of its own when no other
replica is alive) while the exchange finishes in worker threads (`contribute`); afterwards, a Δ the aggregate does
not hold is owed to a later round or forgotten (`drop_unused`).

`Contributing` is a part of `Replica` (`roles/replica.py`), written apart: it measures Δ with the role's `deltas`
from the held θ(t), and leaves the round in `Replica.in_flight` for `Replica.settle`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

from hetero_node.client.outer.shard_sync import ShardOutcome
from hetero_node.client.roles.overlap import weights_at_deadline
from hetero_node.client.roles.round_record import InFlight, Trained
from hetero_node.client.roles.schedule import RoundPlan
from hetero_node.client.swarm import view
from hetero_node.client.swarm.record_reader import rewritten_lately
from hetero_node.protocol.claims import RoundWindow, implausible_claims
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.records import PeerRecord

logger = logging.getLogger(__name__)


def done_future(value: ShardOutcome) -> concurrent.futures.Future[ShardOutcome]:
    """A future already holding `value`: a group of one is settled as a group's worker would be, by its result."""
    future: concurrent.futures.Future[ShardOutcome] = concurrent.futures.Future()
    future.set_result(value)
    return future


class Contributing:
    """The contributing part of `Replica` (see the module docstring)."""

    def contribute(self, plan: RoundPlan, trained: Trained | None) -> None:
        """Encode Δ for every held shard and start its group (or a solo step when no other replica is alive)."""
        from hivemind.utils import get_dht_time

        started = time.perf_counter()
        t = plan.round
        if trained is None:  # receive only: the round's result comes from its messages once a member has it
            self.announce(train_round=-1, deadline=0.0)
            self.in_flight = InFlight(plan, None, {}, {}, None)
            return
        self.clock.record_speed(trained.steps * trained.accumulation, trained.window_s)  # the time of one batch
        self.announce(step_s=round(self.clock.step_s, 4))  # the group's grace (1.5 of our steps) reads it now
        records = self.records()
        fps = self.fingerprints()
        pendings = {}
        encode_started = time.perf_counter()
        for shard, sync in self.syncs.items():
            try:
                deltas = self.deltas(shard)
                pendings[shard] = sync.contribution(t, self.start[shard], fps[str(shard)], deltas, trained.tokens)
            except PayloadError as e:
                logger.error("round %d shard %d: my pseudo-gradient is unusable (%s); receiving only", t, shard, e)
                pendings[shard] = sync.contribution(t, self.start[shard], fps[str(shard)], None, 0)
        encode_s = time.perf_counter() - encode_started
        stages = self.run_cfg.outer.stages
        if view.replica_count(records, stages) <= 1:  # nobody else is alive: a group of one
            futures = {
                s: done_future(self.syncs[s].solo(p, self.live_members(records, s))) for s, p in pendings.items()
            }
        else:
            scheduled = (plan.deadline or get_dht_time()) + plan.grace_s
            running = self.runtime.running(records)  # a record no node answers for is neither waited for nor live
            futures = {}
            judge = self.implausible(plan)
            for shard, pending in pendings.items():
                coming = view.coming_members(running, t, shard, stages)
                self.syncs[shard].begin(pending, coming, self.live_members(running, shard), scheduled)
            for shard, pending in pendings.items():
                futures[shard] = self._executor.submit(
                    self.syncs[shard].finish, pending, self.moved_on(t, shard), self.vouched(t, shard),
                    self.may_seal(t), judge,
                )  # fmt: skip
        cutoff = weights_at_deadline(self.params) if self.overlap else None
        comm_s = time.perf_counter() - started
        self.in_flight = InFlight(plan, trained, pendings, futures, cutoff, comm_s=comm_s, encode_s=encode_s)

    def live_members(self, records: dict[str, PeerRecord], shard: int) -> list[str]:
        """The shard's members that have a record: who still counts towards a quorum after a long wait."""
        return view.shard_members(records, shard, self.run_cfg.outer.stages)

    def vouched(self, t: int, shard: int) -> Callable[[], str | None]:
        """The start fingerprint of `shard` at round t that a strict majority of the swarm's voters (ours included:
        `PeerRuntime.voters`) hold, else that most of those holding a certified θ(t) hold: what breaks a tie inside
        a group (a member restarted or cut off that voided round t−1 while the others certified it starts t from
        θ(t−1))."""

        def check() -> str | None:
            voters = self.runtime.voters(self.records(timeout=1.0))
            return view.vouched_fingerprint(voters, t, str(shard), me="") or view.certified_fingerprint(
                voters, t, str(shard)
            )

        return check

    def may_seal(self, t: int) -> Callable[[frozenset[str]], bool]:
        """Whether any of these members, who have not sealed round t, may still: its record holds θ(t−1) or θ(t) (a
        member a round behind, a restarted one that loaded a state), it has not given the round up (train_round
        −1: it takes the result from others), and its node rewrote it within the last 1.5 refresh periods (a killed
        or frozen node stops rewriting it). One further behind, or past round t, will not seal it in time."""
        from hivemind.utils import get_dht_time

        def check(missing: frozenset[str]) -> bool:
            records, now = self.records(timeout=1.0), get_dht_time()
            return any(
                r.round in (t - 1, t) and r.train_round >= t - 1 and rewritten_lately(r, now)
                for r in (records[pid] for pid in missing if pid in records)
            )

        return check

    def implausible(self, plan: RoundPlan) -> Callable[[dict[str, int]], set[str]]:
        """Which of a round's claims (author → tokens) its authors' advertised speeds do not allow in the round as
        we planned it (`protocol/claims.py`), from the records as the first of our shards to seal reads them (a
        claimant writes its speed of this round just before its statement); our other shards judge by the same read."""
        batch_tokens = self.run_cfg.batch_size * self.run_cfg.seq_len
        window = RoundWindow(
            plan.length_s, plan.grace_s, plan.round_accumulation, plan.reference_steps, plan.min_steps, batch_tokens
        )
        read: list[dict[str, PeerRecord]] = []

        def judge(claims: dict[str, int]) -> set[str]:
            if not read:
                read.append(self.records(timeout=1.0))
            return implausible_claims(claims, read[0], window)

        return judge

    def moved_on(self, t: int, shard: int) -> Callable[[], bool]:
        """Whether the shard's other members finished round t without us: more of them certified it than are
        still in round t (one record claiming a later round is not enough; a round voided is not finished). Only
        voters count: records with no node behind them cannot call a round off."""

        def check() -> bool:
            records = self.records(timeout=1.0)
            voters = self.runtime.voters(records)
            members = [records[pid] for pid in view.shard_members(records, shard, self.run_cfg.outer.stages)]
            others = [r for r in members if r.peer_id != self.me and r.peer_id in voters]
            ahead = sum(r.certified > t for r in others)
            return ahead > 0 and ahead > sum(view.in_round(r, t) for r in others)

        return check

    def drop_unused(self, flight: InFlight, outcomes: dict[int, ShardOutcome]) -> None:
        """Our Δ of a shard whose aggregate does not hold our message: owed for a later round when the group left it
        out by selection, else forgotten (the error feedback goes back to where it was)."""
        for shard, pending in flight.pendings.items():
            if outcomes[shard].deferred:  # never set together with `contributed`
                self.syncs[shard].defer(pending)
            elif not outcomes[shard].contributed:
                self.syncs[shard].drop(pending)
