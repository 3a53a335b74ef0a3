"""How far a round stretches past H steps of its fastest replica, and how many batches its steps then accumulate.

One rule for the nodes' clock (`client/roles/schedule.py`, whose docstring says why rounds stretch), the pipeline
stages that refuse a step of more batches than it allows, and the cost model that predicts rounds
(`client/swarm/cost_model.py`). Pure arithmetic.
"""

from __future__ import annotations

import math

MAX_STRETCH = 30.0
"""The overhead stretches a round to at most this many times H steps: a round's waits grow with its length (the
grace is a fraction of L), so a swarm that waits each round for a member who never comes must not feed that wait
back into L without bound."""
MAX_ACCUMULATION = int(MAX_STRETCH)
"""Batches one inner step accumulates at most (a pipeline stage refuses a microbatch beyond them)."""


def stretched_length(overhead: float, utilisation: float, inner_steps: int, overlap: bool) -> float:
    """The shortest round in which training fills the share u = `utilisation` next to `overhead` O (the run's
    `--target-utilisation`, or `--overlap-utilisation` under --overlap). Under --overlap
    rounds follow at a fixed cadence (deadline(t) = deadline(t−1) + L) and O is paid inside that period, so
    training fills (L − O)/L: L = O/(1 − u) (sized by O·u/(1 − u), a round could reach only (2u − 1)/u, 94.7% of
    a 95% target). Without it the window L is followed by the exchange, O is paid on top of it, and a replica
    stops when the next step would overrun the deadline: on average half a step idles, a share 1/(2H) of a
    stretched round (H steps of `accumulation` batches), so L = O·u/(1 − u − 1/(2H)) (rounds sized by
    O·u/(1 − u) trained 88.5-89% instead of 90%). 0 when the target is off."""
    if utilisation <= 0:
        return 0.0
    if overlap:
        return overhead / (1 - utilisation)  # u < 1 (RunConfig)
    slack = 1 - utilisation - 1 / (2 * inner_steps)
    return overhead * utilisation / slack if slack > 0 else math.inf


def stretched_window(base_s: float, overhead: float, utilisation: float, inner_steps: int, overlap: bool) -> float:
    """A round of H steps of the fastest replica (`base_s`) stretched next to `overhead` (`stretched_length`), at
    most `MAX_STRETCH` times: what `RoundClock.round_length` proposes, and what the cost model prices."""
    return max(base_s, min(stretched_length(overhead, utilisation, inner_steps, overlap), MAX_STRETCH * base_s))


MIN_STEP_SHARE = 0.25
"""A slower replica's steps accumulate at most as many batches as let it train this share of H steps: the algorithm
lab measured a quarter of H steps of the round's size a round as useful, one such step as harmful, and single-batch
steps in its place as harmless (bench/README, *Slow replicas*)."""


def own_batches_per_step(length_s: float, inner_steps: int, batch_s: float, step_s: float, accumulation: int) -> int:
    """Batches one inner step of a replica accumulates in a round of `length_s` whose steps accumulate
    `accumulation` (the fastest replica's): the round's, unless that leaves it fewer than `MIN_STEP_SHARE` of H
    steps (`batch_s` per batch, `step_s` once per step); then as many as let it train that share, at least one."""
    steps = max(1, math.ceil(MIN_STEP_SHARE * inner_steps))
    if batch_s <= 0 or length_s <= 0:
        return accumulation
    fits = int((length_s / steps - step_s) / batch_s + 1e-9)
    return min(accumulation, max(1, fits))


def batches_per_step(length_s: float, base_s: float) -> int:
    """Batches one inner step accumulates in a round of `length_s`: how many times H steps of the fastest replica
    (`base_s`) fit, at most `MAX_ACCUMULATION`."""
    return min(MAX_ACCUMULATION, max(1, int(length_s / base_s + 1e-9)))
