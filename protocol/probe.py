"""Bandwidth probe handlers every hetero-node peer serves (bootstrap included).

A node measures its link by timing real transfers over hivemind P2P to a peer that serves these handlers:
download = the peer streams `size` bytes to us; upload = we stream bytes, the peer times their arrival. Both
sides time from the first piece to the last, so connection set-up and the link's initial burst are excluded.
Sizes are capped so a probe cannot be turned into a flood.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from hetero_node.protocol.keys import KEY_PREFIX
from hetero_node.protocol.proto_build import load_proto_module

wire = load_proto_module("wire")

PROBE_DOWNLOAD = f"{KEY_PREFIX}.probe.download"
PROBE_UPLOAD = f"{KEY_PREFIX}.probe.upload"
PROBE_PIECE_BYTES = 256 * 1024
MAX_PROBE_BYTES = 32 * 1024 * 1024
"""The largest transfer one probe may ask for (or send) in either direction."""


async def _serve_download(request: Any, _context: Any) -> AsyncIterator[Any]:
    piece = os.urandom(PROBE_PIECE_BYTES)  # incompressible, in case a transport ever compresses
    remaining = min(request.size, MAX_PROBE_BYTES)
    while remaining > 0:
        yield wire.ProbePiece(data=piece[:remaining])
        remaining -= PROBE_PIECE_BYTES


async def _absorb_upload(requests: AsyncIterator[Any], _context: Any) -> Any:
    first_at, last_at, received, total = None, None, 0, 0
    async for request in requests:
        now = time.perf_counter()
        total += len(request.data)
        if total > MAX_PROBE_BYTES:
            raise ValueError(f"bandwidth probe larger than {MAX_PROBE_BYTES} bytes")
        if first_at is None:
            first_at = now
        else:
            received += len(request.data)
        last_at = now
    elapsed = (last_at - first_at) if first_at is not None else 0.0
    return wire.ProbeReply(received=received, elapsed_s=elapsed)


async def register_probe_handlers(p2p: Any) -> None:
    """Serve both probe directions on `p2p` (a hivemind P2P, usually the DHT's own)."""
    await p2p.add_protobuf_handler(PROBE_DOWNLOAD, _serve_download, wire.ProbeRequest, stream_output=True)
    await p2p.add_protobuf_handler(PROBE_UPLOAD, _absorb_upload, wire.ProbeRequest, stream_input=True)
