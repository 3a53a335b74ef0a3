"""Wire codec of a pipeline boundary: forward activations and backward activation-gradients between stages.

With subspace compression (`hetero_node.models.subspace`) the forward message carries c = Uᵀ(x − T_fixed[tok])
(k numbers per token) and the token ids; the receiver rebuilds x = U c + T_fixed[tok]. The backward message
carries Uᵀ g, which the receiver expands to U Uᵀ g. With compression "none" (dense, for ablation) x and g travel
as they are (width d_model). Both ends must agree on a `BoundaryFormat`, U and T_fixed bit for bit; T_fixed
changes every round (drift transfer), so it is passed at each call, never cached here.

Targets: the forward message ships each sequence's window of L + 1 ids (the inputs, then the last target), since
the data pipeline's targets are the inputs shifted by one; the last stage reads inputs = ids[:, :L] and
targets = ids[:, 1:]. That costs one id per sequence instead of one per token.

Byte layout (little-endian). Header, 21 bytes:

| offset | size | field                                                            |
|--------|------|------------------------------------------------------------------|
| 0      | 4    | magic `b"HNBD"`                                                  |
| 4      | 1    | version, u8 (= 1)                                                |
| 5      | 1    | kind, u8: 0 = activations (forward), 1 = gradients (backward)    |
| 6      | 1    | compression, u8: 0 = none (dense), 1 = subspace                  |
| 7      | 1    | wire dtype, u8: 0 = fp32, 1 = fp16, 2 = bf16                     |
| 8      | 1    | id dtype, u8: 0 = no ids (gradients), 1 = u16, 2 = i32           |
| 9      | 4    | batch b, u32                                                     |
| 13     | 4    | sequence length L, u32                                           |
| 17     | 4    | width w, u32 (rank k with subspace compression, else d_model)    |

Body: b·L·w values in the wire dtype, row-major (b, L, w); then, forward only, b·(L + 1) ids (u16 when
vocab_size ≤ 65536, else i32), row-major (b, L + 1). A message's length is fixed by its header, and the decoder
checks it exactly, along with every header field, the ids' range and the values' finiteness.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hetero_node.protocol.errors import ConfigError, PayloadError

MAGIC = b"HNBD"
VERSION = 1
HEADER = struct.Struct("<4sBBBBBIII")
FORWARD, BACKWARD = "forward", "backward"
_KIND = {FORWARD: 0, BACKWARD: 1}
WIRE_DTYPES: dict[str, tuple[int, torch.dtype, str]] = {
    "fp32": (0, torch.float32, "<i4"),
    "fp16": (1, torch.float16, "<i2"),
    "bf16": (2, torch.bfloat16, "<i2"),
}
"""wire name → (header code, torch dtype, little-endian integer view of its bits)."""
_ID_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}


def id_code(vocab_size: int) -> int:
    """Header code of the token-id dtype: u16 when every id fits, else i32."""
    return 1 if vocab_size <= 1 << 16 else 2


def boundary_bytes_per_token(width: int, wire: str, direction: str, id_bytes: int) -> int:
    """Bytes per token of one boundary message: forward w·s + id_bytes, backward w·s (s: wire dtype size).

    Not counted: the header and, forward, the one extra id per sequence (`boundary_message_bytes` has both).
    """
    values = width * WIRE_DTYPES[wire][1].itemsize
    return values + id_bytes if direction == FORWARD else values


def boundary_message_bytes(batch: int, seq_len: int, width: int, wire: str, direction: str, id_bytes: int) -> int:
    """Exact length of one boundary message of `batch` sequences of `seq_len` tokens."""
    extra_id = batch * id_bytes if direction == FORWARD else 0
    return HEADER.size + batch * seq_len * boundary_bytes_per_token(width, wire, direction, id_bytes) + extra_id


@dataclass(frozen=True)
class BoundaryFormat:
    """What both ends of every boundary of a run must agree on (from the run config)."""

    d_model: int
    vocab_size: int
    max_seq_len: int
    rank: int | None = None
    """Subspace rank k; None sends x and g dense (compression "none")."""
    wire: str = "bf16"

    def __post_init__(self) -> None:
        if self.wire not in WIRE_DTYPES:
            raise ConfigError(f"boundary wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire!r}")
        if min(self.d_model, self.vocab_size, self.max_seq_len) < 1 or self.vocab_size > 2**31:
            raise ConfigError(f"invalid boundary sizes {self}")
        if self.rank is not None and not 1 <= self.rank <= self.d_model:
            raise ConfigError(f"subspace rank must be between 1 and d_model={self.d_model}, got {self.rank}")

    @property
    def width(self) -> int:
        return self.d_model if self.rank is None else self.rank

    @property
    def id_bytes(self) -> int:
        return _ID_DTYPES[id_code(self.vocab_size)].itemsize

    def message_bytes(self, direction: str, batch: int, seq_len: int) -> int:
        id_bytes = self.id_bytes if direction == FORWARD else 0
        return boundary_message_bytes(batch, seq_len, self.width, self.wire, direction, id_bytes)

    def check_tensors(self, U: Tensor | None, fixed_table: Tensor | None = None, need_table: bool = True) -> None:
        """ConfigError unless U (and T_fixed) are given exactly when compressing, with this format's shapes."""
        if self.rank is None:
            return
        if U is None or tuple(U.shape) != (self.d_model, self.rank):
            raise ConfigError(f"subspace boundary needs U of shape {(self.d_model, self.rank)}")
        if need_table and (fixed_table is None or tuple(fixed_table.shape) != (self.vocab_size, self.d_model)):
            raise ConfigError(f"subspace boundary needs T_fixed of shape {(self.vocab_size, self.d_model)}")


