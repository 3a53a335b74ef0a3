"""A round two members applied with different contributor sets heals in the next round, over real peers: the member
that applied the smaller set rebuilds the wider one from its kept θ(t), both seal the next round on it, and they
end bit for bit equal. The shape seen on a GPU: one member gave up waiting for the other's seal and left itself out
(its set {a}, the other's {a, b}); the old rule (the most common start fingerprint; a tie includes nobody) voided
every later round of that pair."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from factories import run_config

from hetero_node.bench.poison import swarm
from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.shard_sync import PendingRound, ShardOutcome, ShardSync
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.outer_methods import OuterMethod
from hetero_node.protocol.roster import Entry
from hetero_node.protocol.run_config import PipelineConfig

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(180)]

SHAPES = [(64, 48), (300,)]
TOKENS = 64
DENSE_BOUNDARIES = PipelineConfig(activation_compression="none")
"""No subspace upkeep after the outer step: θ(t+1) is the step's result alone, which a heal can rebuild."""


def deltas(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=gen) for s in SHAPES]


def finish_both(syncs: list[ShardSync], pendings: list[PendingRound]) -> list[ShardOutcome]:
    """Both members' `finish` at once, as each node's round worker runs it."""
    from hivemind.utils import get_dht_time

    close = get_dht_time() + 20
    names = [sync.me for sync in syncs]
    for sync, pending in zip(syncs, pendings, strict=True):
        sync.begin(pending, coming=names, live=names, scheduled_time=close)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(s.finish, p, lambda: False, lambda: None) for s, p in zip(syncs, pendings, strict=True)]
        return [job.result() for job in jobs]


def test_a_member_that_applied_the_smaller_set_rebuilds_the_wider_one_and_both_agree() -> None:
    with swarm(2) as runtimes:
        stop = threading.Event()
        run = run_config(pipeline=DENSE_BOUNDARIES)
        syncs = [ShardSync(r, run, 0, SHAPES, SyncTimeouts(fetch_timeout_s=10.0), stop) for r in runtimes]
        assert all(s.heals for s in syncs)
        assert not ShardSync(runtimes[0], run_config(), 0, SHAPES, SyncTimeouts(), stop).heals  # subspace upkeep
        a = syncs[0].me
        start = [torch.full(s, 0.5) for s in SHAPES]
        # round 0: both contribute and state it; a applies {a, b}, b applies {a} (it left itself out)
        round0 = [sync.contribution(0, start, fingerprint(start), deltas(i), TOKENS) for i, sync in enumerate(syncs)]
        for sync, pending in zip(syncs, round0, strict=True):
            sync.begin(pending, coming=[s.me for s in syncs], live=[s.me for s in syncs], scheduled_time=0.0)
        members = {
            sync.me: ShardSync._member(Entry(sync.me, p.meta.size, p.meta.digest, p.meta.tokens), 0, p.meta.start_fp)
            for sync, p in zip(syncs, round0, strict=True)
        }
        wide = syncs[0]._exchange(round0[0], [members[n] for n in sorted(members)], 2)
        narrow = syncs[1]._exchange(round0[1], [members[a]], 1)
        assert wide.contributors == 2 and narrow.contributors == 1 and narrow.deferred
        sent_in_round0 = round0[1].payload
        syncs[1].defer(round0[1])
        assert wide.new_tensors is not None and narrow.new_tensors is not None
        assert fingerprint(wide.new_tensors) != fingerprint(narrow.new_tensors)

        # round 1 from what each applied: b heals to {a, b}, then both aggregate both messages
        round1 = [
            sync.contribution(1, out.new_tensors, fingerprint(out.new_tensors), deltas(10 + i), TOKENS)
            for i, (sync, out) in enumerate(zip(syncs, (wide, narrow), strict=True))
        ]
        outcomes = finish_both(syncs, round1)
        assert [(o.contributors, o.contributed) for o in outcomes] == [(2, True), (2, True)]
        ours, theirs = (o.new_tensors for o in outcomes)
        assert ours is not None and theirs is not None
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))
        assert round1[1].meta.start_fp == fingerprint(wide.new_tensors)  # b sealed round 1 on the wider start

        # b's round-0 Δ counted once: what it sent in both rounds (decayed) plus its error feedback is its Δs (decayed)
        method, beta = syncs[1].method, run_config().sparseloco.ef_decay
        sent = [dense(method, p) for p in (sent_in_round0, round1[1].payload)]
        for i, left in enumerate(method.private_tensors()):
            want = beta * deltas(1)[i] + deltas(11)[i]
            assert torch.allclose(beta * sent[0][i] + sent[1][i] + left, want, atol=1e-6)


def dense(method: OuterMethod, payload: bytes | None) -> list[torch.Tensor]:
    """What a message sends, as dense tensors (the mean of one message is the message)."""
    assert payload is not None
    return method.combine([method.decode(payload)], [1.0], ["x"]).tensors
