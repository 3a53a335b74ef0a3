"""Subspace-compressed pipeline boundaries: the basis, the constraint and its upkeep, and the boundary wire codec.

The central claim: with the constrained weights in span(U), running the model as stages that exchange only
Uᵀ(x − T_fixed[tok]) forward and Uᵀ g backward gives the unpipelined model's logits and gradients.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.nn import functional as F

from hetero_node.models.config import get_preset
from hetero_node.models.stages import StageModule, split_model
from hetero_node.models.subspace import (
    EMBED,
    apply_embedding_change,
    constrained_parameter_names,
    default_rank,
    drift_transfer_,
    drift_transfer_fixed_,
    embedding_change,
    enable_subspace,
    initial_embedding,
    project_,
    subspace_basis,
    transferred_table,
)
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.boundary_codec import (
    HEADER,
    BoundaryFormat,
    boundary_bytes_per_token,
    boundary_message_bytes,
    decode_activations,
    decode_gradients,
    encode_activations,
    encode_gradients,
)
from hetero_node.protocol.errors import ConfigError, PayloadError

SEED, U_SEED = 7, 3
CFG = get_preset("tiny")  # d_model 128, 4 layers, vocab 256
BATCH, LEN = 2, 32


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) as the data pipeline cuts them: one window of LEN + 1 ids per sequence."""
    window = torch.randint(0, CFG.vocab_size, (BATCH, LEN + 1), generator=torch.Generator().manual_seed(seed))
    return window[:, :-1], window[:, 1:]


def subspace_model(rank: int, n_stages: int, project: bool = True) -> tuple[Transformer, torch.Tensor]:
    model = Transformer(CFG, seed=SEED)
    U = subspace_basis(CFG.d_model, rank, U_SEED)
    enable_subspace(model, U)
    if project:
        project_(model, U, constrained_parameter_names(CFG, n_stages))
    return model, U


