"""SparseLoCo compressor and wire codec: chunking, top-k, 2-bit values, error feedback, byte layout."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_node.protocol.errors import CheckpointError, ConfigError, PayloadError
from hetero_node.protocol.sparse_codec import (
    decode,
    encode,
    message_size_bytes,
    pack_indices,
    unpack_indices,
)
from hetero_node.protocol.sparseloco import (
    ErrorFeedbackCompressor,
    SparseLoCoConfig,
    SparseMessage,
    chunk_k,
    chunk_plan,
    decompress,
    dequantize,
    shard_entries,
)

DEFAULT = SparseLoCoConfig()
SMALL = SparseLoCoConfig(chunk=8, topk=4)  # 64-entry chunks, 4 kept: small tensors still have many chunks
ODD_SHAPES = [(5000,), (), (1,), (3,), (2,), (100, 37), (3, 4, 5), (67, 67), (1, 130), (130, 1), (0,), (0, 3)]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes_strategy = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 300)),
        st.tuples(st.integers(1, 70), st.integers(1, 70)),
        st.tuples(st.integers(1, 5), st.integers(1, 9), st.integers(1, 9)),
        st.just(()),
    ),
    min_size=1,
    max_size=4,
)


def _random_message(shapes: list[tuple[int, ...]], config: SparseLoCoConfig, seed: int) -> SparseMessage:
    gen = torch.Generator().manual_seed(seed)
    compressor = ErrorFeedbackCompressor(shapes, config)
    return compressor.compress([torch.randn(s, generator=gen) for s in shapes])


def _expected_size(shapes: list[tuple[int, ...]], config: SparseLoCoConfig) -> int:
    """The layout table of sparse_codec, written out independently."""
    total = 12
    for shape in shapes:
        n = chunk_plan(shape, config.chunk, config.topk).num_selected
        total += 1 + 4 * len(shape) + 4 + 16 + 3 * math.ceil(n / 2) + math.ceil(n / 4)
    return total


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kwargs", [{"value_bits": 3}, {"chunk": 65}, {"chunk": 0}, {"topk": 0}, {"ef_decay": 1.5}, {"range_sigmas": 0}]
)
def test_invalid_config_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SparseLoCoConfig(**kwargs)


# ---------------------------------------------------------------------------------------------- chunking


@pytest.mark.parametrize(
    ("length", "k"), [(4096, 64), (904, 14), (96, 2), (160, 2), (1850, 28), (60, 2), (3, 2), (2, 2), (1, 1), (0, 0)]
)
def test_chunk_k_keeps_density_even_and_bounded(length: int, k: int) -> None:
    assert chunk_k(length, 64, 64) == k


def test_chunk_plans_follow_the_method() -> None:
    square = chunk_plan((1024, 1024), 64, 64)
    assert square.block == (64, 64) and square.groups[0].count == 256 and square.num_selected == 256 * 64
    odd = chunk_plan((100, 37), 64, 64)
    assert odd.block == (50, 37)  # largest divisors ≤ 64
    vector = chunk_plan((5000,), 64, 64)
    assert [(g.count, g.length, g.k) for g in vector.groups] == [(1, 4096, 64), (1, 904, 14)]
    cube = chunk_plan((3, 4, 5), 64, 64)
    assert cube.block == (3, 20)  # first dim × the rest
    assert chunk_plan((), 64, 64).num_selected == 1


@pytest.mark.parametrize("shape", [(128, 192), (100, 37), (5000,), (24, 16)])
def test_exactly_k_largest_per_chunk_are_selected(shape: tuple[int, ...]) -> None:
    config = SparseLoCoConfig(chunk=8, topk=6) if shape == (24, 16) else DEFAULT
    numel = math.prod(shape)
    signs = torch.randint(0, 2, (numel,)) * 2 - 1
    values = ((torch.randperm(numel) + 1) * signs).float().reshape(shape)  # distinct |v|, mixed signs
    msg = ErrorFeedbackCompressor([shape], config).compress([values])
    plan = msg.plan(0)
    positions = plan.positions(msg.tensors[0].indices)
    flat = values.reshape(-1)
    chunks = plan.chunk_rows(torch.arange(flat.numel()))  # the flat position of every entry, chunk by chunk
    selected = set(positions.tolist())
    for group, members in zip(plan.groups, chunks, strict=True):
        for chunk in members:
            chosen = [p for p in chunk.tolist() if p in selected]
            assert len(chosen) == group.k
            top = flat[chunk].abs().topk(group.k).indices
            assert sorted(chosen) == sorted(chunk[top].tolist())


def test_indices_are_ascending_inside_each_chunk() -> None:
    msg = _random_message([(256, 256), (9000,)], DEFAULT, seed=3)
    for i, part in enumerate(msg.tensors):
        idx = part.indices.reshape(-1, 64) if i == 0 else part.indices[:64].reshape(1, -1)
        assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_index_packing_bit_layout() -> None:
    packed = pack_indices(torch.tensor([0xABC, 0x123, 0xFFF]).numpy())
    assert packed == bytes([0xBC, 0x3A, 0x12, 0xFF, 0x0F, 0x00])
    assert unpack_indices(packed, 3).tolist() == [0xABC, 0x123, 0xFFF]


# ------------------------------------------------------------------------------------ values and shapes


def test_quantizer_uses_centroids_and_mean() -> None:
    values = torch.tensor([[-4.0, -1.0], [1.0, 10.0]])  # 1 chunk of 4 at chunk=2, topk=4 keeps all
    part = ErrorFeedbackCompressor([(2, 2)], SparseLoCoConfig(chunk=2, topk=4)).compress([values]).tensors[0]
    assert part.mean == 1.5
    c = values.reshape(-1) - 1.5
    step = 6 * float(c.norm()) / math.sqrt(3) / 4
    codes = (c / step + 2).round().clamp(0, 3)
    assert part.codes.tolist() == codes.to(torch.uint8).tolist()
    for b in range(4):
        members = c[codes == b]
        assert part.lookup[b] == pytest.approx(float(members.mean()) if members.numel() else 0.0, rel=1e-6)


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    msg = _random_message([shape], DEFAULT, seed=1)
    data = encode(msg)
    assert len(data) == message_size_bytes([shape], DEFAULT) == _expected_size([shape], DEFAULT)
    back = decode(data, [shape], DEFAULT)
    assert back == msg
    dense = decompress(back)[0]
    assert dense.shape == shape and bool(dense.isfinite().all())


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_all_zero_tensors_give_no_nan(shape: tuple[int, ...]) -> None:
    compressor = ErrorFeedbackCompressor([shape], DEFAULT)
    msg = compressor.compress([torch.zeros(shape)])
    part = msg.tensors[0]
    assert part.mean == 0.0 and part.lookup == (0.0, 0.0, 0.0, 0.0)
    assert bool((part.codes == 2).all())
    assert torch.equal(decompress(decode(encode(msg), [shape], DEFAULT))[0], torch.zeros(shape))
    assert torch.equal(compressor.state_dict()["buffers"][0], torch.zeros(shape))


def test_constant_values_decode_exactly() -> None:
    msg = ErrorFeedbackCompressor([(3,)], DEFAULT).compress([torch.full((3,), 0.25)])
    assert dequantize(msg.tensors[0]).tolist() == [0.25, 0.25]


# ------------------------------------------------------------------------------------------ codec


@FAST
@given(shapes=shapes_strategy, seed=st.integers(0, 2**16), small=st.booleans())
def test_encode_decode_round_trip(shapes: list[tuple[int, ...]], seed: int, small: bool) -> None:
    config = SMALL if small else DEFAULT
    msg = _random_message(shapes, config, seed)
    data = encode(msg)
    assert len(data) == message_size_bytes(shapes, config) == _expected_size(shapes, config)
    back = decode(data, shapes, config)
    assert back == msg
    for a, b in zip(decompress(back), decompress(msg), strict=True):
        assert torch.equal(a, b)
    assert encode(back) == data


def test_bits_per_parameter_at_defaults() -> None:
    shape = (1024, 1024)
    data = encode(_random_message([shape], DEFAULT, seed=0))
    bits = 8 * len(data) / (1024 * 1024)
    constants = 8 * (12 + 1 + 4 * 2 + 20) / (1024 * 1024)
    assert bits == pytest.approx(64 * (12 + 2) / 4096 + constants, abs=1e-12)
    assert 0.21875 < bits < 0.2191  # 0.219 bits/param plus 41 bytes of header and tensor constants


@FAST
@given(cut=st.integers(0, 10_000), seed=st.integers(0, 100))
def test_truncated_messages_are_rejected(cut: int, seed: int) -> None:
    shapes = [(100, 37), (70,), ()]
    data = encode(_random_message(shapes, SMALL, seed))
    with pytest.raises(PayloadError):
        decode(data[: cut % len(data)], shapes, SMALL)


@FAST
@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_corrupted_bytes_raise_payload_error_or_decode_cleanly(position: int, flip: int) -> None:
    shapes = [(16, 24), (130,)]
    data = bytearray(encode(_random_message(shapes, SMALL, seed=7)))
    data[position % len(data)] ^= flip
    try:
        msg = decode(bytes(data), shapes, SMALL)
    except PayloadError:
        return
    assert all(bool(t.isfinite().all()) for t in decompress(msg))


def _float_offset(shapes: list[tuple[int, ...]], tensor: int, config: SparseLoCoConfig) -> int:
    """Byte offset of tensor `tensor`'s mean (lookup follows)."""
    before = message_size_bytes(shapes[:tensor], config) if tensor else 12
    return before + 1 + 4 * len(shapes[tensor])


