"""Wire codec of a `SparseMessage`: the bytes one replica sends for one parameter shard.

All integers and floats are little-endian. Everything whose size depends on data (how many entries a tensor
sends) follows from the tensor's shape and the chunk settings, so a message's length is known before it
arrives (`message_size_bytes`) and a decoder checks it exactly.

Header (12 bytes):

| offset | size | field                                          |
|--------|------|------------------------------------------------|
| 0      | 4    | magic `b"HNSL"`                                |
| 4      | 1    | format version, u8 (= 1)                       |
| 5      | 1    | chunk side, u8                                 |
| 6      | 2    | topk per full chunk, u16                       |
| 8      | 4    | number of tensors T, u32                       |

Then T tensor sections, in shard order; for a tensor of `ndim` dims sending n entries (n from its chunk
plan, see `sparseloco.ChunkPlan`):

| size        | field                                                                              |
|-------------|------------------------------------------------------------------------------------|
| 1           | ndim, u8                                                                           |
| 4·ndim      | dims, u32 each                                                                     |
| 4           | mean μ, f32                                                                        |
| 16          | lookup table, 4 × f32 (code b decodes to f32(lookup[b]) + f32(μ))                  |
| 3·⌈n/2⌉     | in-chunk indices, 12 bits each, two per 3 bytes: b0 = i1 & 0xFF,                   |
|             | b1 = (i1 >> 8) | (i2 & 0xF) << 4, b2 = i2 >> 4; an odd count is padded with index 0 |
| ⌈n/4⌉       | 2-bit codes, four per byte, entry j at bits 2·(j mod 4); padding bits 0            |

Indices are in transmission order: chunk by chunk, strictly ascending inside a chunk, so every message has
one encoding. At the defaults (64 of 4096 kept, 12 + 2 bits each) a message costs 0.21875 bits per
parameter, plus 12 bytes per message and 21 + 4·ndim bytes per tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.sparseloco import (
    CompressedTensor,
    SparseLoCoConfig,
    SparseMessage,
    chunk_plan,
    validate_message,
)

MAGIC = b"HNSL"
VERSION = 1
_HEADER = struct.Struct("<4sBBHI")
_NDIM = struct.Struct("<B")
_FLOATS = struct.Struct("<5f")
_TENSOR_FIXED = _NDIM.size + _FLOATS.size


def _index_bytes(n: int) -> int:
    return 3 * ((n + 1) // 2)


def _code_bytes(n: int) -> int:
    return (n + 3) // 4


def message_size_bytes(shapes: Sequence[Sequence[int]], config: SparseLoCoConfig) -> int:
    """Exact length of the encoding of a message for `shapes`, from the shapes alone.

    At the defaults that is 0.21875 bits per parameter (64 of 4096 entries, 12 + 2 bits each) plus the
    constants: 12 bytes per message, 21 + 4·ndim bytes per tensor.
    """
    total = _HEADER.size
    for shape in shapes:
        n = chunk_plan(tuple(int(d) for d in shape), config.chunk, config.topk).num_selected
        total += _TENSOR_FIXED + 4 * len(shape) + _index_bytes(n) + _code_bytes(n)
    return total


def pack_indices(indices: np.ndarray) -> bytes:
    """12-bit indices, two per 3 bytes (an odd count padded with a 0 index)."""
    idx = indices.astype(np.uint16)
    if idx.size % 2:
        idx = np.append(idx, np.uint16(0))
    first, second = idx[0::2], idx[1::2]
    packed = np.empty((first.size, 3), dtype=np.uint8)
    packed[:, 0] = first & 0xFF
    packed[:, 1] = (first >> 8) | ((second & 0xF) << 4)
    packed[:, 2] = second >> 4
    return packed.tobytes()


def unpack_indices(data: bytes | memoryview, n: int) -> np.ndarray:
    """Inverse of `pack_indices` for n indices (int16); raises `PayloadError` on a non-zero pad index."""
    packed = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.uint16)
    idx = np.empty(2 * packed.shape[0], dtype=np.uint16)
    idx[0::2] = packed[:, 0] | ((packed[:, 1] & 0xF) << 8)
    idx[1::2] = (packed[:, 1] >> 4) | (packed[:, 2] << 4)
    if idx.size > n and idx[n] != 0:
        raise PayloadError("index padding is not zero")
    return idx[:n].astype(np.int16)


def pack_codes(codes: np.ndarray) -> bytes:
    """2-bit codes, four per byte, lowest bits first (padding codes are 0)."""
    padded = np.zeros(_code_bytes(codes.size) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).tobytes()


def unpack_codes(data: bytes | memoryview, n: int) -> np.ndarray:
    """Inverse of `pack_codes` for n codes; raises `PayloadError` on non-zero padding bits."""
    packed = np.frombuffer(data, dtype=np.uint8)
    codes = ((packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(-1)
    if codes[n:].any():
        raise PayloadError("code padding bits are not zero")
    return codes[:n]


def encode(msg: SparseMessage) -> bytes:
    """The bytes of `msg` (layout in the module docstring)."""
    out = [_HEADER.pack(MAGIC, VERSION, msg.chunk, msg.topk, len(msg.tensors))]
    for part in msg.tensors:
        out.append(_NDIM.pack(len(part.shape)) + struct.pack(f"<{len(part.shape)}I", *part.shape))
        out.append(_FLOATS.pack(part.mean, *part.lookup))
        out.append(pack_indices(part.indices.numpy()))
        out.append(pack_codes(part.codes.numpy()))
    return b"".join(out)


class _Reader:
    """Reads consecutive fields, turning any shortfall into a `PayloadError` that says what was cut."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def take(self, size: int, what: str) -> memoryview:
        if self._pos + size > len(self._data):
            raise PayloadError(f"truncated message: {what} needs {size} bytes at offset {self._pos}, {self.left} left")
        chunk = self._data[self._pos : self._pos + size]
        self._pos += size
        return chunk

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        return layout.unpack(self.take(layout.size, what))

    @property
    def left(self) -> int:
        return len(self._data) - self._pos


