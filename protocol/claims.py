"""How many tokens a round's statement may claim: what its author's advertised speed allows in the round's window.

A statement's token count weighs its message in the aggregate, and a count is a claim. The aggregation rules cap it
at a multiple of the round's lower median (`aggregation.MEAN_WEIGHT_CAP`, `ROBUST_WEIGHT_CAP`), but whoever holds half
of a round's claims sets that median. This bound is each claimant's own: its record advertises its speed (tokens per
second over its last round's training, and seconds per batch), and no replica trains more than that speed allows in
the round's window. A member leaves a statement that claims more out of its seal (`client/outer/shard_sync.py`), so the
round's set holds it only if more than half of the round's base found it plausible, and every member still computes the
same bits from the same set.

The speed is the claimant's word too: the bound stops a broken node, and a liar whose record does not back its claim;
a liar that lies consistently in both is left to the median caps. `CLAIM_SLACK` covers an honest claimant whose record
a sealer reads a round late (its speed then is the last round's) and the step a replica may finish past the deadline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_STAGE

CLAIM_SLACK = 4.0
"""A claim counts if it is at most this many times what the claimant's advertised speed allows: speeds are averages
(the step time an EMA over rounds), and a sealer may read the record the claimant wrote a round before."""


@dataclass(frozen=True)
class RoundWindow:
    """What a round lets a replica train, as the sealer's own plan of the round says."""

    length_s: float | None
    """L, the round's training window (None: an untimed round, H steps for everyone)."""
    grace_s: float
    """How long past the deadline the round waits: a replica forced to its minimum steps trains into it."""
    accumulation: int
    """Batches per inner step."""
    steps: int
    """H: the steps of an untimed round."""
    min_steps: int
    """Steps a replica trains whatever the clock says."""
    batch_tokens: int
    """Tokens in one batch of one device (batch size × sequence length)."""


def tokens_ceiling(window: RoundWindow, tokens_per_s: float, step_s: float, devices: int) -> float | None:
    """The most tokens a replica of this speed may claim for the round (`CLAIM_SLACK` included); None while its
    record advertises no speed (a node's very first round): the median caps alone then bound it."""
    per_step = window.accumulation * devices * window.batch_tokens
    if window.length_s is None:
        return CLAIM_SLACK * max(window.steps, window.min_steps) * per_step
    rate = max(tokens_per_s, devices * window.batch_tokens / step_s if step_s > 0 else 0.0)
    if rate <= 0:
        return None
    forced = (window.min_steps + 1) * per_step  # the minimum steps, and one step that ends past the deadline
    return CLAIM_SLACK * (rate * (window.length_s + window.grace_s) + forced)


def implausible_claims(claims: Mapping[str, int], records: Mapping[str, PeerRecord], window: RoundWindow) -> set[str]:
    """The authors of `claims` (author → tokens) who claim more than their records' speed allows in `window`. An
    author without a record, or whose record advertises no speed, is not judged here. A stage peer's advertised
    tokens/s is its node's speed at the whole model (what the planner prices), not its pipeline's, whose tokens it
    claims: only its measured step time and the untimed round's H steps bound it."""
    implausible = set()
    for author, tokens in claims.items():
        record = records.get(author)
        if record is None:
            continue
        advertised = 0.0 if record.role == ROLE_STAGE else record.tokens_per_s
        ceiling = tokens_ceiling(window, advertised, record.step_s, record.devices)
        if ceiling is not None and tokens > ceiling:
            implausible.add(author)
    return implausible
