"""Wire codec of a dense pseudo-gradient (the DiLoCo baseline): every value, fp32 or fp16, nothing else.

Byte layout (little-endian):

| bytes    | field                                              |
|----------|----------------------------------------------------|
| 4        | magic `b"HNDL"`                                    |
| 1        | version (1)                                        |
| 1        | dtype code: 0 = fp32, 1 = fp16                     |
| 4        | tensor count (u32)                                 |
| per tensor | numel × dtype size: the values in row-major order |

Shapes are not sent: the receiver knows them from the run config and checks the length exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from math import prod

import numpy as np
import torch
from torch import Tensor

from hetero_node.protocol.errors import PayloadError

MAGIC = b"HNDL"
VERSION = 1
DTYPES = {"fp32": (0, np.dtype("<f4")), "fp16": (1, np.dtype("<f2"))}
HEADER = struct.Struct("<4sBBI")


def message_size_bytes(shapes: Sequence[Sequence[int]], wire: str) -> int:
    return HEADER.size + sum(prod(s) for s in shapes) * DTYPES[wire][1].itemsize


def encode(tensors: Sequence[Tensor], wire: str) -> bytes:
    """Raw values of `tensors` in the wire dtype; raises PayloadError on non-finite input (or fp16 overflow)."""
    code, dtype = DTYPES[wire]
    parts = [HEADER.pack(MAGIC, VERSION, code, len(tensors))]
    for i, t in enumerate(tensors):
        values = t.detach().to("cpu", torch.float32).contiguous().numpy().astype(dtype)
        if not np.isfinite(values).all():
            raise PayloadError(f"dense tensor {i} has NaN or Inf entries (in {wire})")
        parts.append(values.tobytes())
    return b"".join(parts)


def decode(data: bytes, expected_shapes: Sequence[Sequence[int]], wire: str) -> list[Tensor]:
    """fp32 tensors of `expected_shapes`; PayloadError on any mismatch or non-finite value."""
    code, dtype = DTYPES[wire]
    if len(data) != message_size_bytes(expected_shapes, wire):
        raise PayloadError(f"dense message has {len(data)} bytes, expected {message_size_bytes(expected_shapes, wire)}")
    magic, version, got_code, count = HEADER.unpack_from(data)
    if (magic, version, got_code, count) != (MAGIC, VERSION, code, len(expected_shapes)):
        raise PayloadError(f"dense message header {(magic, version, got_code, count)} does not match this run")
    tensors, offset = [], HEADER.size
    for shape in expected_shapes:
        n = prod(shape)
        values = np.frombuffer(data, dtype=dtype, count=n, offset=offset).astype(np.float32)
        if not np.isfinite(values).all():
            raise PayloadError("dense message holds NaN or Inf")
        tensors.append(torch.from_numpy(values.reshape(tuple(shape))))
        offset += n * dtype.itemsize
    return tensors
