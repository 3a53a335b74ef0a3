"""Time-boxed rounds: when a round's training ends, and how many inner steps a replica trains in it.

A round is a window of wall time (DHT time), the same for every replica: each trains as many inner steps as fit
before the round's deadline, so a slow machine trains fewer steps instead of making the others wait or missing
the round. Its length L is `--round-s`, or H inner steps at the fastest replica's measured time per step (each
record advertises `step_s`, the training loop's wall time per step), so the fastest replica trains about H steps
and a replica three times slower about H/3 (far slower ones take smaller steps in a stretched round, below).

A round must also be long enough for what it costs outside training: exchange, outer step, catch-up. On a GPU an
inner step takes milliseconds, and H of them are far shorter than the round's own fixed costs, so a replica would
spend most of its time not training. Each replica measures that overhead O (the time from the end of one round's
training to the start of the next's), advertises it (`overhead_s`), and L is at least about O·u/(1 − u) (O/(1 − u)
under --overlap) for the upper median O of the full replicas (a full replica's own O at least) and
`--target-utilisation` u (`--overlap-utilisation` under --overlap): training then fills at least u of the time of
most full replicas, both of a pair (`RoundClock.stretched`). A median, so that one slow link or one lying record
among three or more cannot stretch everyone's round; and at most `MAX_STRETCH` times H steps (the rule itself, which
the cost model prices too, is `protocol/round_stretch.py`).

A stretched round keeps H inner steps and makes each of them bigger: every replica accumulates the gradients of
`accumulation` = ⌊L / (H steps of the fastest replica)⌋ batches per inner step. More steps per round would fill the
window too, but the algorithm lab measured that as far worse per token for SparseLoCo (a round's message carries a
fixed budget of coordinates, and a longer local trajectory does not fit it): `tiny`, 2 replicas, 153,600 tokens,
eval loss 3.46 with 5 rounds of 120 steps, 3.01 with 5 rounds of 20 steps of 6× the batch (2.85 at twice the LR),
2.54 with 30 rounds of 20 steps. A virtual replica's step pays its pipeline's round trips once however many batches
it accumulates (`roles/pipeline_schedule.py` keeps two batches of microbatches in flight across them), so on
a far link bigger steps are also more tokens: on `hetero-tiny-wan` (140 ms across the edge pipeline's boundary,
rounds stretched to 34-50 s, H = 20) it trained 140 one-batch steps a round before, 14-18 accumulated ones
after, and the edge nodes' share of the swarm's tokens went from 14% to 29-31% (bench/README.md, *Time to ddp's
loss*).

A replica so slow that it would train fewer than a quarter of H steps of the round's size takes smaller steps: as
many batches as let it train that quarter, at least one (`own_batches_per_step`). The algorithm lab (bench/README,
*Slow replicas*; 4 replicas, the 2 fast ones' steps of 4 batches, 3 seeds): 2 at a quarter of their speed, 5 steps
of 4 batches a round, helped against sitting out (−1.3% ± 0.5% eval loss); 2 at a twentieth, one step of 4
batches a round, hurt (+3.3% ± 0.8%), and 4 steps of one batch did not (−0.8% ± 1.8%; 3.9% ± 1.1% below one big
step).

Agreement without a coordinator: a replica proposes deadline(t) = now + L when it starts round t (under
`--overlap`, where training never pauses for the exchange, deadline(t−1) + L: a fixed cadence), announces it in
its record, and adopts the earliest deadline any replica training round t announces, re-reading the records while
it trains. Replicas that start a
round together therefore stop together, and a group of that round forms as soon as they are all in (the ready
barrier of `outer/shard_sync.py`).

Steps: at least `min_inner_steps` (a replica that cannot fit them before the deadline and its grace sits the round
out: it receives the round's result, its error feedback untouched), at most `max_inner_steps` (0: no cap);
between them a replica starts another step only if it expects to finish it by the deadline. Until any step time
is known (a swarm's very first round without a throughput figure), and always when `min_inner_steps` ≥ H
(synchronous rounds, unless `--round-s` is given), a round has no deadline: it is H steps long.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from hetero_node.client.swarm.view import coming
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL
from hetero_node.protocol.round_stretch import batches_per_step, own_batches_per_step, stretched_window
from hetero_node.protocol.run_config import OuterConfig

STEP_EMA = 0.5
"""Weight of the newest round in a replica's step-time and overhead estimates."""
MAX_LEAD = 0.1
"""A replica stops at most this share of L early for its statement's sake (`RoundPlan.lead_s`)."""
MIN_ROUND_FRACTION = 0.25
"""A replica that starts a round late still gets at least this fraction of L for its own proposal."""