def _codes(fmt: BoundaryFormat, direction: str) -> tuple[bytes, int, int, int, int, int]:
    """Header fields before the dims: (magic, version, kind, compression, wire dtype, id dtype)."""
    ids = id_code(fmt.vocab_size) if direction == FORWARD else 0
    return MAGIC, VERSION, _KIND[direction], int(fmt.rank is not None), WIRE_DTYPES[fmt.wire][0], ids


def _header(fmt: BoundaryFormat, direction: str, batch: int, seq_len: int) -> bytes:
    return HEADER.pack(*_codes(fmt, direction), batch, seq_len, fmt.width)


def _values_bytes(values: Tensor, wire: str) -> bytes:
    _, dtype, bits = WIRE_DTYPES[wire]
    cast = values.detach().to("cpu", torch.float32).to(dtype).contiguous()
    if not torch.isfinite(cast).all():
        raise PayloadError(f"boundary values hold NaN or Inf (in {wire})")
    return cast.view(torch.int16 if dtype.itemsize == 2 else torch.int32).numpy().astype(bits).tobytes()


def _check_shape(t: Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {shape}")


def encode_activations(
    fmt: BoundaryFormat,
    x: Tensor,
    tokens: Tensor,
    targets: Tensor,
    U: Tensor | None = None,
    fixed_table: Tensor | None = None,
) -> bytes:
    """The forward message for hidden states x (b, L, d) of `tokens` (b, L) with `targets` = tokens shifted by one.

    PayloadError if a value is not finite in the wire dtype (e.g. fp16 overflow); ValueError on caller bugs.
    """
    fmt.check_tensors(U, fixed_table)
    if x.dim() != 3:
        raise ValueError(f"hidden states must be (batch, seq_len, d_model), got shape {tuple(x.shape)}")
    b, length, _ = x.shape
    _check_shape(x, (b, length, fmt.d_model), "hidden states")
    _check_shape(tokens, (b, length), "tokens")
    _check_shape(targets, (b, length), "targets")
    if not (b >= 1 and 1 <= length <= fmt.max_seq_len):
        raise ValueError(f"batch {b} × seq_len {length} is empty or longer than max_seq_len {fmt.max_seq_len}")
    if not torch.equal(targets[:, :-1], tokens[:, 1:]):
        raise ValueError("targets must be the tokens shifted by one (the message ships one window of ids)")
    window = torch.cat((tokens, targets[:, -1:]), dim=1).to("cpu", torch.int64)
    if window.min() < 0 or window.max() >= fmt.vocab_size:
        raise ValueError(f"token ids outside [0, {fmt.vocab_size})")
    values = x if U is None else (x.float() - fixed_table[tokens].float()) @ U.to(x.device, torch.float32)
    ids = window.numpy().astype(_ID_DTYPES[id_code(fmt.vocab_size)]).tobytes()
    return _header(fmt, FORWARD, b, length) + _values_bytes(values, fmt.wire) + ids


def _read(payload: object, fmt: BoundaryFormat, direction: str) -> tuple[bytes, int, int]:
    """(bytes, b, L) of a message whose header and length fit `fmt`; PayloadError otherwise."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"boundary message must be bytes, got {type(payload).__name__}")
    data = bytes(payload)
    if len(data) < HEADER.size:
        raise PayloadError(f"boundary message of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
    *codes, b, length, width = HEADER.unpack_from(data)
    if (*codes, width) != (*_codes(fmt, direction), fmt.width):
        raise PayloadError(f"boundary header {(*codes, width)} does not match this run's {direction} format {fmt}")
    if not (b >= 1 and 1 <= length <= fmt.max_seq_len):
        raise PayloadError(f"boundary message of batch {b} × seq_len {length} (max_seq_len {fmt.max_seq_len})")
    size = fmt.message_bytes(direction, b, length)
    if len(data) != size:
        raise PayloadError(f"boundary message has {len(data)} bytes, its header implies {size}")
    return data, b, length


def _read_values(data: bytes, fmt: BoundaryFormat, b: int, length: int) -> Tensor:
    _, dtype, bits = WIRE_DTYPES[fmt.wire]
    n = b * length * fmt.width
    raw = np.frombuffer(data, dtype=bits, count=n, offset=HEADER.size).astype(np.dtype(bits).newbyteorder("="))
    values = torch.from_numpy(raw).view(dtype).float()
    if not torch.isfinite(values).all():
        raise PayloadError("boundary message holds NaN or Inf")
    return values.view(b, length, fmt.width)


def parse_activations(fmt: BoundaryFormat, payload: bytes) -> tuple[Tensor, Tensor, Tensor]:
    """(values (b, L, w) float32 on the CPU, tokens (b, L), targets (b, L) int64): every check `decode_activations`
    makes, without U or T_fixed, so a receiver can refuse a bad message before it is its turn to expand it."""
    data, b, length = _read(payload, fmt, FORWARD)
    values = _read_values(data, fmt, b, length)
    id_dtype = _ID_DTYPES[id_code(fmt.vocab_size)]
    offset = HEADER.size + values.numel() * WIRE_DTYPES[fmt.wire][1].itemsize
    window = np.frombuffer(data, dtype=id_dtype, count=b * (length + 1), offset=offset).astype(np.int64)
    if window.min() < 0 or window.max() >= fmt.vocab_size:
        raise PayloadError(f"boundary message holds token ids outside [0, {fmt.vocab_size})")
    window = torch.from_numpy(window).view(b, length + 1)
    return values, window[:, :-1].contiguous(), window[:, 1:].contiguous()


def expand_activations(
    values: Tensor, tokens: Tensor, U: Tensor | None = None, fixed_table: Tensor | None = None
) -> Tensor:
    """Hidden states x = U c + T_fixed[tok] (or the dense values) on U's device, from `parse_activations`."""
    if U is None:
        return values
    u = U.to(torch.float32)
    return values.to(u.device) @ u.T + fixed_table[tokens.to(fixed_table.device)].to(u.device, torch.float32)


def decode_activations(
    fmt: BoundaryFormat, payload: bytes, U: Tensor | None = None, fixed_table: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(x (b, L, d) float32, tokens (b, L) int64, targets (b, L) int64) from a forward message.

    On the device of U (of the CPU when dense). PayloadError, and no other exception, on any malformed message.
    """
    fmt.check_tensors(U, fixed_table)
    values, tokens, targets = parse_activations(fmt, payload)
    device = values.device if U is None else U.device
    return expand_activations(values, tokens, U, fixed_table), tokens.to(device), targets.to(device)


def encode_gradients(fmt: BoundaryFormat, g: Tensor, U: Tensor | None = None) -> bytes:
    """The backward message for the gradient g (b, L, d) of the loss at the received hidden states: Uᵀ g (or g)."""
    fmt.check_tensors(U, need_table=False)
    if g.dim() != 3:
        raise ValueError(f"gradient must be (batch, seq_len, d_model), got shape {tuple(g.shape)}")
    b, length, _ = g.shape
    _check_shape(g, (b, length, fmt.d_model), "gradient")
    values = g if U is None else g.float() @ U.to(g.device, torch.float32)
    return _header(fmt, BACKWARD, b, length) + _values_bytes(values, fmt.wire)


def parse_gradients(fmt: BoundaryFormat, payload: bytes, batch: int, seq_len: int) -> Tensor:
    """The values (b, L, w) float32 of a backward message answering a (batch, seq_len) microbatch; every check
    `decode_gradients` makes, without U."""
    data, b, length = _read(payload, fmt, BACKWARD)
    if (b, length) != (batch, seq_len):
        raise PayloadError(f"gradient message for batch {b} × seq_len {length}, expected {batch} × {seq_len}")
    return _read_values(data, fmt, b, length)


def expand_gradients(values: Tensor, U: Tensor | None = None) -> Tensor:
    """The gradient U g_c (or g) on U's device, from `parse_gradients`."""
    if U is None:
        return values
    u = U.to(torch.float32)
    return values.to(u.device) @ u.T


def decode_gradients(fmt: BoundaryFormat, payload: bytes, batch: int, seq_len: int, U: Tensor | None = None) -> Tensor:
    """The gradient (b, L, d) float32 for the hidden states this stage sent: U g_c (or g), on U's device.

    The sender knows which microbatch it answers, so the shape must be exactly (batch, seq_len); PayloadError,
    and no other exception, on any malformed message.
    """
    fmt.check_tensors(U, need_table=False)
    return expand_gradients(parse_gradients(fmt, payload, batch, seq_len), U)
