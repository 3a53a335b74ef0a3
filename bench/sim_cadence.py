"""When a replica of the algorithm lab trains and contributes: every round, or once per window of several rounds.

A slow replica trains `steps_per_round` inner steps in a round's wall time (H / F for a GPU F times slower). In a
round stretched past H steps of the fast replicas, whose steps then accumulate A batches each, it trains either H / F
steps of A batches ("fewer") or H steps of A / F batches ("smaller"; H·A / F steps of one batch where F > A): the
same tokens, a full-length trajectory. The protocol's rule (`own_batches_per_step`) is "fewer" down to a quarter of
H steps and smaller steps below it; at F = 4 and F = 20 with A = 4, the two speeds the lab measured, it is "fewer"
and "smaller". It can contribute every round what it trained in that round (window 1: fresh, few tokens), or train
a window of w rounds from the θ it loaded at the window's start and contribute once at its end (w·H/F steps, built
on a θ that w − 1 outer steps have moved since: stale by w − 1), or sit out (window 0). Slow replicas' windows are
staggered (`offset`: the first window is shorter by it) so that their contributions spread over the rounds, as
volunteers' would.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOW_STEPS = ("fewer", "smaller")
"""How a slow replica fills a stretched round (module docstring)."""
SLOW_RULES = ("plain", "discounted", "rescaled", "rescaled-discounted", "rebased")
"""How a contribution of n inner steps, built on a θ s outer steps old, enters the outer step: `plain`, as it is
(token-weighted like any other); `discounted`, its Δ scaled by (1 + s)^−½ (FedAsync's polynomial staleness weight,
a = ½); `rescaled`, its Δ scaled by H / n, so that a replica that trained fewer steps than H moves θ as far per
step as the others instead of shrinking the token-weighted mean towards its short trajectory; or both; `rebased`,
its Δ taken from the θ it is applied to instead of the one it started from (θ(t) − θ_local: the outer steps it
missed are not applied twice; with SparseLoCo's outer rate of 1 the coordinates it selects move towards its local
weights, as asynchronous model averaging does; a virtual replica's projected start is not redone, so the lab
measured it on full replicas). A replica of H fresh steps is the same under every rule."""


@dataclass(frozen=True)
class Cadence:
    steps_per_round: int
    window: int = 1
    """Rounds per contribution: 1 every round, w > 1 once per w rounds, 0 never (the replica sits out)."""
    offset: int = 0
    accumulation: int = 1
    """Batches per inner step."""

    def __post_init__(self) -> None:
        bad_offset = not 0 <= self.offset < max(self.window, 1)
        if self.window < 0 or min(self.steps_per_round, self.accumulation) < 1 or bad_offset:
            raise ValueError(f"bad cadence {self}")

    def ends(self, t: int) -> bool:
        """Round t closes a window: the replica contributes in its outer step."""
        return self.window > 0 and (t + self.offset + 1) % self.window == 0

    def starts(self, t: int) -> bool:
        """Round t opens a window: the replica loads θ(t) and trains the window's steps."""
        return self.window > 0 and (t == 0 or self.ends(t - 1))

    def steps(self, t: int) -> int:
        """Inner steps of the window that opens at round t (the first may be shorter: see `offset`)."""
        end = t
        while not self.ends(end):
            end += 1
        return (end - t + 1) * self.steps_per_round


def contribution_scaling(rule: str, batches: int, reference: int, staleness: int) -> tuple[float, float]:
    """(what its Δ is scaled by, what its token weight is scaled by) for a contribution of `batches` batches built
    `staleness` outer steps ago (`SLOW_RULES`), where a fast replica's round is `reference` batches (H steps of A).
    A rescaled contribution also claims a fast round's tokens: with its own the aggregate's per-token norm clip
    (`protocol/aggregation.py`) would scale it straight back down."""
    if rule not in SLOW_RULES:
        raise ValueError(f"slow rule must be one of {', '.join(SLOW_RULES)}, got {rule!r}")
    rescale = reference / batches if rule.startswith("rescaled") else 1.0
    discount = (1 + staleness) ** -0.5 if rule.endswith("discounted") else 1.0
    return rescale * discount, rescale


def lab_cadences(
    replicas: int, inner_steps: int, slow: int, slow_factor: int, window: int, accumulation: int = 1,
    slow_steps: str = "fewer",
) -> list[Cadence]:  # fmt: skip
    """The first `replicas − slow` replicas train H steps of `accumulation` batches and contribute every round; the
    last `slow` train a 1 / F share of their batches a round as `slow_steps` says (`SLOW_STEPS`), in windows of
    `window` rounds staggered by their index."""
    if slow_steps not in SLOW_STEPS:
        raise ValueError(f"slow steps must be one of {', '.join(SLOW_STEPS)}, got {slow_steps!r}")
    fast = [Cadence(inner_steps, accumulation=accumulation)] * (replicas - slow)
    own = max(1, accumulation // slow_factor) if slow_steps == "smaller" else accumulation
    per_round = inner_steps * accumulation // slow_factor // own
    return fast + [Cadence(per_round, window, j % window if window else 0, own) for j in range(slow)]