@pytest.mark.parametrize(
    ("mutate", "expected_shapes", "match"),
    [
        (lambda d: b"XXXX" + d[4:], None, "magic"),
        (lambda d: d[:4] + b"\x09" + d[5:], None, "version"),
        (lambda d: d + b"\x00", None, "unexpected bytes"),
        (lambda d: d, [(16, 24)], "tensors"),
        (lambda d: d, [(24, 16), (130,)], "shape"),
        (lambda d: d, [(16, 24, 1), (130,)], "dims"),
        (lambda d: d, [(16, 24), (131,)], "shape"),
    ],
)
def test_malformed_messages_are_rejected(
    mutate: Callable[[bytes], bytes], expected_shapes: list[tuple[int, ...]] | None, match: str
) -> None:
    shapes = [(16, 24), (130,)]
    data = encode(_random_message(shapes, SMALL, seed=2))
    with pytest.raises(PayloadError, match=match):
        decode(mutate(data), expected_shapes or shapes, SMALL)


@pytest.mark.parametrize("slot", range(5))
def test_nan_mean_or_lookup_is_rejected(slot: int) -> None:
    shapes = [(16, 24), (130,)]
    data = bytearray(encode(_random_message(shapes, SMALL, seed=2)))
    offset = _float_offset(shapes, 1, SMALL) + 4 * slot
    data[offset : offset + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(PayloadError, match="non-finite"):
        decode(bytes(data), shapes, SMALL)


def test_config_mismatch_is_rejected() -> None:
    data = encode(_random_message([(64, 64)], DEFAULT, seed=0))
    with pytest.raises(PayloadError, match="topk"):
        decode(data, [(64, 64)], SparseLoCoConfig(topk=32))


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (lambda idx: torch.where(torch.arange(idx.numel()) == 1, idx[0], idx), "ascending"),  # duplicate
        (lambda idx: idx[torch.tensor([1, 0, *range(2, idx.numel())])], "ascending"),
        (lambda idx: torch.where(torch.arange(idx.numel()) == idx.numel() - 1, 1000, idx).to(torch.int16), "outside"),
    ],
)
def test_bad_indices_are_rejected(indices: Callable[[torch.Tensor], torch.Tensor], match: str) -> None:
    msg = _random_message([(130,)], SMALL, seed=4)  # chunks of 64, 64 and a tail of 2
    part = dataclasses.replace(msg.tensors[0], indices=indices(msg.tensors[0].indices).to(torch.int16))
    bad = dataclasses.replace(msg, tensors=(part,))
    with pytest.raises(PayloadError, match=match):
        decode(encode(bad), [(130,)], SMALL)


