"""Where the outer step's tensors live: θ(t+1) keeps θ(t)'s device and dtype, the arithmetic runs on the method's
device, and a member on another device type gets the same bits (a GPU swarm crashed at its first outer step when
θ lived on the GPU and the aggregate on the CPU; no test put them on different devices or dtypes)."""

from __future__ import annotations

import pytest
import torch
from factories import run_config

from hetero_node.models.shards import fingerprint
from hetero_node.protocol.outer_methods import OuterMethod, outer_method
from hetero_node.protocol.run_config import OuterConfig

SHAPES = [(64, 48), (300,)]
METHODS = [("sparseloco", "mean"), ("sparseloco", "robust"), ("diloco", "mean")]
NAMES, WEIGHTS = ["peer-a", "peer-b", "peer-c"], [2048.0, 512.0, 1024.0]


def deltas(seed: int, scale: float = 1e-2) -> list[torch.Tensor]:
    """One step all senders share plus each one's own: honest pseudo-gradients agree (the robust rule leaves out a
    sender whose step points away from the others')."""
    common, gen = torch.Generator().manual_seed(12345), torch.Generator().manual_seed(seed)
    return [scale * (torch.randn(s, generator=common) + torch.randn(s, generator=gen)) for s in SHAPES]


def start(dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(s, generator=gen).to(device, dtype) for s in SHAPES]


def one_round(method: str, aggregation: str, device: str, theta: list[torch.Tensor]) -> list[torch.Tensor]:
    """Three senders encode on `device`; a member on `device` combines their messages and steps θ twice (DiLoCo's
    momentum then matters)."""
    run = run_config(outer=OuterConfig(outer=method, aggregation=aggregation))
    senders = [outer_method(run, SHAPES, device) for _ in NAMES]
    member: OuterMethod = outer_method(run, SHAPES, device)
    for round_ in range(2):
        payloads = [m.encode([d.to(device) for d in deltas(10 * round_ + i)]).payload for i, m in enumerate(senders)]
        combined = member.combine([member.decode(p) for p in payloads], WEIGHTS, NAMES)
        assert sorted(combined.used) == [0, 1, 2]
        theta = member.update(theta, combined)
    return theta


@pytest.mark.parametrize(("method", "aggregation"), METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_theta_keeps_its_dtype_and_the_step_is_the_fp32_step_rounded_to_it(
    method: str, aggregation: str, dtype: torch.dtype
) -> None:
    ours = one_round(method, aggregation, "cpu", start(dtype))
    assert [t.dtype for t in ours] == [dtype] * len(SHAPES)
    reference = one_round(method, aggregation, "cpu", start(torch.float32))
    eps = torch.finfo(dtype).eps
    for got, want, begin in zip(ours, reference, start(torch.float32), strict=True):
        # fp64 keeps more of θ(t) than fp32 did; bf16 rounds θ(t) and the result: each within its own precision
        assert bool(((got.float() - want).abs() <= 4 * eps * (want.abs() + begin.abs()) + 1e-6).all())
    assert not all(torch.equal(a.float(), b) for a, b in zip(ours, start(dtype), strict=True)), "θ did not move"


@pytest.mark.parametrize(("method", "aggregation"), METHODS)
def test_a_member_whose_theta_lives_on_another_device_steps_it_there(method: str, aggregation: str) -> None:
    """torch's `meta` device stands in for a GPU on a CPU-only machine: it computes shapes, not values, and refuses
    to mix with CPU tensors exactly as CUDA does, so any op left between θ's device and the CPU fails here."""
    run = run_config(outer=OuterConfig(outer=method, aggregation=aggregation))
    payloads = [outer_method(run, SHAPES).encode(deltas(i)).payload for i in range(len(NAMES))]
    member = outer_method(run, SHAPES, "meta")
    theta = start(device="meta")
    for _ in range(2):
        combined = member.combine([member.decode(p) for p in payloads], WEIGHTS, NAMES)
        assert all(t.device.type == "meta" for t in combined.tensors)
        theta = member.update(theta, combined)
    assert [(t.device.type, t.dtype, tuple(t.shape)) for t in theta] == [("meta", torch.float32, s) for s in SHAPES]


@pytest.mark.parametrize(("method", "aggregation"), METHODS)
def test_outer_state_leaves_as_cpu_copies_and_comes_back_to_the_methods_device(method: str, aggregation: str) -> None:
    run = run_config(outer=OuterConfig(outer=method, aggregation=aggregation))
    sender = outer_method(run, SHAPES, "cpu")
    sender.encode(deltas(0))
    member = outer_method(run, SHAPES, "cpu")
    member.update(start(), member.combine([member.decode(sender.encode(deltas(1)).payload)], [1.0], ["a"]))
    for m in (sender, member):
        saved = m.state_dict()
        tensors = [t for value in saved.values() for t in (value["buffers"] if isinstance(value, dict) else value)]
        assert tensors and all(t.device.type == "cpu" for t in tensors)
        before = fingerprint(m.private_tensors())
        m.private_tensors()[0].add_(1.0)  # the saved copy must not be a view of the live state
        m.load_state_dict(saved)
        assert fingerprint(m.private_tensors()) == before


@pytest.mark.parametrize(("method", "aggregation"), METHODS)
def test_a_member_on_a_gpu_gets_the_cpu_members_bits(method: str, aggregation: str) -> None:
    """Needs a GPU (`make gpu-check` runs this file there); on a CPU-only machine it skips."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: `make gpu-check` runs this test on a GPU")
    on_cpu = one_round(method, aggregation, "cpu", start())
    on_device = one_round(method, aggregation, "cuda", start(device="cuda"))
    assert all(t.device.type == "cuda" for t in on_device)
    assert fingerprint(on_device) == fingerprint(on_cpu)


def test_a_gpu_tensors_fingerprint_is_its_cpu_copys_across_staging_pieces() -> None:
    """A device tensor reaches the hash in pieces through two pinned buffers (`models/shards._host_bytes`): pieces
    that straddle tensors, a tensor of several pieces, bf16 and a non-contiguous view must all hash as on a CPU.
    Needs a GPU; on a CPU-only machine it skips."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: `make gpu-check` runs this test on a GPU")
    from hetero_node.models.shards import STAGING_BYTES

    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(STAGING_BYTES // 4 * 2 + 123, generator=gen),  # two pieces and a short third
        torch.randn(300, 70, generator=gen).to(torch.bfloat16).t(),  # non-contiguous
        torch.zeros(0),
        torch.randn(17, generator=gen),
    ]
    on_device = [t.to("cuda") for t in tensors]
    assert fingerprint(on_device) == fingerprint(tensors)
    assert fingerprint(on_device) != fingerprint([*tensors[:3], tensors[3] + 1])
