"""The project's weights as a Hugging Face `LlamaForCausalLM` checkpoint: tensor names, the folded embedding, config.

Our `Transformer` is Llama's architecture exactly, so the export is a renaming, not a conversion:

* pre-norm RMSNorm computed in fp32 (`x · rsqrt(mean(x²) + eps) · weight`), SwiGLU MLP, bias-free linears,
  softmax scaled by 1/sqrt(head_dim), no GQA (num_key_value_heads = num_attention_heads);
* RoPE rotates (first half, second half) coordinate pairs of each head with inverse frequencies
  theta^(-2i/head_dim): the layout of HF's `rotate_half`, so q/k need no permutation (that permutation is only
  for Meta's original interleaved checkpoints);
* a subspace run's embedding is `embed.weight + embed_fixed` (E_S + T_fixed): folded into one matrix by the same
  fp32 addition the forward pass does, so the HF embedding output is bit-identical.

The head is always written as `lm_head.weight` with `tie_word_embeddings` false: correct for a tied model too, and
a tied model with a fixed table would have a head that differs from the folded embedding anyway.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hetero_node.models.config import ModelConfig
from hetero_node.models.meta import on_meta
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.errors import ConfigError

logger = logging.getLogger(__name__)

FIXED_TABLE = "embed_fixed"
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
"""Our per-layer suffix → Llama's, under `layers.{i}.` and `model.layers.{i}.` respectively."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor of the full model's state_dict (built on the meta device: no memory), the
    fixed table included: it is optional, but when present it has the embedding's shape."""
    with on_meta():
        shapes = {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
    return {**shapes, FIXED_TABLE: shapes["embed.weight"]}


def llama_state_dict(cfg: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` (a full model's state_dict, `embed_fixed` optional) under Llama's names, fp32, contiguous."""
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in state and n != FIXED_TABLE]
    unexpected = sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ConfigError(f"not a full model of this config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ConfigError(f"{name} has shape {tuple(tensor.shape)}, the model config says {shapes[name]}")
    embed = state["embed.weight"].float()
    if FIXED_TABLE in state:
        embed = embed + state[FIXED_TABLE].float()  # the forward pass's own fp32 sum: E_S + T_fixed
    out = {"model.embed_tokens.weight": embed}
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = state[f"layers.{i}.{ours}"]
    out["model.norm.weight"] = state["norm.weight"]
    out["lm_head.weight"] = state["head.weight"]
    return {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in out.items()}


def llama_config(cfg: ModelConfig, eos_id: int | None) -> dict[str, Any]:
    """config.json of the equivalent `LlamaConfig` (rope_theta both top-level for transformers 4.x and in
    `rope_parameters` for 5.x). No BOS: training never prepended one; documents are separated by `eos_id`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def write_llama_weights(directory: Path, cfg: ModelConfig, state: dict[str, Tensor], eos_id: int | None) -> int:
    """config.json and model.safetensors of the model in `state` into `directory` (which must exist); returns the
    number of parameters written."""
    from safetensors.torch import save_file

    tensors = llama_state_dict(cfg, state)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(llama_config(cfg, eos_id), indent=2) + "\n")
    n_params = sum(t.numel() for t in tensors.values())
    logger.info("wrote %d tensors (%d parameters) to %s", len(tensors), n_params, directory)
    return n_params