def test_an_unordered_pair_inside_a_matrix_block_is_rejected_and_a_step_down_between_blocks_is_not() -> None:
    msg = _random_message([(16, 16)], SMALL, seed=5)  # four 8×8 blocks, 4 indices each
    idx = msg.tensors[0].indices
    swapped = idx.clone()
    swapped[[1, 2]] = idx[[2, 1]]
    bad = dataclasses.replace(msg, tensors=(dataclasses.replace(msg.tensors[0], indices=swapped),))
    with pytest.raises(PayloadError, match="ascending"):
        decode(encode(bad), [(16, 16)], SMALL)
    crossing = idx.clone()  # each block's indices moved to the block's end: every boundary steps down
    crossing[4:8] = torch.arange(60, 64, dtype=torch.int16)
    crossing[0:4] = torch.arange(60, 64, dtype=torch.int16)
    good = dataclasses.replace(msg, tensors=(dataclasses.replace(msg.tensors[0], indices=crossing),))
    assert decode(encode(good), [(16, 16)], SMALL) == good


def test_shard_entries_place_a_message_as_its_tensors_positions_and_values_laid_end_to_end() -> None:
    shapes = [(100, 37), (5000,), (0,), (), (3, 4, 5), (130, 1)]
    msg = _random_message(shapes, SMALL, seed=6)
    positions, values = shard_entries(tuple(shapes), SMALL.chunk, SMALL.topk, torch.device("cpu")).place(msg)
    offsets = [0, *torch.tensor([math.prod(s) for s in shapes]).cumsum(0).tolist()]
    expected = [msg.plan(i).positions(part.indices) + offsets[i] for i, part in enumerate(msg.tensors)]
    assert torch.equal(positions, torch.cat(expected))
    assert torch.equal(values, torch.cat([dequantize(part) for part in msg.tensors]))


