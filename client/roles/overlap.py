"""The bookkeeping of `--overlap` (full replicas): round t's exchange runs in worker threads while round t+1 already
trains from the local weights W(t) reached at round t's deadline. When θ(t+1) arrives (between two inner steps, or
at round t+1's deadline at the latest) the local progress δ made since the deadline is kept: the weights become
θ(t+1) + δ, with δ = W − W(t). Round t+1's pseudo-gradient is then measured from θ(t+1), so δ is part of it, and
every member still agrees on θ(t+1) bit for bit. Without overlap δ is zero and the weights become θ(t+1).

Each function takes a replica's live parameters by shard (`Replica.params`): W(t) is marked when the round's
contribution goes out (`weights_at_deadline`), δ is measured before anything writes θ(t+1) or a state into the
parameters (`local_progress`) and put back on top after (`rebase`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def weights_at_deadline(params: dict[int, list[Tensor]]) -> dict[int, list[Tensor]]:
    """W(t): a copy of the local weights at the round's deadline, where δ is measured from."""
    return {s: [p.detach().clone() for p in ps] for s, ps in params.items()}


@torch.no_grad()
def local_progress(
    params: dict[int, list[Tensor]], cutoff: dict[int, list[Tensor]] | None
) -> dict[int, list[Tensor]] | None:
    """δ = W − W(t): what training did since the round's deadline `cutoff` (None: nothing trained meanwhile)."""
    if cutoff is None:
        return None
    return {
        shard: [p.detach() - mark for p, mark in zip(params[shard], marks, strict=True)]
        for shard, marks in cutoff.items()
    }


@torch.no_grad()
def rebase(params: dict[int, list[Tensor]], progress: dict[int, list[Tensor]] | None) -> None:
    """Put the local progress made since the round's deadline back on top of the new θ (None: nothing to put)."""
    for shard, deltas in (progress or {}).items():
        for param, delta in zip(params[shard], deltas, strict=True):
            param.add_(delta)
