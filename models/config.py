"""Model shapes and the named presets every peer of a run must agree on.

A preset name travels in the run config, so a joiner rebuilds exactly the model the swarm trains. Sizes are
counted analytically (`ModelConfig.n_params`) so a planner can size memory for a 1B model without allocating it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hetero_node.protocol.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder-only transformer: pre-norm RMSNorm, RoPE, SwiGLU, bias-free linears."""

    vocab_size: int = field(default=256, metadata={"help": "Token vocabulary size (256: byte-level tokenizer)."})
    d_model: int = field(default=128, metadata={"help": "Width of the residual stream."})
    n_layers: int = field(default=4, metadata={"help": "Number of transformer blocks."})
    n_heads: int = field(default=4, metadata={"help": "Attention heads; d_model / n_heads must be even (RoPE)."})
    ffn_hidden: int = field(default=384, metadata={"help": "Hidden width of the SwiGLU MLP."})
    max_seq_len: int = field(default=128, metadata={"help": "Longest sequence the RoPE tables cover."})
    tie_embeddings: bool = field(
        default=False, metadata={"help": "Share the input embedding and the output head (single-stage runs only)."}
    )
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base frequency."})
    norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon."})
    init_std: float = field(default=0.02, metadata={"help": "Std of the normal initialisation of weight matrices."})

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "ffn_hidden": self.ffn_hidden,
            "max_seq_len": self.max_seq_len,
        }
        bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value < 1}
        if bad:
            raise ConfigError(f"model sizes must be positive integers, got {bad}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dimension {self.head_dim} must be even: RoPE rotates pairs of coordinates")
        if not (self.rope_theta > 0 and self.norm_eps > 0 and self.init_std > 0):
            raise ConfigError(
                f"rope_theta, norm_eps and init_std must be positive, got "
                f"{self.rope_theta}, {self.norm_eps}, {self.init_std}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        """Trainable parameters, embeddings and head included (a tied head counts once)."""
        d = self.d_model
        per_layer = 4 * d * d + 3 * d * self.ffn_hidden + 2 * d  # wq wk wv wo, gate up down, two norms
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * per_layer + d  # + final norm


# tiny/small use the byte-level vocabulary (256) so they run anywhere without a tokenizer file. small (10.3M, the
# CPU demo) sits near the bottom of its 10–30M range because a CPU step is matmul-bound (≈6·N FLOPs per token):
# on 2 cores it trains ≈2k tokens/s where a 14M model does ≈1.4k; its 8 layers split evenly into 2 or 4 stages.
# The paper-sized presets use vocab_size 32000 (the Llama tokenizer) and are sized to 178M / 560M / 1B parameters
# including embeddings and the untied head at that vocabulary. ffn_hidden is 8/3·d_model rounded up to a multiple of 64.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, ffn_hidden=384, max_seq_len=128),
    "small": ModelConfig(vocab_size=256, d_model=320, n_layers=8, n_heads=5, ffn_hidden=896, max_seq_len=256),
    "178m": ModelConfig(vocab_size=32000, d_model=768, n_layers=18, n_heads=12, ffn_hidden=2048, max_seq_len=2048),
    "560m": ModelConfig(vocab_size=32000, d_model=1280, n_layers=24, n_heads=20, ffn_hidden=3456, max_seq_len=2048),
    "1b": ModelConfig(vocab_size=32000, d_model=1536, n_layers=32, n_heads=12, ffn_hidden=4096, max_seq_len=2048),
}


def get_preset(name: str, **overrides: object) -> ModelConfig:
    """The preset called `name`, with fields replaced by `overrides` (e.g. vocab_size for a custom tokenizer)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as e:  # an override that is not a field
        fields = ", ".join(f.name for f in dataclasses.fields(ModelConfig))
        raise ConfigError(f"invalid override for preset {name!r} ({e}); fields: {fields}") from e
