"""Subspace-constrained pipeline boundaries (Protocol Models / SSN): the basis, the constraint and its upkeep.

Fix U ∈ R^{d×k} with orthonormal columns, the same on every peer and every boundary (`subspace_basis`), and
P = U Uᵀ. If every write into the residual stream before the last stage (`attn.wo`, `mlp.w_down`) has its output
(rows of the (d, in) weight) in span(U), and the token embedding is `T_fixed + E_S` with the rows of the learned
E_S (`embed.weight`) in span(U), then at any boundary x − T_fixed[tok] ∈ span(U) exactly: a boundary carries
c = Uᵀ(x − T_fixed[tok]) (k numbers per token) plus the token ids, and the receiver rebuilds x = U c + T_fixed[tok]
(`hetero_node.protocol.boundary_codec`).

T_fixed lives in the buffer `embed_fixed` of a `Transformer` (never a parameter, never trained). Every stage
needs it: stage 0 to embed, every later stage to decode its incoming boundary. `enable_subspace` creates it by
splitting the current embedding E into T_fixed = E − E P and E_S = E P, which leaves the model's function
unchanged. A stage without `embed` gets E from the caller: `initial_embedding(cfg, seed)` at the start of a run
(every stage regenerates it from the seed, no transfer), or from a checkpoint holding `embed_fixed` later.

Per-round upkeep, each step its own function so a caller can switch it off (design notes §4, §7.3):

* `project_` — W ← P W on the constrained matrices, E_S ← E_S P (a virtual replica's start point, and after
  every inner optimizer step). Lossy for anything outside span(U).
* `drift_transfer_` / `drift_transfer_fixed_` — after an outer step E_S has left span(U); D = E_S − E_S P moves
  into T_fixed (T_fixed += D, E_S ← E_S P), which leaves T_fixed + E_S, hence the model, unchanged. Stage 0
  (or a full replica) holds E_S and calls `drift_transfer_`; every other stage needs the same global E_S (the
  aggregated `embed.weight` after the outer step, before its projection): it keeps its own copy, receives only
  the entries the outer step changed (`embedding_change`, a few percent of the table under SparseLoCo;
  `apply_embedding_change`), and computes the new tables with `transferred_table` (`drift_transfer_fixed_` does
  the same on a module). All compute D on the CPU in float64 from the same inputs, so every peer's T_fixed stays
  identical.

Gradients: the pipelined gradient (backward through Uᵀ g at each boundary) equals the full model's gradient for
every unconstrained parameter, and its projection (P g for output projections, g P for E_S) for the constrained
ones; the off-subspace part differs, which is why the weights are re-projected after each optimizer step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hetero_node.models.config import ModelConfig
from hetero_node.models.stages import stage_layer_ranges
from hetero_node.models.transformer import RESIDUAL_OUTPUTS, Transformer, param_seed
from hetero_node.protocol.errors import ConfigError

EMBED = "embed.weight"


def default_rank(d_model: int) -> int:
    """d/8 (87.5% boundary compression, the conservative end of the reported range), at least 1."""
    return max(1, d_model // 8)


def subspace_basis(d_model: int, rank: int, seed: int) -> Tensor:
    """U (d_model × rank, float32 on CPU) with orthonormal columns, identical on every machine for (d, k, seed).

    QR of a seeded Gaussian in float64 on the CPU, signs fixed so R has a positive diagonal (the QR factorisation
    is then unique, so LAPACK builds can differ only in float64 rounding, which the cast to float32 absorbs).
    """
    if not 1 <= rank <= d_model:
        raise ConfigError(f"subspace rank must be between 1 and d_model={d_model}, got {rank}")
    gen = torch.Generator().manual_seed(param_seed(seed, "subspace_basis"))
    q, r = torch.linalg.qr(torch.randn(d_model, rank, dtype=torch.float64, generator=gen))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32).contiguous()


def initial_embedding(cfg: ModelConfig, seed: int) -> Tensor:
    """The `embed.weight` a run starts from (vocab × d): what a stage without `embed` splits at round 0."""
    return Transformer(cfg, seed, layers=range(0), with_embed=True, with_head=False).embed.weight.detach()


def constrained_parameter_names(cfg: ModelConfig, n_stages: int) -> list[str]:
    """The parameters that must stay in span(U) for `n_stages`-stage pipelines, in model order.

    `embed.weight` (rows in span(U)) and `layers.{i}.attn.wo.weight`, `layers.{i}.mlp.w_down.weight` (outputs in
    span(U)) for every layer i before the first layer of the last stage. The last stage is free: nothing leaves
    it. With one stage there is no boundary and the set is empty.
    """
    if n_stages == 1:
        return []
    first_free = stage_layer_ranges(cfg.n_layers, n_stages)[-1].start
    return [EMBED] + [f"layers.{i}.{suffix}" for i in range(first_free) for suffix in RESIDUAL_OUTPUTS]


def _check_basis(module: Transformer, U: Tensor) -> None:
    if U.dim() != 2 or U.shape[0] != module.cfg.d_model:
        raise ConfigError(f"subspace basis of shape {tuple(U.shape)} does not fit d_model={module.cfg.d_model}")


@torch.no_grad()
def project_(module: Transformer, U: Tensor, names: list[str]) -> None:
    """In place: W ← U(UᵀW) for the residual output projections in `names`, E_S ← E_S U Uᵀ for `embed.weight`.

    Names the module does not hold (another stage's) are skipped, so every stage can pass the full set.
    """
    _check_basis(module, U)
    params = dict(module.named_parameters())
    for name in names:
        if name not in params:
            continue
        w = params[name]
        u = U.to(w.device, w.dtype)
        if name == EMBED:
            w.copy_((w @ u) @ u.T)
        elif name.endswith(RESIDUAL_OUTPUTS):
            w.copy_(u @ (u.T @ w))
        else:
            raise ConfigError(f"{name} is neither the embedding nor a residual output projection")


def _drift(embedding: Tensor, U: Tensor) -> tuple[Tensor, Tensor]:
    """(E − E P, E P) in float64 on the CPU: the same bits on every peer that holds the same E."""
    e, u = embedding.detach().to("cpu", torch.float64), U.to("cpu", torch.float64)
    inside = (e @ u) @ u.T
    return e - inside, inside


def _set_fixed(module: Transformer, table: Tensor) -> None:
    module.embed_fixed = table.to(module.rope_cos.device, torch.float32).contiguous()


@torch.no_grad()
def enable_subspace(module: Transformer, U: Tensor, embedding: Tensor | None = None) -> Tensor:
    """Give `module` the fixed table T_fixed = E − E U Uᵀ and, if it holds `embed`, set E_S = E U Uᵀ; returns E_S
    (fp32, CPU), which a stage without `embed` keeps to follow T_fixed's upkeep.

    E is the module's own `embed.weight`; a stage without `embed` must be given it (`initial_embedding` at round
    0). The model's function is unchanged. To load a checkpointed T_fixed, enable first, then `load_state_dict`.
    """
    _check_basis(module, U)
    if module.embed_fixed is not None:
        raise ConfigError("the subspace embedding is already enabled on this module")
    if (module.embed is None) == (embedding is None):
        raise ConfigError("pass the embedding exactly when the module has no embed of its own")
    source = module.embed.weight if module.embed is not None else embedding
    if tuple(source.shape) != (module.cfg.vocab_size, module.cfg.d_model):
        raise ConfigError(f"embedding of shape {tuple(source.shape)} does not fit the model config")
    outside, inside = _drift(source, U)
    _set_fixed(module, outside)
    inside = inside.to(torch.float32)
    if module.embed is not None:
        module.embed.weight.copy_(inside)
    return inside


@torch.no_grad()
def drift_transfer_(module: Transformer, U: Tensor) -> None:
    """T_fixed += E_S − E_S U Uᵀ; E_S ← E_S U Uᵀ on a module holding both (stage 0, full model): function-preserving."""
    _check_basis(module, U)
    if module.embed is None or module.embed_fixed is None:
        raise ConfigError("drift transfer needs a module with embed and an enabled fixed table")
    fixed, inside = transferred_table(module.embed_fixed, U, module.embed.weight)
    _set_fixed(module, fixed)
    module.embed.weight.copy_(inside)


@torch.no_grad()
def drift_transfer_fixed_(module: Transformer, U: Tensor, embedding: Tensor) -> None:
    """T_fixed += E_S − E_S U Uᵀ on a stage holding only T_fixed, given the global E_S stage 0 transfers from.

    `embedding` is the aggregated `embed.weight` after the outer step, before stage 0's `drift_transfer_`
    projects it; the result then equals stage 0's T_fixed bit for bit.
    """
    _check_basis(module, U)
    if module.embed is not None or module.embed_fixed is None:
        raise ConfigError("drift_transfer_fixed_ is for a module with a fixed table and no embed of its own")
    if embedding.shape != module.embed_fixed.shape:
        raise ConfigError(f"embedding of shape {tuple(embedding.shape)} does not fit the fixed table")
    _set_fixed(module, transferred_table(module.embed_fixed, U, embedding)[0])


@torch.no_grad()
def transferred_table(fixed: Tensor, U: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
    """(T_fixed + E − E U Uᵀ, E U Uᵀ) as fp32 CPU tensors, without touching a module: what `drift_transfer_`
    leaves in a module holding T_fixed = `fixed` and E_S = `embedding`, bit for bit."""
    outside, inside = _drift(embedding, U)
    return (fixed.to("cpu", torch.float64) + outside).to(torch.float32), inside.to(torch.float32)


def embedding_change(before: Tensor, after: Tensor) -> tuple[Tensor, Tensor]:
    """The entries an outer step changed in E_S, bit for bit: (flat int32 positions, fp32 values after). SparseLoCo's
    aggregate touches a few percent of them, so later stages follow E_S (and so T_fixed) from this, not the table.
    When more than half changed, positions are empty and values hold the whole table: never more than the table."""
    if before.numel() > torch.iinfo(torch.int32).max:
        raise ConfigError(f"an embedding of {before.numel():,} entries is beyond int32 positions")
    flat_before, flat_after = before.detach().cpu().reshape(-1), after.detach().cpu().reshape(-1)
    positions = (flat_before.view(torch.int32) != flat_after.view(torch.int32)).nonzero().reshape(-1)
    if 2 * len(positions) > len(flat_after):
        return torch.zeros(0, dtype=torch.int32), flat_after.clone()
    return positions.to(torch.int32), flat_after[positions]


def apply_embedding_change(embedding: Tensor, positions: Tensor, values: Tensor) -> Tensor:
    """A copy of `embedding` with `embedding_change`'s entries written in; `ValueError` if they do not fit it."""
    if positions.dtype != torch.int32 or values.dtype != torch.float32 or positions.dim() != 1 or values.dim() != 1:
        raise ValueError("an embedding change is int32 positions and fp32 values")
    if len(positions) == 0 and len(values) == embedding.numel():  # the whole table
        return values.reshape(embedding.shape).clone()
    if positions.shape != values.shape:
        raise ValueError(f"an embedding change of {len(positions)} positions and {len(values)} values")
    if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= embedding.numel()):
        raise ValueError(f"an embedding change addresses entries outside the {tuple(embedding.shape)} table")
    changed = embedding.detach().cpu().clone()
    changed.view(-1)[positions.long()] = values
    return changed