@dataclass(frozen=True)
class RoundPlan:
    """How one replica trains round `round`."""

    round: int
    deadline: float | None
    """DHT time the round's training ends (None: not time-boxed, train H steps)."""
    length_s: float | None
    """L, the round length the deadline was derived from."""
    grace_s: float
    """How long after the deadline the round's group waits for members still finishing a step."""
    min_steps: int
    max_steps: int
    """0: no cap."""
    reference_steps: int
    """H: steps of an untimed round, and the LR schedule's steps per round."""
    sit_out: bool
    """Too little time left for min_steps: receive the round's result without training."""
    accumulation: int = 1
    """Batches whose gradients one inner step of ours accumulates (a stretched round's steps are bigger, not more)."""
    lead_s: float = 0.0
    """Seconds before the deadline this replica stops: how long its statement takes to reach the DHT (`MAX_LEAD`
    of L at most). A member on a far link pays its own round trips instead of every member waiting for them."""
    round_accumulation: int = 1
    """The round's batches per step, the fastest replica's (ours is at most this): what bounds others' claims."""

    def keep_training(self, steps: int, now: float, step_s: float) -> bool:
        """Whether to start another inner step after `steps` of them, at DHT time `now`; `step_s` is the time of one
        batch (an inner step takes `accumulation` of them)."""
        if self.max_steps and steps >= self.max_steps:
            return False
        if steps < self.min_steps:
            return True
        if self.deadline is None or step_s <= 0:
            return steps < self.reference_steps
        return now + step_s * self.accumulation <= self.deadline - self.lead_s

    def with_deadline(self, deadline: float) -> RoundPlan:
        return dataclasses.replace(self, deadline=deadline)


