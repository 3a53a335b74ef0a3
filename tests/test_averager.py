"""The shard averager's per-round matchmaking with real hivemind DHTs and averager processes on loopback."""

from __future__ import annotations

import time

import hivemind
import torch
from hivemind.utils import get_dht_time

from hetero_node.client.outer.averager import ShardAverager


def shard_averager(dht: hivemind.DHT) -> ShardAverager:
    return ShardAverager(
        [torch.zeros(1)], dht, prefix="test-shard", start=True, min_group_size=2, min_matchmaking_time=1.0,
        request_timeout=0.5, allow_state_sharing=False,
    )  # fmt: skip


def test_a_cancelled_search_never_carries_its_metadata_into_the_next_rounds_group() -> None:
    """A member whose round-0 search is cancelled mid-way (the swarm moved on) at once starts round 1: the group of
    round 1 must gather its round-1 metadata, not what the dying round-0 search still held."""
    first = hivemind.DHT(start=True)
    others = [hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in range(2)]
    late, punctual, stuck = (shard_averager(dht) for dht in [first, *others])
    try:
        for averager in (late, stuck):  # round 0: a group of three that never fills, both waiting in it
            assert averager.prepare_round(0, 3, settle_s=5.0)
        old = [a.step(gather={"round": 0}, scheduled_time=get_dht_time() + 30, timeout=60, wait=False)
               for a in (late, stuck)]  # fmt: skip
        time.sleep(2.0)
        old[0].cancel()
        for averager in (late, punctual):  # up to the step's own timeout, as `ShardSync.begin` waits: a cancelled
            assert averager.prepare_round(1, 2, settle_s=20.0)  # search un-declares itself in the DHT, 7 s+ under load
        steps = [
            a.step(gather={"round": 1, "who": i}, scheduled_time=get_dht_time() + 3, timeout=20, wait=False)
            for i, a in enumerate((late, punctual))
        ]
        gathered = [s.result(30) for s in steps]
        for g in gathered:
            assert sorted((m["round"], m["who"]) for m in g.values()) == [(1, 0), (1, 1)]
    finally:
        for a in (late, punctual, stuck):
            a.shutdown()
        for dht in (*others, first):
            dht.shutdown()