def test_non_zero_padding_is_rejected() -> None:
    shape = (3,)  # 2 indices kept → 1 packed pair; codes: 2 of 4 slots used
    msg = _random_message([shape], DEFAULT, seed=0)
    data = bytearray(encode(msg))
    data[-1] |= 0b1100_0000
    with pytest.raises(PayloadError, match="padding"):
        decode(bytes(data), [shape], DEFAULT)
    odd = _random_message([(1,)], DEFAULT, seed=0)  # 1 index → padded pair
    data = bytearray(encode(odd))
    data[-2] = 0x10
    with pytest.raises(PayloadError, match="padding"):
        decode(bytes(data), [(1,)], DEFAULT)


# ---------------------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("beta", [0.95, 1.0, 0.0])
def test_error_feedback_invariant(beta: float) -> None:
    """e_T = β·e_{T−1} + Δ_T − sent_T unrolls to Σ_t β^(T−t)·sent_t + e_T = Σ_t β^(T−t)·Δ_t."""
    shapes = [(128, 96), (300,), ()]
    config = SparseLoCoConfig(ef_decay=beta)
    compressor = ErrorFeedbackCompressor(shapes, config)
    gen = torch.Generator().manual_seed(0)
    sent_sum = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    delta_sum = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(6):
        deltas = [torch.randn(s, generator=gen) for s in shapes]
        sent = decompress(compressor.compress(deltas))
        for i in range(len(shapes)):
            sent_sum[i] = beta * sent_sum[i] + sent[i].double()
            delta_sum[i] = beta * delta_sum[i] + deltas[i].double()
    for s, e, d in zip(sent_sum, compressor.state_dict()["buffers"], delta_sum, strict=True):
        torch.testing.assert_close(s + e.double(), d, rtol=0, atol=1e-5)


def test_error_feedback_sends_what_accumulates() -> None:
    """A coordinate never selected keeps accumulating until it is the largest of its chunk."""
    config = SparseLoCoConfig(chunk=2, topk=2, ef_decay=1.0)  # vectors in chunks of 4, 2 kept
    compressor = ErrorFeedbackCompressor([(4,)], config)
    delta = torch.tensor([1.0, 0.9, 0.8, 0.0])
    first = compressor.compress([delta]).tensors[0]
    assert first.indices.tolist() == [0, 1]
    second = compressor.compress([delta]).tensors[0]
    assert 2 in second.indices.tolist()  # 0.8 + 0.8 beats a fresh 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_and_keeps_state(bad: float) -> None:
    shapes = [(64, 64), (10,)]
    compressor = ErrorFeedbackCompressor(shapes, DEFAULT)
    compressor.compress([torch.randn(s) for s in shapes])
    before = compressor.state_dict()
    deltas = [torch.randn(s) for s in shapes]
    deltas[1][3] = bad
    with pytest.raises(PayloadError, match="tensor 1"):
        compressor.compress(deltas)
    for a, b in zip(before["buffers"], compressor.state_dict()["buffers"], strict=True):
        assert torch.equal(a, b)


def test_accumulator_overflow_raises_and_keeps_state() -> None:
    compressor = ErrorFeedbackCompressor([(8,), (8,)], SparseLoCoConfig(chunk=2, topk=1, ef_decay=1.0))
    compressor.compress([torch.ones(8), torch.full((8,), 3e38)])
    before = compressor.state_dict()
    with pytest.raises(PayloadError, match="overflow"):
        compressor.compress([torch.ones(8), torch.full((8,), 3e38)])
    for a, b in zip(before["buffers"], compressor.state_dict()["buffers"], strict=True):
        assert torch.equal(a, b)


def test_wrong_delta_shapes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="shapes"):
        ErrorFeedbackCompressor([(4, 4)]).compress([torch.zeros(16)])


def test_state_dict_round_trip_and_validation() -> None:
    shapes = [(64, 64), (7,)]
    compressor = ErrorFeedbackCompressor(shapes, DEFAULT)
    compressor.compress([torch.randn(s) for s in shapes])
    restored = ErrorFeedbackCompressor(shapes, DEFAULT)
    restored.load_state_dict(compressor.state_dict())
    deltas = [torch.randn(s) for s in shapes]
    assert restored.compress(deltas) == compressor.compress(deltas)
    for bad in ({"buffers": [torch.zeros(64, 64)]}, {"buffers": [torch.zeros(64, 64), torch.full((7,), math.nan)]}, {}):
        with pytest.raises(CheckpointError):
            restored.load_state_dict(bad)
    for a, b in zip(restored.state_dict()["buffers"], compressor.state_dict()["buffers"], strict=True):
        assert torch.equal(a, b)
