"""A round as one replica lived it, and its metrics line: what its inner loop did (`Trained`), its contribution
while the round's exchange runs (`InFlight`), how the round ended for it (`Settled`), and the `RoundRecord` made of
them (`round_record`)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from hetero_node.client.outer.shard_sync import PendingRound, ShardOutcome
from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.client.roles.schedule import RoundPlan


@dataclass(frozen=True)
class Trained:
    """What a replica's inner loop did in one round."""

    steps: int
    tokens: int
    loss: float | None
    """Mean training loss (None where the loss is computed elsewhere: pipeline stages before the last)."""
    compute_s: float
    """Time in inner steps."""
    window_s: float
    """Wall time of the training loop, what happens between steps included: the round length a step costs."""
    accumulation: int = 1
    """Batches each inner step accumulated."""
    ended_at: float = field(default_factory=time.time)
    """Wall-clock time the loop ended (`RoundRecord.trained_at`)."""

    @property
    def idle_s(self) -> float:
        """The window's time not spent in steps (between them: settling an overlapped round, refreshing the
        deadline; before the first; announcing after the last): paid inside the window, yet a cost of the round
        outside training (`Replica.measure_overhead`)."""
        return max(0.0, self.window_s - self.compute_s)


@dataclass
class InFlight:
    """A round whose contribution is out: its shards' pending rounds and the workers finishing them."""

    plan: RoundPlan
    trained: Trained | None
    pendings: dict[int, PendingRound]
    futures: dict[int, concurrent.futures.Future[ShardOutcome]]
    cutoff: dict[int, list[Tensor]] | None
    """Local weights at the deadline (the rebase point under --overlap; None: nothing trains meanwhile)."""
    comm_s: float = 0.0
    wait_s: float = 0.0
    encode_s: float = 0.0
    """Encoding and serving every shard's message."""

    @property
    def round(self) -> int:
        return self.plan.round

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())


@dataclass
class Settled:
    """How a round ended for this replica."""

    outcomes: dict[int, ShardOutcome] = field(default_factory=dict)
    caught_up: str = ""
    catch_up_bytes: int = 0
    phases_s: dict[str, float] = field(default_factory=dict)
    """This replica's own phases after the exchange (apply, eval, checkpoint)."""


def round_record(
    round_: int,
    flight: InFlight | None,
    eval_loss: float | None,
    settled: Settled,
    *,
    n_params: int,
    bytes_sent: int,
    fingerprints: dict[str, str],
    overhead_s: float,
    extras: dict[str, Any],
) -> RoundRecord:
    """Round `round_`'s metrics from how it went (`flight`: None for a round rebuilt while catching up) and from
    the replica: its parameter count, the bytes it served since its last record, θ's fingerprints, its measured
    per-round overhead and its role's extra fields."""
    trained = flight.trained if flight is not None else None
    outcomes = settled.outcomes.values()
    group = max((o.group_size for o in outcomes), default=0)
    contributed = bool(outcomes) and group > 1 and all(o.contributed for o in outcomes)
    # every shard's Δ is either in the aggregate or owed (at least one owed): nothing was lost
    deferred = any(o.deferred for o in outcomes) and all(o.deferred or o.contributed for o in outcomes)
    phases = {"encode": flight.encode_s} if flight is not None and flight.trained is not None else {}
    for outcome in outcomes:  # shards settle in parallel: the slowest one's time is the round's
        for phase, seconds in outcome.phases_s.items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    phases.update(settled.phases_s)
    return RoundRecord(
        round=round_,
        inner_steps=trained.steps if trained else 0,
        accumulation=trained.accumulation if trained else 1,
        tokens=trained.tokens if trained else 0,
        train_loss=trained.loss if trained else None,
        eval_loss=eval_loss,
        bytes_sent=bytes_sent,
        bytes_received=sum(o.bytes_received for o in outcomes) + settled.catch_up_bytes,
        compute_s=trained.compute_s if trained else 0.0,
        comm_s=(flight.comm_s + flight.wait_s) if flight else 0.0,
        fingerprints=fingerprints,
        group_size=group,
        contributors=min((o.contributors for o in outcomes), default=0),
        dropped=[d for o in outcomes for d in o.dropped],
        resynced=trained is not None and not contributed and group != 1 and not deferred,
        deferred=deferred,
        messages_relayed=sum(o.messages_relayed for o in outcomes),
        messages_prefetched=sum(o.messages_prefetched for o in outcomes),
        dense_allreduce_bytes=int(2 * 4 * n_params * (group - 1) / group) if group > 1 else 0,
        contributed=contributed,
        sat_out=flight is not None and trained is None,
        caught_up=settled.caught_up,
        catch_up_bytes=settled.catch_up_bytes,
        uncertified=any(o.uncertified for o in outcomes),
        wait_s=flight.wait_s if flight else 0.0,
        round_s=(flight.plan.length_s or 0.0) if flight else 0.0,
        overhead_s=overhead_s,
        phases_s={phase: round(seconds, 4) for phase, seconds in phases.items()},
        ended_at=time.time(),
        trained_at=trained.ended_at if trained else 0.0,
        **extras,
    )