def run_compressed_pipeline(
    stages: list[StageModule], fmt: BoundaryFormat, U: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Forward and backward stage by stage, every boundary crossing as encoded bytes (as over the network)."""
    outputs, received, h = [], [], x
    for sender, receiver in itertools.pairwise(stages):
        outputs.append(sender(h))
        payload = encode_activations(fmt, outputs[-1], x, y, U, sender.embed_fixed)
        h, tokens, targets = decode_activations(fmt, payload, U, receiver.embed_fixed)
        assert torch.equal(tokens, x) and torch.equal(targets, y)
        received.append(h.requires_grad_())
    logits = stages[-1](h)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    for out, h in zip(reversed(outputs), reversed(received), strict=True):
        out.backward(decode_gradients(fmt, encode_gradients(fmt, h.grad, U), BATCH, LEN, U))
    return logits


def test_basis_orthonormal_and_deterministic() -> None:
    U = subspace_basis(128, 16, U_SEED)
    assert U.shape == (128, 16) and U.dtype == torch.float32
    torch.testing.assert_close(U.T @ U, torch.eye(16), rtol=0, atol=1e-6)
    assert U.numpy().tobytes() == subspace_basis(128, 16, U_SEED).numpy().tobytes()
    assert not torch.allclose(U, subspace_basis(128, 16, U_SEED + 1))
    assert default_rank(128) == 16 and default_rank(4) == 1
    for bad in (0, 129):
        with pytest.raises(ConfigError):
            subspace_basis(128, bad, U_SEED)


def test_constrained_set() -> None:
    names = constrained_parameter_names(CFG, 2)  # stages own layers [0, 1] and [2, 3]
    assert names == [EMBED, *(f"layers.{i}.{s}" for i in (0, 1) for s in ("attn.wo.weight", "mlp.w_down.weight"))]
    assert len(constrained_parameter_names(CFG, 4)) == 1 + 2 * 3
    assert constrained_parameter_names(CFG, 1) == []
    assert set(constrained_parameter_names(CFG, 4)) <= dict(Transformer(CFG).named_parameters()).keys()


def test_fixed_table_is_a_buffer_and_enabling_preserves_the_function() -> None:
    model = Transformer(CFG, seed=SEED)
    assert "embed_fixed" not in model.state_dict()
    x, _ = batch()
    before = model(x)
    U = subspace_basis(CFG.d_model, 16, U_SEED)
    enable_subspace(model, U)
    assert "embed_fixed" in model.state_dict() and "embed_fixed" not in dict(model.named_parameters())
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-5)
    e = model.embed.weight.detach()
    torch.testing.assert_close(e @ U @ U.T, e, rtol=0, atol=1e-6)  # E_S in span(U)
    assert (model.embed_fixed @ U).abs().max() < 1e-6  # T_fixed orthogonal to it
    with pytest.raises(ConfigError):
        enable_subspace(model, U)


def test_later_stages_rebuild_the_fixed_table_from_the_seed() -> None:
    model, U = subspace_model(16, 2, project=False)
    stage = StageModule(CFG, 1, 2, seed=SEED)
    with pytest.raises(ConfigError):
        enable_subspace(stage, U)  # a stage without embed must be given the embedding
    enable_subspace(stage, U, initial_embedding(CFG, SEED))
    assert torch.equal(stage.embed_fixed, model.embed_fixed)


def test_project_per_stage_equals_project_full() -> None:
    model = Transformer(CFG, seed=SEED)
    U = subspace_basis(CFG.d_model, 16, U_SEED)
    names = constrained_parameter_names(CFG, 3)
    stages = split_model(model, 3)
    project_(model, U, names)
    for stage in stages:
        project_(stage, U, names)  # each skips the names it does not hold
    weights = dict(model.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, weights[name]), name
    wo = weights["layers.0.attn.wo.weight"].detach()
    torch.testing.assert_close(U @ U.T @ wo, wo, rtol=0, atol=1e-6)
    fresh = dict(Transformer(CFG, seed=SEED).named_parameters())
    assert not torch.equal(wo, fresh["layers.0.attn.wo.weight"])
    assert torch.equal(weights["layers.3.attn.wo.weight"], fresh["layers.3.attn.wo.weight"])  # the last stage is free


@pytest.mark.parametrize("rank", [CFG.d_model // 8, CFG.d_model // 64])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_compressed_pipeline_matches_full_model(n_stages: int, rank: int) -> None:
    model, U = subspace_model(rank, n_stages)
    x, y = batch()
    ref = model(x)
    F.cross_entropy(ref.flatten(0, 1), y.flatten()).backward()
    stages = split_model(model, n_stages)
    fmt = BoundaryFormat(CFG.d_model, CFG.vocab_size, CFG.max_seq_len, rank=rank, wire="fp32")
    logits = run_compressed_pipeline(stages, fmt, U, x, y)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    constrained, P = set(constrained_parameter_names(CFG, n_stages)), U @ U.T
    for name, p in model.named_parameters():
        got, want = grads[name], p.grad
        if name in constrained:  # exact along the constraint; the off-subspace part is never sent
            got, want = (got @ P, want @ P) if name == EMBED else (P @ got, P @ want)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(grads[EMBED], model.embed.weight.grad, atol=1e-4)


def test_unconstrained_pipeline_differs() -> None:
    model, U = subspace_model(16, 2, project=False)
    x, y = batch()
    fmt = BoundaryFormat(CFG.d_model, CFG.vocab_size, CFG.max_seq_len, rank=16, wire="fp32")
    logits = run_compressed_pipeline(split_model(model, 2), fmt, U, x, y)
    assert (logits - model(x)).abs().max() > 1e-2


def test_drift_transfer_preserves_function_and_syncs_later_stages() -> None:
    model, U = subspace_model(16, 2)
    stage = split_model(model, 2)[1]
    with torch.no_grad():  # an outer step moves E_S out of span(U)
        model.embed.weight.add_(torch.randn(model.embed.weight.shape, generator=torch.Generator().manual_seed(1)))
    x, _ = batch()
    before = model(x)
    global_embedding = model.embed.weight.detach().clone()
    drift_transfer_(model, U)
    drift_transfer_fixed_(stage, U, global_embedding)
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-5)
    e = model.embed.weight.detach()
    torch.testing.assert_close(e @ U @ U.T, e, rtol=0, atol=1e-6)
    assert torch.equal(stage.embed_fixed, model.embed_fixed)
    with pytest.raises(ConfigError):
        drift_transfer_fixed_(model, U, global_embedding)  # stage 0 must also project E_S: drift_transfer_
    with pytest.raises(ConfigError):
        drift_transfer_(stage, U)


def test_later_stages_follow_the_tables_from_the_entries_each_outer_step_changes() -> None:
    """A later stage that starts from the seed's E_S and, each round, gets only the entries a sparse outer step
    changed holds stage 0's T_fixed and E_S bit for bit after every drift transfer."""
    model, U = subspace_model(16, 2, project=False)  # θ(0) as stage 0 holds it (it projects only its start)
    stage = split_model(model, 2)[1]
    seeded = StageModule(CFG, 1, 2, seed=SEED)  # stage 1 derives T_fixed and E_S from the seed
    embedding = enable_subspace(seeded, U, initial_embedding(CFG, SEED))
    assert torch.equal(seeded.embed_fixed, model.embed_fixed)
    assert torch.equal(embedding, model.embed.weight)
    generator = torch.Generator().manual_seed(2)
    touched = []
    for _ in range(3):
        before = model.embed.weight.detach().clone()
        with torch.no_grad():  # a sparse aggregate: 2% of the entries move
            mask = torch.rand(before.shape, generator=generator) < 0.02
            model.embed.weight.sub_(0.1 * mask * torch.randn(before.shape, generator=generator))
        change = embedding_change(before, model.embed.weight)
        touched.append(len(change[0]) / before.numel())
        drift_transfer_(model, U)
        fixed, embedding = transferred_table(stage.embed_fixed, U, apply_embedding_change(embedding, *change))
        stage.embed_fixed = fixed
        assert torch.equal(fixed, model.embed_fixed) and torch.equal(embedding, model.embed.weight)
    assert all(0 < t < 0.03 for t in touched)  # the change is the step's entries, not the whole table
    dense = embedding_change(embedding, embedding + 1)  # a dense step: the whole table, never more
    assert len(dense[0]) == 0 and torch.equal(apply_embedding_change(embedding, *dense), embedding + 1)
    positions, values = change
    for bad in ((positions.long(), values), (positions, values.double()), (positions[:-1], values),
                (positions + before.numel(), values)):  # fmt: skip
        with pytest.raises(ValueError):
            apply_embedding_change(embedding, *bad)


def fmt_for(rank: int | None, wire: str) -> BoundaryFormat:
    return BoundaryFormat(CFG.d_model, CFG.vocab_size, CFG.max_seq_len, rank=rank, wire=wire)


@pytest.mark.parametrize("wire, size", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
@pytest.mark.parametrize("rank", [16, None])
def test_message_sizes_follow_the_formula(rank: int | None, wire: str, size: int) -> None:
    model, U = subspace_model(16, 2)
    fmt = fmt_for(rank, wire)
    basis = U if rank else None
    x, y = batch()
    h = torch.randn(BATCH, LEN, CFG.d_model)
    forward = encode_activations(fmt, h, x, y, basis, model.embed_fixed)
    backward = encode_gradients(fmt, h, basis)
    width = rank or CFG.d_model
    assert boundary_bytes_per_token(width, wire, "forward", 2) == width * size + 2
    assert boundary_bytes_per_token(width, wire, "backward", 0) == width * size
    assert len(forward) == HEADER.size + BATCH * LEN * (width * size + 2) + BATCH * 2
    assert len(forward) == boundary_message_bytes(BATCH, LEN, width, wire, "forward", 2)
    assert len(backward) == HEADER.size + BATCH * LEN * width * size
    assert len(backward) == fmt.message_bytes("backward", BATCH, LEN)


def test_large_vocab_ships_int32_ids() -> None:
    fmt = BoundaryFormat(d_model=8, vocab_size=70000, max_seq_len=4, rank=2)
    U, table = subspace_basis(8, 2, U_SEED), torch.randn(70000, 8)
    window = torch.tensor([[0, 69999, 65536, 5, 1]])
    payload = encode_activations(fmt, torch.randn(1, 4, 8), window[:, :-1], window[:, 1:], U, table)
    assert fmt.id_bytes == 4 and len(payload) == HEADER.size + 4 * (2 * 2 + 4) + 4
    _, tokens, targets = decode_activations(fmt, payload, U, table)
    assert torch.equal(tokens, window[:, :-1]) and torch.equal(targets, window[:, 1:])


@pytest.mark.parametrize("wire, bound", [("bf16", 1e-2), ("fp16", 1e-3), ("fp32", 1e-6)])
def test_round_trip_error_is_bounded(wire: str, bound: float) -> None:
    model, U = subspace_model(16, 2)
    fmt = fmt_for(16, wire)
    x, y = batch()
    with torch.no_grad():
        h = split_model(model, 2)[0](x)
    payload = encode_activations(fmt, h, x, y, U, model.embed_fixed)
    rebuilt, _, _ = decode_activations(fmt, payload, U, model.embed_fixed)
    sent = h - model.embed_fixed[x]  # the part that travels; T_fixed[tok] is rebuilt exactly
    assert 0 < (rebuilt - h).norm() / sent.norm() < bound
    g = torch.randn(BATCH, LEN, CFG.d_model)
    back = decode_gradients(fmt, encode_gradients(fmt, g, U), BATCH, LEN, U)
    assert (back - g @ U @ U.T).norm() / (g @ U).norm() < bound


def test_encoder_refuses_non_finite_values() -> None:
    fmt = fmt_for(None, "fp16")
    x, y = batch()
    with pytest.raises(PayloadError):
        encode_activations(fmt, torch.full((BATCH, LEN, CFG.d_model), 1e6), x, y)  # fp16 overflow
    with pytest.raises(PayloadError):
        encode_gradients(fmt, torch.full((BATCH, LEN, CFG.d_model), float("nan")))


def test_malformed_payloads_raise_payload_error_only() -> None:
    model, U = subspace_model(16, 2)
    table, fmt = model.embed_fixed, fmt_for(16, "bf16")
    x, y = batch()
    forward = encode_activations(fmt, torch.randn(BATCH, LEN, CFG.d_model), x, y, U, table)
    backward = encode_gradients(fmt, torch.randn(BATCH, LEN, CFG.d_model), U)

    def nan_at(payload: bytes, value_index: int) -> bytes:
        offset = HEADER.size + 2 * value_index
        return payload[:offset] + b"\xc0\x7f" + payload[offset + 2 :]  # bf16 NaN

    bad_id = forward[:-2] + (CFG.vocab_size).to_bytes(2, "little")
    bad = [
        forward[:-1],
        forward + b"\0",
        forward[:10],
        b"XXXX" + forward[4:],
        forward[:4] + b"\x02" + forward[5:],  # version
        backward,  # a gradient message where activations are expected
        nan_at(forward, 0),
        bad_id,
        None,
        "text",
    ]
    for payload in bad:
        with pytest.raises(PayloadError):
            decode_activations(fmt, payload, U, table)
    for other in (fmt_for(8, "bf16"), fmt_for(16, "fp16"), fmt_for(None, "bf16")):  # wrong k, dtype, mode
        basis = U[:, : other.rank] if other.rank else None
        with pytest.raises(PayloadError):
            decode_activations(other, forward, basis, table)
    for payload, shape in ((nan_at(backward, 7), (BATCH, LEN)), (backward, (BATCH, LEN + 1)), (forward, (BATCH, LEN))):
        with pytest.raises(PayloadError):
            decode_gradients(fmt, payload, *shape, U)

    rng, refused = random.Random(0), 0
    for _ in range(300):
        data = bytearray(forward)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(HEADER.size + 8)] = rng.randrange(256)  # header and the first values
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        try:
            decode_activations(fmt, bytes(data), U, table)
        except PayloadError:
            refused += 1
    assert refused > 200
