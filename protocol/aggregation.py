"""Reference aggregation of SparseLoCo contributions (method.md §1.3, algorithms-notes §1.5).

Given every replica's `SparseMessage` for one parameter shard, the outer step uses, per coordinate, the
mean over the replicas that selected that coordinate (not the sum over all replicas divided by R), after
scaling each contribution down to at most the median contribution norm so that no one peer dominates.
Coordinates nobody selected stay 0. Malformed or non-finite contributions are dropped, not fatal.

Every peer must reach the same bits, so the result depends only on the contributions and their order:
callers pass contributions in a canonical order (e.g. sorted by peer id). Norms are computed exactly
rounded in float64 (`math.fsum` over the four decoded values of each tensor, weighted by how often each
code occurs), so the clip factors do not depend on the CPU's summation order; the per-coordinate sums
are plain fp32 additions in contribution order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.sparseloco import LEVELS, SparseMessage, decode_table, dequantize, validate_message

logger = logging.getLogger(__name__)

NORM_EPS = 1e-8
"""Added to a contribution's norm in the clip factor median/(norm + eps), as the reference code does."""


@dataclass(frozen=True)
class AggregateResult:
    """The aggregate of one shard and who took part."""

    tensors: list[Tensor]
    """Dense fp32 CPU tensors, one per expected shape."""
    used: list[int]
    """Positions (in the input order) of the contributions that were aggregated."""
    dropped: list[tuple[int, str]]
    """(position, reason) of each contribution left out."""
    clip_factors: list[float]
    """The factor each used contribution was scaled by, aligned with `used`."""


def contribution_norm(msg: SparseMessage) -> float:
    """L2 norm of the dequantized contribution over all its tensors, exactly rounded in float64.

    Each tensor's values take only 4 fp32 values, so the squared norm is Σ count(code)·value(code)², summed
    with `math.fsum`: the same float on every machine.
    """
    terms = []
    for part in msg.tensors:
        counts = torch.bincount(part.codes.to(torch.int64), minlength=LEVELS).tolist()
        values = decode_table(part).tolist()
        terms.extend(count * value**2 for count, value in zip(counts, values, strict=True))
    return math.sqrt(math.fsum(terms))


def lower_median(values: Sequence[float]) -> float:
    """Median that takes the lower middle of an even count (as `torch.median` does in the reference code)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def aggregate(
    contributions: Sequence[SparseMessage],
    shapes: Sequence[Sequence[int]],
    peer_ids: Sequence[str] | None = None,
) -> AggregateResult:
    """Median-norm-clipped, per-coordinate mean over selectors of `contributions` for a shard of `shapes`.

    `peer_ids` (aligned with `contributions`) only name peers in the warnings about dropped contributions.
    Pass contributions in a canonical order: fp32 sums depend on it, and every peer must get the same bits.
    """
    if peer_ids is not None and len(peer_ids) != len(contributions):
        raise ValueError(f"{len(peer_ids)} peer ids for {len(contributions)} contributions")
    names = list(peer_ids) if peer_ids is not None else [f"#{i}" for i in range(len(contributions))]
    used, dropped = [], []
    for i, msg in enumerate(contributions):
        try:
            validate_message(msg, shapes)
        except PayloadError as err:
            logger.warning("dropping SparseLoCo contribution from %s: %s", names[i], err)
            dropped.append((i, str(err)))
        else:
            used.append(i)
    norms = [contribution_norm(contributions[i]) for i in used]
    median = lower_median(norms) if norms else 0.0
    clip_factors = [min(1.0, median / (norm + NORM_EPS)) for norm in norms]

    sums = [torch.zeros(math.prod(tuple(s)), dtype=torch.float32) for s in shapes]
    counts = [torch.zeros_like(s) for s in sums]
    for i, factor in zip(used, clip_factors, strict=True):
        msg = contributions[i]
        scale = torch.tensor(factor, dtype=torch.float32)
        for t, part in enumerate(msg.tensors):
            positions = msg.plan(t).positions(part.indices)
            sums[t].index_add_(0, positions, dequantize(part) * scale)
            counts[t].index_add_(0, positions, torch.ones(positions.numel()))
    tensors = [(s / c.clamp(min=1)).view(tuple(shape)) for s, c, shape in zip(sums, counts, shapes, strict=True)]
    return AggregateResult(tensors=tensors, used=used, dropped=dropped, clip_factors=clip_factors)
