"""A peer that trains honestly but serves a corrupted SparseLoCo payload (fault injection for the tests).

Usage: python tests/peers/faulty_peer.py {garbage|nan|truncated} <hetero-node args...>
It patches the encoder the node uses, then runs the real CLI, so everything else is the product code path.
"""

from __future__ import annotations

import struct
import sys

from hetero_node.client.cli import app
from hetero_node.protocol import sparse_codec

MODE = sys.argv.pop(1)
honest_encode = sparse_codec.encode


def corrupted_encode(msg: object) -> bytes:
    data = bytearray(honest_encode(msg))
    if MODE == "garbage":
        return bytes(b ^ 0x5A for b in data)
    if MODE == "truncated":
        return bytes(data[: len(data) // 2])
    if MODE == "nan":  # first tensor's μ: header (12 bytes) + ndim (1) + dims (4·ndim)
        offset = 12 + 1 + 4 * data[12]
        data[offset : offset + 4] = struct.pack("<f", float("nan"))
        return bytes(data)
    raise SystemExit(f"unknown fault {MODE}")


sparse_codec.encode = corrupted_encode  # what the node encodes its messages with; decode stays honest
app.main()
