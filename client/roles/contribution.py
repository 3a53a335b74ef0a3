"""Our Δ in a round: for every held shard a worker thread encodes and serves it, states it and finishes the
shard's round (or a step of its own when no other replica is alive) while the training thread goes on
(`contribute`); afterwards, a Δ the aggregate does not hold is owed to a later round or forgotten (`drop_unused`).

`Contributing` is a part of `Replica` (`roles/replica.py`), written apart: it measures Δ with the role's `deltas`
from the held θ(t), and leaves the round in `Replica.in_flight` for `Replica.settle`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

from torch import Tensor

from hetero_node.client.outer.shard_sync import PendingRound, ShardOutcome
from hetero_node.client.roles.overlap import weights_at_deadline
from hetero_node.client.roles.round_record import InFlight, Trained
from hetero_node.client.roles.schedule import RoundPlan
from hetero_node.client.swarm import view
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
        """Start every held shard's round: its worker encodes Δ, states it and finishes the round (or a solo step
        here when no other replica is alive). Under --overlap Δ is measured from a copy of the weights at the
        deadline, so the training thread goes back to its steps at once: encoding 178m's two shards took it 0.5 s a
        round on an H200."""
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
        cutoff = weights_at_deadline(self.params) if self.overlap else None
        stages = self.run_cfg.outer.stages
        pendings: dict[int, PendingRound] = {}
        futures: dict[int, concurrent.futures.Future[ShardOutcome]] = {}
        if view.replica_count(records, stages) <= 1:  # nobody else is alive: a group of one
            for shard, sync in self.syncs.items():
                encode_started = time.perf_counter()
                pendings[shard] = self.encode(t, shard, trained.tokens, cutoff)
                outcome = sync.solo(pendings[shard], self.live_members(records, shard))
                outcome.phases_s["encode"] = time.perf_counter() - encode_started
                futures[shard] = done_future(outcome)
        else:
            scheduled = (plan.deadline or get_dht_time()) + plan.grace_s
            for shard in self.syncs:
                coming, live = view.coming_members(records, t, shard, stages), self.live_members(records, shard)
                futures[shard] = self._executor.submit(
                    self.exchange, t, shard, trained.tokens, cutoff, coming, live, scheduled, pendings
                )
        comm_s = time.perf_counter() - started
        self.in_flight = InFlight(plan, trained, pendings, futures, cutoff, comm_s=comm_s)

    def exchange(
        self,
        t: int,
        shard: int,
        tokens: int,
        cutoff: dict[int, list[Tensor]] | None,
        coming: list[str],
        live: list[str],
        scheduled: float,
        pendings: dict[int, PendingRound],
    ) -> ShardOutcome:
        """A shard's round in its worker: encode and serve Δ (into `pendings`, which `settle` reads once the worker
        is done), state it, seal and finish the round (`ShardSync.finish`)."""
        encode_started = time.perf_counter()
        pending = pendings[shard] = self.encode(t, shard, tokens, cutoff)
        encode_s = time.perf_counter() - encode_started
        sync = self.syncs[shard]
        sync.begin(pending, coming, live, scheduled)
        outcome = sync.finish(pending, self.moved_on(t, shard), self.vouched(t, shard))
        outcome.phases_s["encode"] = encode_s
        return outcome

    def encode(self, t: int, shard: int, tokens: int, cutoff: dict[int, list[Tensor]] | None) -> PendingRound:
        """Our message of `shard` for round t, Δ measured from `cutoff` (the weights at the deadline, under
        --overlap) or from the live weights; a receive-only round when Δ is unusable."""
        sync, start = self.syncs[shard], self.start[shard]
        fp = self.fingerprints()[str(shard)]
        try:
            deltas = (
                self.deltas(shard) if cutoff is None else [s - w for s, w in zip(start, cutoff[shard], strict=True)]
            )
            return sync.contribution(t, start, fp, deltas, tokens)
        except PayloadError as e:
            logger.error("round %d shard %d: my pseudo-gradient is unusable (%s); receiving only", t, shard, e)
            return sync.contribution(t, start, fp, None, 0)

    def live_members(self, records: dict[str, PeerRecord], shard: int) -> list[str]:
        """The shard's members that have a record: who still counts towards a quorum after a long wait."""
        return view.shard_members(records, shard, self.run_cfg.outer.stages)

    def vouched(self, t: int, shard: int) -> Callable[[], str | None]:
        """The start fingerprint of `shard` at round t that a strict majority of the swarm's records (ours included)
        hold, else that most of the records holding a certified θ(t) hold: what breaks a tie inside a group (a
        member restarted or cut off that voided round t−1 while the others certified it starts t from θ(t−1))."""

        def check() -> str | None:
            records = self.records(timeout=1.0)
            return view.vouched_fingerprint(records, t, str(shard), me="") or view.certified_fingerprint(
                records, t, str(shard)
            )

        return check

    def moved_on(self, t: int, shard: int) -> Callable[[], bool]:
        """Whether the shard's other members finished round t without us: more of them certified it than are
        still in round t (one record claiming a later round is not enough; a round voided is not finished)."""

        def check() -> bool:
            records = self.records(timeout=1.0)
            members = [records[pid] for pid in view.shard_members(records, shard, self.run_cfg.outer.stages)]
            others = [r for r in members if r.peer_id != self.me]
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
