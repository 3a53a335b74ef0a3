"""A Llama-style decoder-only transformer (nanoGPT-short), buildable whole or as a contiguous slice.

Two properties matter to the rest of the system:

* Parameter names are global: blocks live in an `nn.ModuleDict` keyed by their layer index in the full model, so
  `layers.5.attn.wo.weight` names the same tensor in the full model and in whichever pipeline stage owns layer 5.
  Shards, fingerprints and all-reduce groups are matched by these names.
* Initialisation is per parameter, from a generator seeded by (seed, global name), so a stage built alone on a
  weak peer starts from exactly the weights the same parameters have in the full model, without allocating it.

Every write into the residual stream goes through `attn.wo` or `mlp.w_down`; the subspace-constrained boundary
code relies on those names. That code may also give a module a fixed token table, the buffer `embed_fixed`
(vocab × d_model, never a parameter, see `hetero_node.models.subspace`): the embedding is then
`embed(tok) + embed_fixed[tok]`. Without it (the default) the buffer is None and absent from `state_dict()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
from torch import nn
from torch.nn import functional as F

from hetero_node.models.config import ModelConfig
from hetero_node.protocol.errors import ConfigError

RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.w_down.weight")
"""Suffixes of the projections that write into the residual stream (scaled init, subspace constraint)."""


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (tensor cores, fp32 master weights); plain fp32 elsewhere (CPU bf16 is slow)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the mean of squares in bf16 loses too much precision
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, shape (max_seq_len, head_dim / 2); on the CPU, whatever the
    default device (the module moves them with itself; on the meta device they would cost torch's compiler import,
    `models/meta.py`)."""
    freqs = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu") / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32, device="cpu"), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (first half, second half) coordinate pairs of x (B, H, T, head_dim) by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (run seed, global parameter name); Python's hash() is salted per process."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Transformer(nn.Module):
    """The decoder, or the slice of it holding `layers` (global indices) plus, optionally, embedding and head.

    With `with_embed` the input is token ids (B, T) int64, else hidden states (B, T, d_model). With `with_head`
    the output is logits (B, T, vocab_size), else hidden states. Build it under `meta.on_meta()` to inspect
    shapes and names without allocating; initialisation is skipped there.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        layers: range | None = None,
        with_embed: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        layers = range(cfg.n_layers) if layers is None else layers
        if cfg.tie_embeddings and not (with_embed and with_head):
            raise ConfigError(
                "tie_embeddings needs the embedding and the head in one module, but with more than one pipeline "
                "stage they sit on the first and the last stage: their shared weight would need a gradient "
                "exchange every step, which the pipeline does not do. Use tie_embeddings=False or one stage."
            )
        if layers.step != 1 or not (0 <= layers.start <= layers.stop <= cfg.n_layers):
            raise ConfigError(f"layer range {layers} is not a contiguous part of range({cfg.n_layers})")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if with_embed else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if with_head else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if with_head else None
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # derived from cfg: never checkpointed or sent
        self.register_buffer("rope_sin", sin, persistent=False)
        # the fixed token table of a subspace-compressed pipeline; None (absent from state_dict) until enabled
        self.embed_fixed: torch.Tensor | None
        self.register_buffer("embed_fixed", None)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Norms to one; matrices to N(0, init_std), residual outputs scaled by 1/sqrt(2·n_layers) (GPT-2)."""
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1:  # the only vectors are RMSNorm gains (no biases)
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(RESIDUAL_OUTPUTS) else self.cfg.init_std
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            # drawn on CPU so the values do not depend on the device the module lives on
            p.copy_(torch.empty(p.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {t} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        if self.embed is not None:
            tokens, x = x, self.embed(x)
            if self.embed_fixed is not None:
                x = x + F.embedding(tokens, self.embed_fixed)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.layers.values():
            x = block(x, cos, sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x
