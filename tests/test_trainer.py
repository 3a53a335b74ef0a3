"""The inner trainer: on CPU it computes exactly the step it always did, its compiled step agrees with the eager
one, a compile that fails leaves it training eagerly, and the loss comes back as a tensor, not a host sync."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from hetero_node.models.config import get_preset
from hetero_node.models.trainer import InnerTrainer, compile_wanted, cosine_lr
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.run_config import OptimConfig

CPU = torch.device("cpu")
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=0.5)


def batches(n: int, batch: int = 3, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, 256, (batch, seq), generator=generator) for _ in range(2)) for _ in range(n)]


def model() -> Transformer:
    return Transformer(get_preset("tiny"), seed=3)


def cheap_compile(monkeypatch: pytest.MonkeyPatch, backend: object = "aot_eager") -> None:
    """torch.compile with another backend: inductor's code generation takes over a minute per model on a small
    CPU; aot_eager runs the same graph capture (dynamo) and joint forward/backward graph (AOTAutograd)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))


def test_cpu_step_is_the_step_it_always_was() -> None:
    """The step before this change, written out: AdamW (decay on matrices only), fp32 cross-entropy, clip."""
    reference, trained = model(), model()
    matrices = [p for p in reference.parameters() if p.dim() >= 2]
    vectors = [p for p in reference.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": OPTIM.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=OPTIM.lr,
        betas=(OPTIM.beta1, OPTIM.beta2),
    )
    trainer = InnerTrainer(trained, OPTIM, total_steps=10, device=CPU)
    for step, (x, y) in enumerate(batches(4)):
        logits = reference(x)
        expected = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        expected.backward()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, 10, OPTIM)
        nn.utils.clip_grad_norm_(reference.parameters(), OPTIM.grad_clip)
        optimizer.step()

        loss = trainer.train_step(x, y)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
        assert loss.item() == expected.item()
    assert trainer.step == 4 and not trainer.in_flight and not trainer.compiled
    for a, b in zip(reference.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)
    held_out = batches(3)
    with torch.no_grad():
        means = [nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten()).item() for x, y in held_out]
    assert trainer.evaluate(held_out) == sum(means) / len(means)


def test_compiled_step_agrees_with_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    eager_model, compiled_model = model(), model()
    eager = InnerTrainer(eager_model, OPTIM, total_steps=10, device=CPU)
    cheap_compile(monkeypatch)
    compiled = InnerTrainer(compiled_model, OPTIM, total_steps=10, device=CPU, compile=True)
    for x, y in batches(3):
        assert compiled.train_step(x, y).item() == pytest.approx(eager.train_step(x, y).item(), rel=1e-5)
    assert compiled.compiled
    for a, b in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_warm_up_compiles_without_training(monkeypatch: pytest.MonkeyPatch) -> None:
    cheap_compile(monkeypatch)
    warmed = model()
    before = [p.detach().clone() for p in warmed.parameters()]
    trainer = InnerTrainer(warmed, OPTIM, total_steps=10, device=CPU, compile=True)
    trainer.warm_up(*batches(1)[0])
    assert trainer.compiled and trainer.step == 0 and not trainer.optimizer.state
    assert all(p.grad is None for p in warmed.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, warmed.parameters(), strict=True))


def test_a_failing_compile_leaves_the_trainer_eager_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> None:
        raise RuntimeError("no compiler here")

    eager_model, fallback_model = model(), model()
    eager = InnerTrainer(eager_model, OPTIM, total_steps=10, device=CPU)
    cheap_compile(monkeypatch, broken_backend)
    fallback = InnerTrainer(fallback_model, OPTIM, total_steps=10, device=CPU, compile=True)
    with caplog.at_level(logging.WARNING, logger="hetero_node.models.trainer"):
        for x, y in batches(3):
            assert fallback.train_step(x, y).item() == eager.train_step(x, y).item()
    assert not fallback.compiled
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
    assert "torch.compile failed" in caplog.records[0].message
    for a, b in zip(eager_model.parameters(), fallback_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_compile_is_for_cuda_only() -> None:
    assert compile_wanted(True, torch.device("cuda")) and compile_wanted(True, torch.device("cuda:1"))
    assert not compile_wanted(True, CPU) and not compile_wanted(False, torch.device("cuda"))


def test_an_accumulated_step_is_the_step_on_all_its_batches_at_once() -> None:
    """A stretched round's bigger steps: k batches accumulated give the step one batch k times as large gives (the
    same mean gradient, up to the order of float sums), and their mean loss."""
    parts = batches(3)
    whole = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    accumulated, at_once = model(), model()
    first = InnerTrainer(accumulated, OPTIM, total_steps=10, device=CPU)
    second = InnerTrainer(at_once, OPTIM, total_steps=10, device=CPU)
    for _ in range(2):
        loss = first.train_accumulated(parts)
        expected = second.train_step(*whole)
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    for a, b in zip(accumulated.parameters(), at_once.parameters(), strict=True):
        assert (a - b).abs().max() < 1e-5  # Adam amplifies float-order differences in near-zero gradients a little
    assert not all(torch.equal(a, b) for a, b in zip(accumulated.parameters(), model().parameters(), strict=True))