def decode(data: bytes, expected_shapes: Sequence[Sequence[int]], config: SparseLoCoConfig) -> SparseMessage:
    """Parse and fully validate a message from a peer; any malformation raises `PayloadError`.

    The receiver states what it expects (its shard's shapes and the swarm's chunk settings): a message
    for anything else is rejected, as is one with a wrong length, bad padding, out-of-range or unordered
    indices, or non-finite floats.
    """
    shapes = [tuple(int(d) for d in s) for s in expected_shapes]
    reader = _Reader(data)
    magic, version, chunk, topk, count = reader.unpack(_HEADER, "header")
    if magic != MAGIC:
        raise PayloadError(f"not a SparseLoCo message (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PayloadError(f"unsupported SparseLoCo message version {version} (this peer reads {VERSION})")
    if (chunk, topk) != (config.chunk, config.topk):
        raise PayloadError(f"message uses chunk={chunk} topk={topk}, the swarm uses {config.chunk}/{config.topk}")
    if count != len(shapes):
        raise PayloadError(f"message holds {count} tensors, expected {len(shapes)}")
    parts = []
    for i, shape in enumerate(shapes):
        (ndim,) = reader.unpack(_NDIM, f"tensor {i} ndim")
        if ndim != len(shape):
            raise PayloadError(f"tensor {i}: {ndim} dims on the wire, expected shape {shape}")
        dims = struct.unpack(f"<{ndim}I", reader.take(4 * ndim, f"tensor {i} dims"))
        if dims != shape:
            raise PayloadError(f"tensor {i}: shape {dims} on the wire, expected {shape}")
        mean, *lookup = reader.unpack(_FLOATS, f"tensor {i} mean and lookup")
        n = chunk_plan(shape, chunk, topk).num_selected
        indices = unpack_indices(reader.take(_index_bytes(n), f"tensor {i} indices"), n)
        codes = unpack_codes(reader.take(_code_bytes(n), f"tensor {i} codes"), n)
        parts.append(
            CompressedTensor(
                shape=shape,
                indices=torch.from_numpy(indices),
                codes=torch.from_numpy(codes.copy()),
                mean=mean,
                lookup=(lookup[0], lookup[1], lookup[2], lookup[3]),
            )
        )
    if reader.left:
        raise PayloadError(f"{reader.left} unexpected bytes after the last tensor")
    msg = SparseMessage(chunk=chunk, topk=topk, tensors=tuple(parts))
    validate_message(msg, shapes)
    return msg
