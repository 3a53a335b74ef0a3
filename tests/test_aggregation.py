"""Reference aggregation: per-coordinate mean over selectors, median-norm clipping, dropping bad peers."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hetero_node.protocol.aggregation import aggregate, contribution_norm, lower_median
from hetero_node.protocol.sparseloco import (
    CompressedTensor,
    ErrorFeedbackCompressor,
    SparseLoCoConfig,
    SparseMessage,
    decompress,
)
from tests.factories import MESSAGE_SHAPES, correlated_messages

TINY = SparseLoCoConfig(chunk=2, topk=2)  # vectors in chunks of 4 entries, 2 kept per chunk
SHAPES = MESSAGE_SHAPES


def _vector_message(indices: list[int], codes: list[int], lookup: tuple[float, float, float, float]) -> SparseMessage:
    """A hand-built message for one (8,) tensor: two chunks of 4, two in-chunk indices each."""
    part = CompressedTensor(
        shape=(8,),
        indices=torch.tensor(indices, dtype=torch.int16),
        codes=torch.tensor(codes, dtype=torch.uint8),
        mean=0.0,
        lookup=lookup,
    )
    return SparseMessage(chunk=TINY.chunk, topk=TINY.topk, tensors=(part,))


def _messages(scales: list[float], seed: int = 0) -> list[SparseMessage]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ErrorFeedbackCompressor(SHAPES, SparseLoCoConfig()).compress(
            [scale * torch.randn(s, generator=gen) for s in SHAPES]
        )
        for scale in scales
    ]


def test_mean_over_the_peers_that_selected_each_coordinate() -> None:
    lookup = (-2.0, -1.0, 0.0, 4.0)  # same value multiset for both, so equal norms and no clipping
    a = _vector_message([0, 1, 0, 3], [3, 1, 0, 2], lookup)  # positions 0, 1, 4, 7 → 4, -1, -2, 0
    b = _vector_message([1, 2, 0, 1], [0, 3, 2, 1], lookup)  # positions 1, 2, 4, 5 → -2, 4, 0, -1
    result = aggregate([a, b], [(8,)])
    assert result.used == [0, 1] and result.dropped == []
    # b's entry at position 4 decodes to 0 but was selected, so it counts: (-2 + 0) / 2 = -1, not -2.
    assert result.tensors[0].tolist() == [4.0, -1.5, 4.0, 0.0, -1.0, -1.0, 0.0, 0.0]


def test_median_clipping_caps_an_outsized_contribution() -> None:
    messages = _messages([1.0, 1.0, 100.0, 1.0])
    norms = [contribution_norm(m) for m in messages]
    result = aggregate(messages, SHAPES)
    median = lower_median(norms)
    assert result.clip_factors[2] == pytest.approx(median / norms[2], rel=1e-9)
    assert result.clip_factors[2] < 0.02
    clipped = [result.clip_factors[2] * t for t in decompress(messages[2])]
    assert math.sqrt(sum(float(t.double().square().sum()) for t in clipped)) == pytest.approx(median, rel=1e-5)
    honest = aggregate([messages[i] for i in (0, 1, 3)], SHAPES)
    biggest = max(float(t.abs().max()) for t in honest.tensors)
    assert max(float(t.abs().max()) for t in result.tensors) < 3 * biggest


def test_lower_median_takes_the_lower_middle() -> None:
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert lower_median([5.0, 1.0, 3.0]) == 3.0


def test_contribution_norm_matches_dense_norm() -> None:
    message = _messages([1.0])[0]
    dense = math.sqrt(sum(float(t.double().square().sum()) for t in decompress(message)))
    assert contribution_norm(message) == pytest.approx(dense, rel=1e-12)


def _nan_message(message: SparseMessage) -> SparseMessage:
    first, *rest = message.tensors
    poisoned = CompressedTensor(first.shape, first.indices, first.codes, float("nan"), first.lookup)
    return SparseMessage(message.chunk, message.topk, (poisoned, *rest))


def test_non_finite_and_misshapen_contributions_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    honest = _messages([1.0, 1.0, 1.0])
    wrong_shape = ErrorFeedbackCompressor([(128, 256), (1000,)]).compress([torch.ones(128, 256), torch.ones(1000)])
    contributions = [honest[0], _nan_message(honest[1]), honest[1], wrong_shape, honest[2]]
    with caplog.at_level(logging.WARNING, logger="hetero_node.protocol.aggregation"):
        result = aggregate(contributions, SHAPES, peer_ids=["p0", "p-nan", "p1", "p-shape", "p2"])
    assert result.used == [0, 2, 4]
    assert [i for i, _ in result.dropped] == [1, 3]
    assert "non-finite" in result.dropped[0][1] and "shape" in result.dropped[1][1]
    assert "p-nan" in caplog.text and "p-shape" in caplog.text
    without = aggregate(honest, SHAPES)
    for a, b in zip(result.tensors, without.tensors, strict=True):
        assert torch.equal(a, b)


def test_aggregation_is_deterministic() -> None:
    first = aggregate(_messages([1.0, 2.0, 0.5, 3.0], seed=5), SHAPES)
    second = aggregate(_messages([1.0, 2.0, 0.5, 3.0], seed=5), SHAPES)
    for a, b in zip(first.tensors, second.tensors, strict=True):
        assert torch.equal(a, b)
    assert first.clip_factors == second.clip_factors


def test_no_contributions_give_zeros() -> None:
    result = aggregate([], SHAPES)
    assert result.used == [] and all(not bool(t.any()) for t in result.tensors)
    assert [tuple(t.shape) for t in result.tensors] == SHAPES


def test_peer_ids_must_align_with_contributions() -> None:
    with pytest.raises(ValueError, match="peer ids"):
        aggregate(_messages([1.0]), SHAPES, peer_ids=["a", "b"])


def test_weights_count_each_contribution_by_its_tokens_at_the_coordinates_it_selected() -> None:
    lookup = (-2.0, -1.0, 0.0, 4.0)  # equal value multisets: equal norms
    a = _vector_message([0, 1, 0, 3], [3, 1, 0, 2], lookup)  # positions 0, 1, 4, 7 → 4, -1, -2, 0
    b = _vector_message([1, 2, 0, 1], [0, 3, 2, 1], lookup)  # positions 1, 2, 4, 5 → -2, 4, 0, -1
    result = aggregate([a, b], [(8,)], weights=[300.0, 100.0])  # a trained three times the tokens
    assert result.weights == [1.0, 1 / 3]
    # a's norm per token is a third of b's: b is clipped to the median norm per token times its weight
    assert result.clip_factors[0] == pytest.approx(1.0) and result.clip_factors[1] == pytest.approx(1 / 3, rel=1e-6)
    f = result.clip_factors[1]
    expected = [4.0, (-1.0 + (-2.0) * f / 3) / (4 / 3), 4.0 * f, 0.0, (-2.0 + 0.0) / (4 / 3), -1.0 * f, 0.0, 0.0]
    assert result.tensors[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_equal_weights_are_the_reference_rule_bit_for_bit_and_bad_weights_drop_their_message() -> None:
    messages = _messages([1.0, 2.0, 0.5])
    plain = aggregate(messages, SHAPES)
    for weights in ([1.0, 1.0, 1.0], [4096.0, 4096.0, 4096.0]):
        weighted = aggregate(messages, SHAPES, weights=weights)
        assert all(torch.equal(p, w) for p, w in zip(plain.tensors, weighted.tensors, strict=True))
    result = aggregate(messages, SHAPES, weights=[1.0, 0.0, float("nan")], peer_ids=["a", "b", "c"])
    assert result.used == [0] and [i for i, _ in result.dropped] == [1, 2]


HONEST_LOOKUP = (-2.0, -1.0, 0.0, 4.0)


def _honest_pair() -> list[SparseMessage]:
    """Two honest messages selecting positions 0, 1, 4, 5 with the same values multiset (equal norms), pointing the
    same way (dot product 20), as honest steps of one θ(t) do: the robust rule leaves out a member that disagrees."""
    return [
        _vector_message([0, 1, 0, 1], [3, 1, 0, 2], HONEST_LOOKUP),  # 4, -1, -2, 0
        _vector_message([0, 1, 0, 1], [3, 2, 0, 1], HONEST_LOOKUP),  # 4, 0, -2, -1
    ]


def test_robust_rule_bounds_a_value_that_only_the_attacker_selected() -> None:
    # positions 0, 3, 6, 7: a small value agreeing with the honest pair at 0, then the whole budget on position 7
    attacker = _vector_message([0, 3, 2, 3], [2, 0, 0, 3], (0.0, 0.0, 1.0, 1e4))
    mean = aggregate([*_honest_pair(), attacker], [(8,)])
    robust = aggregate([*_honest_pair(), attacker], [(8,)], robust=True)
    assert robust.used == [0, 1, 2]  # it agrees with both, so agreement admission keeps it
    honest_norm = math.sqrt(16 + 1 + 4)
    assert mean.tensors[0][7].item() == pytest.approx(honest_norm, rel=1e-5)  # clipped in norm, undiluted
    # robust: clipped to the honest norm (4.58), clamped to the median peak (4), divided by all three weights
    assert robust.tensors[0][7].item() == pytest.approx(4.0 / 3, rel=1e-6)
    assert robust.tensors[0][[2, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    # coordinates only the two honest peers selected: their sum over the three members (the mean rule: over the two)
    assert robust.tensors[0][[1, 4, 5]].tolist() == pytest.approx([-1 / 3, -4 / 3, -1 / 3])
    assert mean.tensors[0][[1, 4, 5]].tolist() == pytest.approx([-0.5, -2.0, -0.5])


def test_robust_rule_counts_a_claimed_token_count_at_most_as_the_median_and_the_mean_rule_as_four() -> None:
    heavy = _vector_message([0, 1, 0, 1], [3, 2, 0, 1], (-1.0, -0.5, 0.0, 2.0))  # 2, 0, -1, -0.5: it agrees
    robust = aggregate([*_honest_pair(), heavy], [(8,)], weights=[1.0, 1.0, 1000.0], robust=True)
    assert robust.weights == [1.0, 1.0, 1.0]
    mean = aggregate([*_honest_pair(), heavy], [(8,)], weights=[1.0, 1.0, 1000.0])
    # the mean rule counts the claim as 4 median members (it once let the liar decide position 0)
    assert mean.weights == [0.25, 0.25, 1.0]
    assert mean.tensors[0][0].item() == pytest.approx((4 * 0.25 + 4 * 0.25 + 2) / 1.5, rel=1e-6)
    # the heavy member's step is half the honest norm: it fills half its allowance, so it counts as half a member
    assert robust.tensors[0][0].item() == pytest.approx((4 + 4 + 2) / (1 + 1 + 0.5), rel=1e-6)


def test_robust_rule_keeps_one_tensors_budget_in_that_tensor() -> None:
    """Per-tensor clipping: an attacker quiet in one tensor cannot spend that tensor's budget in another."""
    honest = correlated_messages(3)
    budget = contribution_norm(honest[2])
    first = honest[2].tensors[0]
    dense = [decompress(m)[0].flatten() for m in honest]
    positions = honest[2].plan(0).positions(first.indices)
    agree = (dense[0][positions] * dense[2][positions] > 0) & (dense[1][positions] * dense[2][positions] > 0)
    entry = int(agree.nonzero()[0])  # an entry all three sent with one sign: the attacker is admitted
    one_code = torch.zeros_like(first.codes)
    one_code[entry] = 3  # the whole message's norm on that one coordinate of the first tensor
    sign = 1.0 if float(dense[2][positions[entry]]) > 0 else -1.0
    loud = CompressedTensor(first.shape, first.indices, one_code, 0.0, (0.0, 0.0, 0.0, sign * budget))
    quiet = honest[2].tensors[1]
    silent = CompressedTensor(quiet.shape, quiet.indices, quiet.codes, 0.0, (0.0, 0.0, 0.0, 0.0))
    attack = SparseMessage(honest[2].chunk, honest[2].topk, (loud, silent))
    clean = aggregate(honest[:2], SHAPES, robust=True)
    attacked = aggregate([*honest[:2], attack], SHAPES, robust=True)
    assert attacked.used == [0, 1, 2]
    peak = max(float(t.abs().max()) for t in clean.tensors)
    assert float(attacked.tensors[0].abs().max()) <= peak * 1.01
    assert float(aggregate([*honest[:2], attack], SHAPES).tensors[0].abs().max()) > 5 * peak


def test_robust_rule_is_deterministic_and_equal_to_the_mean_when_everyone_selects_alike() -> None:
    first = aggregate(correlated_messages(4, seed=5), SHAPES, robust=True)
    second = aggregate(correlated_messages(4, seed=5), SHAPES, robust=True)
    assert first.used == [0, 1, 2, 3]
    assert all(torch.equal(a, b) for a, b in zip(first.tensors, second.tensors, strict=True))
    same = _honest_pair()[:1] * 3
    robust, mean = aggregate(same, [(8,)], robust=True), aggregate(same, [(8,)])
    assert torch.equal(robust.tensors[0], mean.tensors[0])
