"""Agreement admission in the robust rule: a member whose step opposes (or ignores) most members' is left out,
not counted, and the kept set is stable when a late member combines it again."""

from __future__ import annotations

import dataclasses
import random

import torch

from hetero_node.protocol.aggregation import DISAGREES, aggregate, judge
from hetero_node.protocol.sparseloco import ErrorFeedbackCompressor, SparseLoCoConfig, SparseMessage, decompress
from tests.factories import MESSAGE_SHAPES as SHAPES
from tests.factories import correlated_messages


def _negated(honest: list[SparseMessage], scale: float = -100.0) -> SparseMessage:
    """`scale` × the honest members' mean step, through a compressor of its own: the lab's negating attacker."""
    mean = aggregate(honest, SHAPES).tensors
    return ErrorFeedbackCompressor(SHAPES, SparseLoCoConfig(ef_decay=0.0)).compress([scale * t for t in mean])


def _zero(message: SparseMessage) -> SparseMessage:
    parts = tuple(dataclasses.replace(p, mean=0.0, lookup=(0.0, 0.0, 0.0, 0.0)) for p in message.tensors)
    return dataclasses.replace(message, tensors=parts)


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_negating_member_and_an_all_zero_member_are_left_out_and_the_result_is_the_honest_ones() -> None:
    honest = correlated_messages(4, seed=1)
    clean = aggregate(honest, SHAPES, robust=True)
    for liar in (_negated(honest), _zero(honest[0])):
        attacked = aggregate([*honest, liar], SHAPES, robust=True, peer_ids=["a", "b", "c", "d", "liar"])
        assert attacked.used == [0, 1, 2, 3]
        assert attacked.dropped == [(4, DISAGREES)]
        assert _same_bits(attacked.tensors, clean.tensors)
    # the mean rule trusts its members: it counts the negating one
    assert aggregate([*honest, _negated(honest)], SHAPES).used == [0, 1, 2, 3, 4]


def test_two_agreeing_liars_beside_three_honest_members_are_both_left_out() -> None:
    honest = correlated_messages(3, seed=2)
    liar = _negated(honest)
    result = aggregate([liar, *honest, liar], SHAPES, robust=True)
    assert result.used == [1, 2, 3]


def test_a_group_of_two_is_not_judged() -> None:
    """Two members that disagree leave no majority to say which one lies: both count (the rule's bounds apply)."""
    honest = correlated_messages(1, seed=3)
    assert aggregate([honest[0], _negated(honest)], SHAPES, robust=True).used == [0, 1]


def test_the_kept_set_is_a_fixed_point_so_a_late_member_rebuilding_from_it_keeps_every_message() -> None:
    """Whatever the members send (here random steps, whose dot products have random signs, and random weights),
    combining the kept messages again keeps all of them and gives the same bits, as a catch-up from a round's
    manifest must; and the verdict does not depend on the order the members arrive in beyond the canonical one."""
    rng = random.Random(0)
    judged = 0
    for case in range(12):
        count = rng.randint(3, 6)
        messages = correlated_messages(count, seed=100 + case, noise=rng.choice([0.5, 4.0, 50.0]))
        messages = [m if rng.random() < 0.7 else _negated([m], scale=-rng.uniform(0.5, 3.0)) for m in messages]
        weights = [rng.uniform(0.5, 2.0) for _ in messages]
        first = aggregate(messages, SHAPES, weights=weights, robust=True)
        judged += len(first.used) < count
        kept = [messages[i] for i in first.used]
        again = aggregate(kept, SHAPES, weights=[weights[i] for i in first.used], robust=True)
        assert again.used == list(range(len(kept))), f"case {case}"
        assert _same_bits(again.tensors, first.tensors), f"case {case}"
    assert judged >= 3  # the cases did leave members out, so the fixed point was exercised


def test_the_verdict_reads_the_bounded_steps_not_the_sent_values() -> None:
    """An attacker cannot buy agreement with one huge agreeing tensor: the per-tensor clip bounds its dot product
    there, so negating the other (larger) tensor still leaves it out, although its sent values agree overall."""
    honest = correlated_messages(4, seed=4, noise=0.5)
    negated = _negated(honest)
    loud = ErrorFeedbackCompressor(SHAPES, SparseLoCoConfig(ef_decay=0.0)).compress(
        [1e6 * t for t in aggregate(honest, SHAPES).tensors]
    )
    liar = dataclasses.replace(negated, tensors=(negated.tensors[0], loud.tensors[1]))
    sent = torch.cat([t.flatten() for t in decompress(liar)])
    for message in honest:  # as sent, the liar agrees with every honest member
        assert float(sent @ torch.cat([t.flatten() for t in decompress(message)])) > 0
    assert aggregate([*honest, liar], SHAPES, robust=True).used == [0, 1, 2, 3]


def test_a_member_that_agrees_overall_but_pushes_one_tensor_against_the_others_is_left_out_there() -> None:
    """The lab's `hidden-concentrate` in miniature: the liar agrees in the large tensor and negates the small one;
    it is counted in the first and left out of the second."""
    honest = correlated_messages(4, seed=6, noise=0.5)
    negated = _negated(honest)
    liar = dataclasses.replace(honest[0], tensors=(honest[0].tensors[0], negated.tensors[1]))
    verdict = judge([*honest, liar], SHAPES, [1.0] * 5, [0, 1, 2, 3, 4])
    assert verdict.kept == [0, 1, 2, 3, 4] and verdict.silenced == {(1, 4)}
    result = aggregate([*honest, liar], SHAPES, robust=True)
    clean = aggregate(honest, SHAPES, robust=True)
    assert float(result.tensors[1].flatten() @ clean.tensors[1].flatten()) > 0
    ratio = float(result.tensors[1].norm() / clean.tensors[1].norm())
    assert 0.9 < ratio < 1.1  # the honest step of that tensor, not cancelled by the liar's share
