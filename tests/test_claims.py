"""A statement's claimed tokens are bounded by what its author's advertised speed allows in the round's window: the
ceiling's arithmetic, then over real peers: a member claiming 10¹² tokens is left out of the honest members' seals,
so the round's set (and every member's θ) is the honest members' alone."""

from __future__ import annotations

import threading

import pytest
import torch
from factories import peer_record, record_fields, run_config
from shard_rounds import SHAPES, contribute

from hetero_node.bench.poison import swarm
from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.shard_sync import ShardSync
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.claims import CLAIM_SLACK, RoundWindow, implausible_claims, tokens_ceiling
from hetero_node.protocol.records import PeerRecord

BATCH_TOKENS = 8 * 64
TIMED = RoundWindow(length_s=10.0, grace_s=2.0, accumulation=2, steps=30, min_steps=1, batch_tokens=BATCH_TOKENS)


def honest_claim(window: RoundWindow, step_s: float, devices: int = 1) -> int:
    """What a replica taking `step_s` per batch trains in `window`: whole steps before the deadline, and one more."""
    steps = int(window.length_s / (step_s * window.accumulation)) + 1  # type: ignore[operator]
    return steps * window.accumulation * devices * window.batch_tokens


def test_an_honest_replica_fits_even_when_its_record_is_read_a_round_stale() -> None:
    for step_s, devices in [(0.01, 1), (0.2, 1), (1.5, 1), (0.05, 8), (9.0, 1)]:
        claim = honest_claim(TIMED, step_s, devices)
        rate = devices * BATCH_TOKENS / step_s
        assert claim <= tokens_ceiling(TIMED, rate, step_s, devices)  # type: ignore[operator]
        # the record a round old: 3× slower step time and tokens/s than this round's
        assert claim <= tokens_ceiling(TIMED, rate / 3, 3 * step_s, devices)  # type: ignore[operator]
        assert claim <= tokens_ceiling(TIMED, 0.0, step_s, devices)  # type: ignore[operator]
        assert claim <= tokens_ceiling(TIMED, rate, 0.0, devices)  # type: ignore[operator]


def test_a_claim_beyond_the_advertised_speed_is_refused_and_unknown_speeds_are_not_judged() -> None:
    step_s = 0.2
    honest = honest_claim(TIMED, step_s)
    ceiling = tokens_ceiling(TIMED, BATCH_TOKENS / step_s, step_s, 1)
    assert ceiling is not None and honest < ceiling < (CLAIM_SLACK + 1) * honest
    assert tokens_ceiling(TIMED, 0.0, 0.0, 1) is None  # nothing advertised yet: the median caps alone
    untimed = RoundWindow(None, 2.0, 1, steps=30, min_steps=1, batch_tokens=BATCH_TOKENS)
    assert tokens_ceiling(untimed, 0.0, 0.0, 2) == CLAIM_SLACK * 30 * 2 * BATCH_TOKENS  # H steps of every device

    records = {pid: peer_record(pid, tokens_per_s=BATCH_TOKENS / step_s, step_s=step_s) for pid in ("honest", "liar")}
    records["unknown"] = peer_record("unknown", tokens_per_s=0.0, step_s=0.0)
    records["extreme"] = peer_record("extreme", tokens_per_s=1e9, step_s=1e-9)  # schema-valid extremes: no crash
    # a stage advertises its node's speed at the whole model and claims its pipeline's tokens: its step time and the
    # untimed round's H steps bound it, never the advertised figure (here a quarter of its pipeline's speed)
    records["stage"] = peer_record("stage", role="stage", tokens_per_s=BATCH_TOKENS / step_s / 4, step_s=step_s)
    records["stageliar"] = peer_record("stageliar", role="stage", tokens_per_s=1e9, step_s=step_s)
    claims = {"honest": honest, "liar": 1 << 40, "unknown": 1 << 40, "absent": 1 << 40, "extreme": 1 << 40}
    claims |= {"stage": honest, "stageliar": 1 << 40}
    assert implausible_claims(claims, records, TIMED) == {"liar", "stageliar"}
    assert implausible_claims({"stageliar": 1 << 40}, records, untimed) == {"stageliar"}


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_a_member_claiming_more_than_its_speed_allows_is_left_out_of_the_round_by_the_honest_majority() -> None:
    with swarm(3) as runtimes:
        stop = threading.Event()
        syncs = [ShardSync(r, run_config(), 0, SHAPES, SyncTimeouts(matchmaking_s=2.0), stop) for r in runtimes]
        records: dict[str, PeerRecord] = {
            s.me: PeerRecord(**record_fields(s.me, tokens_per_s=100.0, step_s=5.0)) for s in syncs
        }
        start = [torch.full(s, 0.25) for s in SHAPES]
        window = RoundWindow(10.0, 2.0, 1, 30, 1, BATCH_TOKENS)

        def judge(claims: dict[str, int]) -> set[str]:
            return implausible_claims(claims, records, window)

        round0 = contribute(syncs, 0, start, seed=0)
        assert all(o.new_tensors is not None and o.contributors == 3 for o in round0)
        theta = round0[0].new_tensors
        assert theta is not None

        # round 1: the last member claims 10¹² tokens; its record says 100 tokens/s
        round1 = contribute(syncs, 1, theta, seed=100, tokens=[64, 64, 10**12], judges=[judge, judge, None])
        assert [o.contributors for o in round1] == [2, 2, 2]
        assert [o.contributed for o in round1] == [True, True, False]
        assert len({fingerprint(o.new_tensors) for o in round1 if o.new_tensors is not None}) == 1
        assert all(s.certificate is not None and s.certificate.members == {syncs[0].me, syncs[1].me} for s in syncs)
        theta = round1[0].new_tensors
        assert theta is not None

        # the same claim where nobody judges it is in: the judgement, not the claim's size, left it out
        round2 = contribute(syncs, 2, theta, seed=200, tokens=[64, 64, 10**12])
        assert [o.contributors for o in round2] == [3, 3, 3]