class RoundClock:
    """One replica's view of the round schedule (see the module docstring)."""

    def __init__(
        self, outer: OuterConfig, matchmaking_s: float, straggler_fraction: float, cadence: bool, full: bool
    ) -> None:
        self.outer, self.matchmaking_s, self.straggler_fraction = outer, matchmaking_s, straggler_fraction
        self.cadence = cadence
        """Rounds follow each other at a fixed cadence (overlap): deadline(t) = deadline(t−1) + L."""
        self.full = full
        """This replica is a full one: its own overhead counts among the full replicas' that size rounds."""
        self.step_s = 0.0
        """This replica's seconds per inner step (EMA over rounds; 0 until measured)."""
        self.overhead_s = 0.0
        """This replica's seconds per round outside training (EMA over rounds; 0 until measured)."""
        self._last: tuple[int, float] | None = None
        """(round, deadline) of the last round this replica planned."""

    def record_speed(self, steps: int, seconds: float) -> None:
        """Fold a round's measured time per step into the estimate: the training loop's wall time per step, so
        what happens between steps (an overlapped round's settling, deadline checks) counts too, and a round of
        H steps at the fastest replica's pace leaves that replica about H steps."""
        if steps > 0 and seconds > 0:
            measured = seconds / steps
            self.step_s = measured if self.step_s <= 0 else (1 - STEP_EMA) * self.step_s + STEP_EMA * measured

    def record_overhead(self, seconds: float) -> None:
        """Fold the time between the end of one round's training and the start of the next's into the estimate: a
        larger figure at once, a smaller one by the EMA. The target utilisation is a floor, and rounds sized by the
        plain EMA of a growing overhead trained below it (CPU short-step demo under --overlap: 93.7% for 95%)."""
        if seconds > 0:
            fading = (1 - STEP_EMA) * self.overhead_s + STEP_EMA * seconds
            self.overhead_s = seconds if seconds > self.overhead_s else fading

    def fastest_step_s(self, records: dict[str, PeerRecord]) -> float | None:
        """The fastest replica's time per batch, ours included (None while nobody measured one)."""
        known = [r.step_s for r in records.values() if r.step_s > 0] + [self.step_s] * (self.step_s > 0)
        return min(known) if known else None

    def accumulation(self, records: dict[str, PeerRecord], length_s: float | None) -> int:
        """Batches per inner step in a round of `length_s`: how many times H steps of the fastest replica fit (1 for
        an explicit --round-s or an untimed round), at most `MAX_ACCUMULATION`."""
        fastest = self.fastest_step_s(records)
        if self.outer.round_s > 0 or length_s is None or fastest is None:
            return 1
        return batches_per_step(length_s, self.outer.inner_steps * fastest)

    def round_length(self, records: dict[str, PeerRecord]) -> float | None:
        """L: --round-s, or H steps at the fastest replica's step time, stretched so that training fills the target
        share of a round (`target`) next to the upper-median overhead of the full replicas (of every peer when none
        measured one yet): pipeline stages fill a longer round with steps anyway, and their smaller overhead (one
        shard, no checkpoint) set rounds in which GPU full replicas trained 70% of the time. The upper median: with
        the lower one the replica of a pair with the larger overhead trained below its target in every round
        (the earliest deadline wins). A full replica's own
        overhead is a floor: it is this round's cost as measured just now, while another's record may still show a
        round-old figure (under --overlap on a GPU, one replica planned a 9 s round from its peer's stale 1 s where
        both then measured 2 s). None while no step time is known, and for synchronous rounds: with
        --min-inner-steps ≥ H every replica trains its steps whatever the clock says, and a deadline could only make
        a late one sit the round out."""
        if self.outer.round_s > 0:
            return self.outer.round_s
        if self.outer.min_inner_steps >= self.outer.inner_steps:
            return None
        fastest = self.fastest_step_s(records)
        if fastest is None:
            return None
        length = self.outer.inner_steps * fastest
        overheads = sorted(self._full_overheads(records) or self._overheads(records.values(), mine=True))
        if overheads:
            overhead = overheads[len(overheads) // 2]
            if self.full:
                overhead = max(overhead, self.overhead_s)
            outer = self.outer
            target = outer.overlap_utilisation if outer.overlap else outer.target_utilisation
            length = stretched_window(length, overhead, target, outer.inner_steps, outer.overlap)
        return length

    def _full_overheads(self, records: dict[str, PeerRecord]) -> list[float]:
        """The measured overheads of the full replicas, ours included if we are one."""
        return self._overheads([r for r in records.values() if r.role == ROLE_FULL], mine=self.full)

    def _overheads(self, records: Iterable[PeerRecord], mine: bool) -> list[float]:
        return [r.overhead_s for r in records if r.overhead_s > 0] + [self.overhead_s] * (mine and self.overhead_s > 0)

    def grace(
        self, records: dict[str, PeerRecord], round_: int, length_s: float | None, accumulation: int = 1
    ) -> float:
        """How long a group waits past the deadline: `--matchmaking-s`, a fraction of the round, or one and a
        half steps of the slowest replica coming to this round (of the round's `accumulation` batches, or the fewer
        its own steps take: `own_batches_per_step`), whichever is longest."""
        slowest = max([r.step_s for r in records.values() if coming(r, round_)] + [self.step_s])
        if length_s:
            accumulation = own_batches_per_step(length_s, self.outer.inner_steps, slowest, 0.0, accumulation)
        return max(self.matchmaking_s, self.straggler_fraction * (length_s or 0.0), 1.5 * slowest * accumulation)

    def plan(
        self,
        round_: int,
        records: dict[str, PeerRecord],
        me: str,
        now: float,
        waited_s: float = 0.0,
        store_s: float = 0.0,
    ) -> RoundPlan:
        """The plan for `round_` given the live records (ours included or not) at DHT time `now`; `waited_s`: how
        long past the deadline the round's members wait for our statement (we sit the round out only if even that
        is too soon for its minimum steps); `store_s`: how long our DHT stores take to land (`RoundPlan.lead_s`)."""
        length = self.round_length(records)
        deadline = None
        if length is not None:
            on_schedule = self.cadence and self._last is not None and self._last[0] == round_ - 1
            proposal = self._last[1] + length if on_schedule else now + length
            deadline = max(proposal, now + MIN_ROUND_FRACTION * length)
            deadline = self.earliest(round_, records, me, deadline, length)
        round_accumulation = self.accumulation(records, length)
        grace = self.grace(records, round_, length, round_accumulation)
        accumulation = round_accumulation  # far slower than the fastest: smaller steps, not one or two of its size
        if length is not None:
            accumulation = own_batches_per_step(length, self.outer.inner_steps, self.step_s, 0.0, round_accumulation)
        min_steps, max_steps = self.outer.min_inner_steps, self.outer.max_inner_steps
        step_s = self.step_s * accumulation
        sit_out = deadline is not None and step_s > 0 and now + min_steps * step_s > deadline + max(grace, waited_s)
        if deadline is not None:
            self._last = (round_, deadline)
        lead = min(store_s, MAX_LEAD * length) if length else 0.0
        return RoundPlan(
            round_, deadline, length, grace, min_steps, max_steps, self.outer.inner_steps, sit_out, accumulation, lead,
            round_accumulation,
        )  # fmt: skip

    def earliest(
        self, round_: int, records: dict[str, PeerRecord], me: str, deadline: float, length: float | None
    ) -> float:
        """The earliest deadline of `round_` among ours, the ones others training it announce, and the ones implied
        by others already training a later round r (their deadline minus r − round_ round lengths): a replica
        that fell behind learns that its round is over, sits it out and catches up, instead of training a round
        whose group has formed."""
        announced = [r.deadline for pid, r in records.items() if pid != me and r.train_round == round_ and r.deadline]
        if length:
            announced += [
                r.deadline - (r.train_round - round_) * length
                for pid, r in records.items()
                if pid != me and r.train_round > round_ and r.deadline
            ]
        return min([deadline, *announced])

    def refresh(self, plan: RoundPlan, records: dict[str, PeerRecord], me: str) -> RoundPlan:
        """Adopt an earlier deadline another replica of the round announced since we planned."""
        if plan.deadline is None:
            return plan
        earliest = self.earliest(plan.round, records, me, plan.deadline, plan.length_s)
        if earliest < plan.deadline:
            self._last = (plan.round, earliest)
            return plan.with_deadline(earliest)
        return plan
