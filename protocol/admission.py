"""Loss-scored admission (`--admission loss`): a round counts only the messages whose step lowers a probe loss, as
more than half of the round's members judged it.

The claims judge (`claims.py`) and the aggregation rules bound what a message may weigh; they cannot see what it
does. A member that negates the honest step at the rule's full allowance passes them all (the byzantine lab:
`bench/byzantine.py`). Gauntlet-style admission (templar's LossScore) looks at the effect instead: after a round's
messages are fetched and verified, each member that can evaluate the whole model (a full replica) applies each
selected message's outer step alone to θ(t) and scores it on `PROBE_BATCHES` batches of the run's probe data shard,
which no replica trains on (`models/data.py: probe_batches`), drawn by the candidates' digests (`probe_draw`). A
message is admissible if its step lowers the probe loss by more than 0 and by at least `LOSS_FLOOR` × the median
message's drop (`loss_admitted`).

A loss computed on another device (CPU and GPU, two GPU models) differs in the last bits, and a drop near the floor
can pass on one member and fail on the next: members that combined what they each judged would fork. So the
verdicts are agreed as the seals are (`roster.py`): each judge stores its admitted entries once, signed, as a
**verdict** (a seal under the round's verdict key), and the round counts an entry once more than half of the round's
members (the authors of its decided set, the same for everyone that decided it) admitted it; out once that can no
longer happen (`admitted`). Every member that decides decides the same set, whatever verdicts it read; one that
cannot decide (too few verdicts by the deadline) computes nothing and takes the round's result from those that
did, as a member that missed a message does. A member that cannot judge (a pipeline stage holds some layers only)
casts no verdict and counts as not heard from: its group decides only while full replicas are more than half of it.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping

from hetero_node.protocol.roster import Entry, Seal, ballots

PROBE_BATCHES = 4
"""Batches a judge scores each message's step on, drawn anew each round (`probe_draw`; as many as an evaluation's)."""
LOSS_FLOOR = 0.25
"""A message is admissible if its step alone lowers the probe loss by more than 0 and by at least this share of the
median message's drop (one that agrees and adds nothing, the lab's `dilute`, drops it by ~0)."""
PROBE_DRAW_BITS = 62
"""Bits of a probe draw (the top of a 64-bit blake2b digest): a draw is a non-negative signed 64-bit integer."""


def loss_admitted(drops: Mapping[str, float]) -> set[str]:
    """The authors whose step lowered the probe loss enough (`LOSS_FLOOR`); `drops`: author → loss before − after.
    A drop that is not finite (the step took the loss to inf or NaN) is never admitted."""
    finite = [d for d in drops.values() if math.isfinite(d)]
    if not finite:
        return set()
    floor = LOSS_FLOOR * statistics.median(finite)
    return {author for author, drop in drops.items() if math.isfinite(drop) and drop > 0 and drop >= floor}


def admitted(
    verdicts: Iterable[Seal], start_fp: str, voters: frozenset[str], candidates: Iterable[Entry]
) -> frozenset[Entry] | None:
    """The `candidates` more than half of `voters` admitted, once each candidate is in or out (`roster.standing`'s
    rule: out once its admissions plus the voters not heard from are at most half; but over the candidates given, so
    one that no verdict read yet lists is pending, not out); None while one is undecided. A verdict from outside
    `voters`, or from another start, admits nothing."""
    votes = ballots(verdicts, start_fp, voters)
    unheard = len(voters) - len(votes)
    chosen = set()
    for entry in candidates:
        yes = sum(entry in entries for entries in votes.values())
        if 2 * yes > len(voters):
            chosen.add(entry)
        elif 2 * (yes + unheard) > len(voters):
            return None
    return frozenset(chosen)


def probe_draw(candidates: Iterable[Entry]) -> int:
    """Which probe batches a round's judges score on: a hash of the candidates' digests, the same for every judge and
    unknown to any author until every candidate's message was committed (the probe shard is public; its batches of
    a round are not known in advance)."""
    digests = "".join(sorted(e.digest for e in candidates)).encode()
    return int.from_bytes(hashlib.blake2b(digests, digest_size=8).digest(), "little") >> (64 - PROBE_DRAW_BITS)
