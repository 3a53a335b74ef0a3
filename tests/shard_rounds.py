"""One shard's round among in-process `ShardSync`s over real hivemind peers: the quorum and claims tests' driver."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from hetero_node.client.outer.shard_sync import ShardOutcome, ShardSync
from hetero_node.models.shards import fingerprint

SHAPES = [(32, 16), (50,)]
Judge = Callable[[dict[str, int]], set[str]]


def contribute(
    syncs: list[ShardSync],
    round_: int,
    start: list[torch.Tensor],
    seed: int,
    tokens: list[int] | None = None,
    judges: list[Judge | None] | None = None,
    deltas: list[list[torch.Tensor]] | None = None,
) -> list[ShardOutcome]:
    """One round among `syncs` only (the others are cut off), everyone from `start`; member i claims `tokens[i]`
    (64 each by default), judges the others' claims with `judges[i]` (none by default) and brings `deltas[i]`
    (random ones of norm ~1e-2 per coordinate by default, drawn from `seed`)."""
    from hivemind.utils import get_dht_time

    names = [s.me for s in syncs]
    tokens = tokens or [64] * len(syncs)
    judges = judges or [None] * len(syncs)
    pendings = []
    for i, sync in enumerate(syncs):
        gen = torch.Generator().manual_seed(seed + i)
        delta = deltas[i] if deltas is not None else [1e-2 * torch.randn(s, generator=gen) for s in SHAPES]
        pending = sync.contribution(round_, start, fingerprint(start), delta, tokens[i])
        sync.begin(pending, coming=names, live=names, scheduled_time=get_dht_time() + 15)
        pendings.append(pending)
    with ThreadPoolExecutor(len(syncs)) as pool:
        jobs = [
            pool.submit(s.finish, p, lambda: False, lambda: None, None, judge)
            for s, p, judge in zip(syncs, pendings, judges, strict=True)
        ]
        outcomes = [job.result() for job in jobs]
    for sync, pending, outcome in zip(syncs, pendings, outcomes, strict=True):
        if not outcome.contributed:
            sync.drop(pending)
    return outcomes
