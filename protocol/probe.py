"""Bandwidth and round-trip probe handlers every hetero-node peer serves (bootstrap included).

A node measures its link by timing real transfers over hivemind P2P to a peer that serves these handlers:
download = the peer streams `size` bytes to us; upload = we stream bytes, the peer times their arrival. Both
sides time from the first piece to the last, so connection set-up and the link's initial burst are excluded.
Sizes are capped, each peer has a byte budget and only a few probes run at once (the others wait), so probes
cannot be turned into a flood.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.keys import KEY_PREFIX
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.rate_limit import PeerBudget

wire = load_proto_module("wire")

PROBE_DOWNLOAD = f"{KEY_PREFIX}.probe.download"
PROBE_UPLOAD = f"{KEY_PREFIX}.probe.upload"
PROBE_PING = f"{KEY_PREFIX}.probe.ping"
"""An empty request answered at once: a node times it to learn its round trip (`client/node/round_trip.py`)."""
PROBE_PIECE_BYTES = 256 * 1024
MAX_PROBE_BYTES = 32 * 1024 * 1024
"""The largest transfer one probe may ask for (or send) in either direction."""


PROBE_BUDGET_BYTES = 128 * 1024 * 1024
"""What one peer may draw from us per `PROBE_WINDOW_S` in each direction: two whole measurements (52 MB each)."""
PROBE_WINDOW_S = 600.0
MAX_CONCURRENT_PROBES = 2
"""Probes served at once, whoever asks (more would only measure each other); the rest wait their turn."""
MAX_WAITING_PROBES = 16
"""Probes waiting for a turn; beyond this a probe is refused."""


class ProbeServer:
    """Both probe directions, with per-peer byte budgets and a bounded number of probes at once (`rate_limit.py`)."""

    def __init__(self) -> None:
        self.download_budget = PeerBudget(PROBE_BUDGET_BYTES, PROBE_WINDOW_S)
        self.upload_budget = PeerBudget(PROBE_BUDGET_BYTES, PROBE_WINDOW_S)
        self.turns = asyncio.Semaphore(MAX_CONCURRENT_PROBES)
        self.waiting = 0  # lives on the event loop: no lock

    @contextlib.asynccontextmanager
    async def _turn(self, budget: PeerBudget, peer: str, size: int) -> AsyncIterator[None]:
        """Charge `peer`'s budget, then wait for one of the probe turns."""
        if self.waiting >= MAX_WAITING_PROBES:
            raise PayloadError(f"{MAX_WAITING_PROBES} bandwidth probes are waiting already; try again later")
        if not budget.take(peer, size):
            raise PayloadError(f"{peer} has used its {PROBE_BUDGET_BYTES >> 20} MB of probes for now")
        self.waiting += 1
        try:
            await self.turns.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.turns.release()

    async def serve_download(self, request: Any, context: Any) -> AsyncIterator[Any]:
        remaining = min(request.size, MAX_PROBE_BYTES)
        async with self._turn(self.download_budget, str(context.remote_id), remaining):
            piece = os.urandom(PROBE_PIECE_BYTES)  # incompressible, in case a transport ever compresses
            while remaining > 0:
                yield wire.ProbePiece(data=piece[:remaining])
                remaining -= PROBE_PIECE_BYTES

    async def absorb_upload(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """Charges the whole cap up front: the sender's size is known only at the end."""
        first_at, last_at, received, total = None, None, 0, 0
        async with self._turn(self.upload_budget, str(context.remote_id), MAX_PROBE_BYTES):
            async for request in requests:
                now = time.perf_counter()
                total += len(request.data)
                if total > MAX_PROBE_BYTES:
                    raise PayloadError(f"bandwidth probe larger than {MAX_PROBE_BYTES} bytes")
                if first_at is None:
                    first_at = now
                else:
                    received += len(request.data)
                last_at = now
        elapsed = (last_at - first_at) if first_at is not None and last_at is not None else 0.0
        return wire.ProbeReply(received=received, elapsed_s=elapsed)


async def register_probe_handlers(p2p: Any) -> None:
    """Serve both probe directions on `p2p` (a hivemind P2P, usually the DHT's own)."""
    server = ProbeServer()
    await p2p.add_protobuf_handler(PROBE_DOWNLOAD, server.serve_download, wire.ProbeRequest, stream_output=True)
    await p2p.add_protobuf_handler(PROBE_UPLOAD, server.absorb_upload, wire.ProbeRequest, stream_input=True)
    await p2p.add_protobuf_handler(PROBE_PING, _pong, wire.ProbeRequest)


async def _pong(_request: Any, _context: Any) -> Any:
    """No budget: the reply is empty, and any peer can already cost us more by opening a stream."""
    return wire.ProbeReply()
