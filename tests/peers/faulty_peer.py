"""A peer that trains honestly but serves a corrupted SparseLoCo payload (fault injection for the tests).

Usage: python tests/peers/faulty_peer.py {garbage|nan|truncated|bad-relay} <hetero-node args...>
It patches the encoder the node uses (bad-relay: what it re-serves of others' messages as a relay), then runs the
real CLI, so everything else is the product code path.
"""

from __future__ import annotations

import struct
import sys

from hetero_node.client.cli import app
from hetero_node.client.swarm.runtime import PeerRuntime
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


def corrupted_relay(self: PeerRuntime, kind: str, shard: int, round_: int, data: object) -> None:
    if kind.startswith("msg:") and isinstance(data, bytes):  # a message it verified and now re-serves
        data = bytes(b ^ 0x5A for b in data)
    honest_publish(self, kind, shard, round_, data)


if MODE == "bad-relay":
    honest_publish = PeerRuntime.publish
    PeerRuntime.publish = corrupted_relay  # type: ignore[method-assign]
else:
    sparse_codec.encode = corrupted_encode  # what the node encodes its messages with; decode stays honest
app.main()
