"""Model presets, stage splitting and shard fingerprints: the parts every peer must agree on bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from hetero_node.models.config import PRESETS, ModelConfig, get_preset
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.stages import StageModule, split_model, stage_layer_ranges
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.errors import ConfigError

SEED = 7
NOMINAL = {"178m": 178e6, "560m": 560e6, "1b": 1e9}


def meta_param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_sizes(name: str) -> None:
    cfg = get_preset(name)
    n = meta_param_count(cfg)
    assert cfg.n_params() == n
    if name == "tiny":
        assert 0.7e6 <= n <= 1.3e6
    elif name == "small":
        assert 10e6 <= n <= 30e6
    else:
        assert abs(n / NOMINAL[name] - 1) <= 0.03
        assert cfg.vocab_size == 32000


def test_tied_param_count_and_stage_restriction() -> None:
    cfg = get_preset("tiny", tie_embeddings=True)
    assert cfg.n_params() == meta_param_count(cfg) == get_preset("tiny").n_params() - cfg.vocab_size * cfg.d_model
    model = Transformer(cfg)
    assert model.head.weight is model.embed.weight
    with pytest.raises(ConfigError, match="tie_embeddings"):
        StageModule(cfg, 0, 2)


def test_unknown_preset_names_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        get_preset("7b")
    assert all(name in str(err.value) for name in PRESETS)
    with pytest.raises(ConfigError, match="fields"):
        get_preset("tiny", width=3)


def test_overrides_and_validation() -> None:
    assert get_preset("small", vocab_size=512).vocab_size == 512
    for bad in ({"d_model": 130}, {"n_heads": 64, "d_model": 192}, {"n_layers": 0}, {"init_std": 0.0}):
        with pytest.raises(ConfigError):
            get_preset("tiny", **bad)


@given(n_layers=st.integers(1, 64), data=st.data())
def test_layer_ranges_contiguous_and_balanced(n_layers: int, data: st.DataObject) -> None:
    n_stages = data.draw(st.integers(1, n_layers))
    ranges = stage_layer_ranges(n_layers, n_stages)
    assert len(ranges) == n_stages
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n_stages", [0, -1, 5])
def test_invalid_stage_count(n_stages: int) -> None:
    with pytest.raises(ConfigError):
        stage_layer_ranges(4, n_stages)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_independent_stages_match_full_model_init(n_stages: int) -> None:
    cfg = get_preset("tiny")
    full = dict(Transformer(cfg, seed=SEED).named_parameters())
    seen = []
    for s in range(n_stages):
        for name, p in StageModule(cfg, s, n_stages, seed=SEED).named_parameters():
            assert torch.equal(p, full[name]), name
            seen.append(name)
    assert seen == list(full)  # every parameter owned exactly once, in the model's order
    assert not torch.equal(Transformer(cfg, seed=SEED + 1).embed.weight, full["embed.weight"])


def run_pipeline(stages: list[StageModule], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward stage by stage through detached boundaries, then backward by handing each stage the gradient of
    its output, as peers do over the network; returns the logits."""
    outputs, boundaries, h = [], [], x
    for stage in stages[:-1]:
        outputs.append(stage(h))
        h = outputs[-1].detach().requires_grad_()
        boundaries.append(h)
    logits = stages[-1](h)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    for out, boundary in zip(reversed(outputs), reversed(boundaries), strict=True):
        out.backward(boundary.grad)
    return logits


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_stage_composition_matches_full_model(n_stages: int) -> None:
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    x, y = torch.randint(0, cfg.vocab_size, (2, 2, 32)).unbind(0)
    full = Transformer(cfg, seed=SEED)
    ref = full(x)
    F.cross_entropy(ref.flatten(0, 1), y.flatten()).backward()
    stages = [StageModule(cfg, s, n_stages, seed=SEED) for s in range(n_stages)]
    logits = run_pipeline(stages, x, y)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-6)
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    assert grads.keys() == dict(full.named_parameters()).keys()
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6, msg=name)


def test_split_model_copies_current_weights() -> None:
    cfg = get_preset("tiny")
    model = Transformer(cfg, seed=SEED)
    with torch.no_grad():
        model.layers["2"].mlp.w_down.weight.add_(1.0)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    h = x
    for stage in split_model(model, 3):
        h = stage(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=1e-6)


def test_shard_names_follow_stage_modules() -> None:
    cfg = get_preset("tiny")
    names = shard_parameter_names(cfg, 2)
    assert names[0][0] == "embed.weight" and names[1][-2:] == ["norm.weight", "head.weight"]
    assert names[0][1:10] == [
        "layers.0.attn_norm.weight",
        "layers.0.attn.wq.weight",
        "layers.0.attn.wk.weight",
        "layers.0.attn.wv.weight",
        "layers.0.attn.wo.weight",
        "layers.0.mlp_norm.weight",
        "layers.0.mlp.w_gate.weight",
        "layers.0.mlp.w_up.weight",
        "layers.0.mlp.w_down.weight",
    ]
    model = Transformer(cfg, seed=SEED)
    stage = StageModule(cfg, 1, 2, seed=SEED)
    assert fingerprint(shard_tensors(model, names[1])) == fingerprint(shard_tensors(stage, names[1]))
    with pytest.raises(KeyError):
        shard_tensors(stage, names[0])


def test_fingerprint_sensitivity() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(4096)
    base = fingerprint([a, b])
    assert fingerprint([a.clone(), b.clone()]) == base
    assert fingerprint([a.t().contiguous().t(), b]) == base  # layout is not content
    nudged = a.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    assert fingerprint([nudged, b]) != base
    assert fingerprint([b, a]) != base
    assert fingerprint([a.reshape(32, 128), b]) != base  # same bytes, other shape
    assert fingerprint([a.double(), b]) != base


def test_fingerprint_bf16() -> None:
    a = torch.randn(8, 8).bfloat16()
    nudged = a.clone()
    nudged.view(torch.int16)[0, 0] += 1  # one ulp
    assert fingerprint([a]) == fingerprint([a.clone()]) != fingerprint([nudged])
