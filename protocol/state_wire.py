"""The shard-state blobs peers serve each other, as bytes: a shard's state (`state`), the subspace run's token
tables (`fixed`: T_fixed, `embed`: E_S) and the entries of E_S a round's outer step changed (`embed-change`).

Each is a `tensor_file` tree (no pickle). A late joiner parses a donor's bytes with these rules before it looks
at the fingerprint the donor advertised (`client/outer/shard_state.py` checks that, and decides whom to ask), so a
malformed blob is refused here, whoever sent it. The layouts are part of the protocol: a key renamed here is a
blob every older peer refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hetero_node.protocol import tensor_file
from hetero_node.protocol.errors import PayloadError

STATE = "state"
"""Blob kind of a shard's state."""
FIXED = "fixed"
"""Blob kind and fingerprint key of the fixed token table."""
EMBED = "embed"
"""Blob kind and fingerprint key of the learned embedding E_S (after the round's drift transfer)."""
EMBED_CHANGE = "embed-change"
"""Blob kind of the entries of E_S a round's outer step changed (`models.subspace.embedding_change`)."""

Shape = tuple[int, ...]


def to_bytes(state: dict[str, Any]) -> bytes:
    """Serialize a state for the wire (tensors and plain Python values only; `protocol/tensor_file.py`)."""
    return tensor_file.dumps(state)


def from_bytes(data: bytes) -> dict[str, Any]:
    """Deserialize a peer's state without unpickling anything; `PayloadError` if it is not one."""
    state = tensor_file.loads(data)
    if not isinstance(state, dict):
        raise PayloadError("peer state is not a dictionary")
    return state


def max_state_bytes(shapes: Sequence[Shape]) -> int:
    """Generous bound on a serialized state (fp32 tensors, optional shared outer state of the same size, table,
    overhead): what a fetch of one accepts."""
    return 2 * sum(4 * torch.Size(s).numel() for s in shapes) + (1 << 22)


def max_change_bytes(table_shape: Shape) -> int:
    """Bound on an embedding change: at most half the entries with their positions, or all values."""
    return 4 * torch.Size(table_shape).numel() + (1 << 20)


def encode_state(
    round_: int, tensors: Sequence[Tensor], fixed: Tensor | None, shared: Sequence[Tensor] | None
) -> bytes:
    """A shard's state of `round_`: its tensors, T_fixed in a subspace run, and the method's shared outer state."""
    state: dict[str, Any] = {"round": round_, "tensors": list(tensors)}
    if fixed is not None:
        state[FIXED] = fixed
    if shared is not None:
        state["shared"] = list(shared)
    return to_bytes(state)


def parse_state(data: bytes, shapes: Sequence[Shape], fixed_shape: Shape | None) -> dict[str, Any]:
    """A donor's shard state with the tensors of `shapes`, and T_fixed of `fixed_shape` when the run has one, all
    finite fp32; `PayloadError` otherwise. The shared outer state is checked by the method that adopts it."""
    state = from_bytes(data)
    tensors, fixed = state.get("tensors"), state.get(FIXED)
    if not isinstance(tensors, list) or [tuple(getattr(t, "shape", ())) for t in tensors] != list(shapes):
        raise PayloadError("state has the wrong shapes")
    if (fixed is None) != (fixed_shape is None) or (fixed is not None and tuple(fixed.shape) != fixed_shape):
        raise PayloadError(f"state has no fixed table of shape {fixed_shape}")
    if not all(finite_fp32(t) for t in [*tensors, *([] if fixed is None else [fixed])]):
        raise PayloadError("state holds non-fp32 or non-finite values")
    return state


def encode_table(round_: int, kind: str, table: Tensor) -> bytes:
    """T_fixed (`kind` FIXED) or E_S (EMBED) of `round_`."""
    return to_bytes({"round": round_, kind: table})


def parse_table(data: bytes, kind: str, shape: Shape) -> Tensor:
    """The `kind` table of `shape` in fp32 from a donor's bytes; `PayloadError` otherwise."""
    table = from_bytes(data).get(kind)
    if not isinstance(table, Tensor) or tuple(table.shape) != shape or table.dtype != torch.float32:
        raise PayloadError(f"{kind} table of shape {tuple(getattr(table, 'shape', ()))} is not fp32 of {shape}")
    return table


def encode_change(positions: Tensor, values: Tensor) -> bytes:
    """The entries of E_S a round's outer step changed: their flat positions and new values."""
    return to_bytes({"positions": positions, "values": values})


def parse_change(data: bytes) -> tuple[Tensor, Tensor]:
    """(positions, values) of an embedding change; only types are checked: the caller checks what they rebuild."""
    change = from_bytes(data)
    positions, values = change.get("positions"), change.get("values")
    if not (isinstance(positions, Tensor) and finite_fp32(values)):
        raise PayloadError("an embedding change is int32 positions and finite fp32 values")
    return positions, values


def finite_fp32(t: Any) -> bool:
    return isinstance(t, Tensor) and t.dtype == torch.float32 and bool(t.isfinite().all())
