"""Pipeline messages between the stages of a virtual replica, over hivemind P2P streams.

A message is a boundary-codec byte string (`protocol/boundary_codec.py`) plus a header (`StagePiece` in
`protocol/wire.proto`): kind, virtual replica, receiving stage, round, inner step, microbatch. The sender streams
it in pieces below libp2p's message cap and waits for the receiver's `StageAck`. The receiver checks everything
before accepting: the sender is the neighbour the plan gives it, the header names this stage, its current round
and an inner step and microbatch that exist and have not arrived yet (a forward says how many microbatches its
step has: whole batches, at most `MAX_ACCUMULATION` of them), and the payload parses (sizes, dtype, shape, finite
values, token range). A message that fails any check is answered with an error, which the sender's call raises,
and never reaches the stage's state; accepted ones queue until the stage's worker takes them, decoded against the
fixed table of the moment it takes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.swarm.runtime import BLOB_PIECE_BYTES, PeerRuntime
from hetero_node.protocol import boundary_codec as codec
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.keys import stage_handler_name
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.round_stretch import MAX_ACCUMULATION

logger = logging.getLogger(__name__)
wire = load_proto_module("wire")

FORWARD, BACKWARD, EVAL, END = 0, 1, 2, 3
"""Message kinds; END closes a round's training: `count` inner steps were trained (0: the VR sits the round out)."""
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", EVAL: "eval", END: "end"}
MAX_EVAL_BATCHES = 64
MAX_QUEUED = 256
"""Accepted messages waiting for the worker; a sender that floods a stage is refused beyond this."""
SEND_ATTEMPTS = 3
SETTLE_S = 5.0
"""A message for our current or next round from a not-yet-known neighbour, or any message before the worker planned
its first round (a restarted stage catching up), waits this long for the worker to catch up (it reads the records a
moment after the sender did) before it is refused."""


@dataclass(frozen=True)
class Header:
    kind: int
    vr: int
    stage: int
    round: int
    step: int
    microbatch: int
    count: int = 0


@dataclass
class StageMessage:
    """An accepted message, parsed but not yet expanded (T_fixed may change before the worker takes it)."""

    header: Header
    values: Tensor | None
    tokens: Tensor | None
    targets: Tensor | None
    wire_bytes: int


@dataclass
class Expectation:
    """What the receiving stage accepts right now; set by its worker."""

    vr: int = -1
    stage: int = -1
    round: int = -1
    previous: str | None = None
    next: str | None = None


def _slot(h: Header) -> tuple[int, int, int]:
    """What makes a message unique within a round (the eval count is not: a batch is a batch)."""
    return h.kind, h.step, h.microbatch


class StageInbox:
    """The receiving side: the handler validates and queues, the worker takes (see the module docstring)."""

    def __init__(
        self, fmt: codec.BoundaryFormat, max_steps: int, microbatch_sizes: list[int], seq_len: int, batch_size: int
    ) -> None:
        self.fmt, self.max_steps, self.sizes, self.seq_len = fmt, max_steps, microbatch_sizes, seq_len
        self.batch_size = batch_size  # eval batches travel whole
        self.expect = Expectation()
        self._queue: list[StageMessage] = []
        self._seen: set[tuple[int, int, int]] = set()  # (kind, step, microbatch) accepted in the expected round
        self._cond = threading.Condition()
        self.rejected = 0

    def expect_round(self, expectation: Expectation) -> None:
        """Accept messages for this (vr, stage, round) from these neighbours only; drop what is queued for others."""
        with self._cond:
            if (expectation.vr, expectation.stage, expectation.round) != (
                self.expect.vr, self.expect.stage, self.expect.round,
            ):  # fmt: skip
                self._seen = set()
            self.expect = expectation
            self._queue = [m for m in self._queue if self._matches_expectation(m.header)]

    def _matches_expectation(self, h: Header) -> bool:
        return (h.vr, h.stage, h.round) == (self.expect.vr, self.expect.stage, self.expect.round)

    def _from_neighbour(self, h: Header, sender: str) -> bool:
        return sender == (self.expect.next if h.kind == BACKWARD else self.expect.previous)

    async def handle(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """P2P handler: receive one streamed message; raise (the sender gets the error) unless it is acceptable."""
        sender = str(context.remote_id)
        try:
            header, payload, wire_bytes = await self._receive(requests, sender)
            deadline = time.monotonic() + SETTLE_S
            while self._may_settle(header) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            message = self._accept(header, payload, sender, wire_bytes)
        except PayloadError as e:
            self.rejected += 1
            logger.warning("rejected a stage message from %s: %s", sender, e)
            raise
        with self._cond:
            if not self._matches_expectation(header) or _slot(header) in self._seen:  # moved on, or a race
                self.rejected += 1
                raise PayloadError(f"stage moved on from round {header.round}, or a duplicate")
            self._seen.add(_slot(header))
            self._queue.append(message)
            self._cond.notify_all()
        return wire.StageAck()

    def _may_settle(self, h: Header) -> bool:
        """The worker has not yet caught up with this message's round, or not yet learnt who sends it, or has not
        planned any round yet (a restarted stage still catching up with the swarm)."""
        expect = self.expect
        if (expect.vr, expect.stage) == (-1, -1):
            return True
        neighbour = expect.next if h.kind == BACKWARD else expect.previous
        return (expect.vr, expect.stage) == (h.vr, h.stage) and (
            h.round == expect.round + 1 or (h.round == expect.round and neighbour is None)
        )

    def _stranger(self, h: Header, sender: str) -> bool:
        """A message for our current slot from someone other than the neighbour we expect it from."""
        expect = self.expect
        neighbour = expect.next if h.kind == BACKWARD else expect.previous
        return (expect.vr, expect.stage) == (h.vr, h.stage) and neighbour is not None and sender != neighbour

    async def _receive(self, requests: AsyncIterator[Any], sender: str) -> tuple[Header, bytes, int]:
        """(header, payload, bytes on the stream) of one streamed message, refusing oversized or torn ones, and
        one a stranger sends as soon as its header shows it (before reading the rest)."""
        first, header, pieces, received, wire_bytes = None, None, [], 0, 0
        async for piece in requests:
            wire_bytes += piece.ByteSize()
            if first is None:
                first = p = piece
                header = Header(p.kind, p.vr, p.stage, p.round, p.step, p.microbatch, p.count)
                if piece.total_size > self._max_bytes():
                    raise PayloadError(f"stage message of {piece.total_size} bytes exceeds {self._max_bytes()}")
                if self._stranger(header, sender):
                    raise PayloadError(f"{sender} is not the neighbour this stage expects the message from")
            received += len(piece.data)
            if received > first.total_size:
                raise PayloadError("stage message longer than its announced size")
            pieces.append(piece.data)
        if first is None or header is None or received != first.total_size:
            raise PayloadError("truncated stage message")
        return header, b"".join(pieces), wire_bytes

    @property
    def max_microbatches(self) -> int:
        """Microbatches of one inner step at most: `MAX_ACCUMULATION` batches of M."""
        return len(self.sizes) * MAX_ACCUMULATION

    def size(self, microbatch: int) -> int:
        """Sequences in microbatch `microbatch` of a step (each of its batches is cut into the same M)."""
        return self.sizes[microbatch % len(self.sizes)]

    def _max_bytes(self) -> int:
        return self.fmt.message_bytes(codec.FORWARD, self.batch_size, self.seq_len)

    def _accept(self, h: Header, payload: bytes, sender: str, wire_bytes: int) -> StageMessage:
        expect = self.expect
        if h.kind not in KIND_NAMES:
            raise PayloadError(f"unknown message kind {h.kind}")
        if not self._from_neighbour(h, sender):
            raise PayloadError(f"{sender} is not this stage's {'next' if h.kind == BACKWARD else 'previous'} stage")
        if not self._matches_expectation(h):
            raise PayloadError(
                f"message for vr {h.vr} stage {h.stage} round {h.round}; this is vr {expect.vr} stage "
                f"{expect.stage} in round {expect.round}"
            )
        if h.kind == EVAL:
            if not (h.step == 0 and 0 <= h.count <= MAX_EVAL_BATCHES and h.microbatch < max(h.count, 1)):
                raise PayloadError(f"eval batch {h.microbatch} of {h.count} at step {h.step}")
        elif h.kind == END:
            if not (h.step == 0 and h.microbatch == 0 and h.count <= self.max_steps and not payload):
                raise PayloadError(f"end of round after {h.count} steps (step {h.step}, {len(payload)} bytes)")
        elif h.kind == BACKWARD and h.count != 0:
            raise PayloadError(f"a backward message carries no count, got {h.count}")
        elif h.kind == FORWARD and not (0 < h.count <= self.max_microbatches and h.count % len(self.sizes) == 0):
            raise PayloadError(f"a step of {h.count} microbatches (whole batches of {len(self.sizes)}, at most "
                               f"{self.max_microbatches})")  # fmt: skip
        elif not (h.step < self.max_steps and h.microbatch < (h.count or self.max_microbatches)):
            limits = f"{self.max_steps} × {h.count or self.max_microbatches}"
            raise PayloadError(f"step {h.step} / microbatch {h.microbatch} outside {limits}")
        with self._cond:
            if _slot(h) in self._seen:
                raise PayloadError("duplicate message")
            if len(self._queue) >= MAX_QUEUED:
                raise PayloadError("too many messages waiting")
        if h.kind == END:
            return StageMessage(h, None, None, None, wire_bytes)
        if h.kind == EVAL and h.count == 0:
            if payload:
                raise PayloadError("an empty eval pass carries no payload")
            return StageMessage(h, None, None, None, wire_bytes)
        if h.kind == BACKWARD:
            values = codec.parse_gradients(self.fmt, payload, self.size(h.microbatch), self.seq_len)
            return StageMessage(h, values, None, None, wire_bytes)
        values, tokens, targets = codec.parse_activations(self.fmt, payload)
        batch = self.size(h.microbatch) if h.kind == FORWARD else tokens.shape[0]
        if tuple(tokens.shape) != (batch, self.seq_len) or batch > self.batch_size:
            raise PayloadError(f"{KIND_NAMES[h.kind]} batch of shape {tuple(tokens.shape)}")
        return StageMessage(h, values, tokens, targets, wire_bytes)

    def take(self, match: Callable[[Header], bool], timeout: float, keep: bool = False) -> StageMessage | None:
        """The oldest queued message whose header matches (left queued with `keep`), waiting up to `timeout`;
        None if none came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, message in enumerate(self._queue):
                    if match(message.header):
                        return message if keep else self._queue.pop(i)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)


class StageSender:
    """The sending side: stream a message to a neighbour in the background, counting the bytes sent."""

    def __init__(self, runtime: PeerRuntime, run_id: str) -> None:
        self.runtime, self.handler = runtime, stage_handler_name(run_id)

    def send(self, peer: str, header: Header, payload: bytes) -> tuple[concurrent.futures.Future, int]:
        """Start sending; (a future that raises if the receiver rejected the message or could not be reached,
        the bytes the pieces take on the stream)."""
        from hivemind.p2p import PeerID

        chunks = [payload[i : i + BLOB_PIECE_BYTES] for i in range(0, len(payload), BLOB_PIECE_BYTES)] or [b""]
        pieces = [wire.StagePiece(data=chunks[0], total_size=len(payload), **header.__dict__)]
        pieces += [wire.StagePiece(data=chunk) for chunk in chunks[1:]]

        async def stream() -> AsyncIterator[Any]:
            for piece in pieces:
                yield piece

        async def deliver() -> Any:
            """A refusal (P2PHandlerError) is final; a torn stream is retried, and a retry refused as a duplicate
            means the torn attempt did arrive."""
            from hivemind.p2p import P2PHandlerError

            for attempt in range(SEND_ATTEMPTS):
                try:
                    await self.runtime.dialer.dial(peer)
                    return await self.runtime.p2p.call_protobuf_handler(
                        PeerID.from_base58(peer), self.handler, stream(), wire.StageAck
                    )
                except P2PHandlerError as e:
                    if attempt > 0 and "duplicate" in str(e):
                        return wire.StageAck()
                    raise
                except Exception as e:  # transport errors come in many types
                    if attempt == SEND_ATTEMPTS - 1:
                        raise
                    logger.info("sending to %s failed (%r); retrying", peer, e)
                    await asyncio.sleep(0.2 * (attempt + 1))
            raise AssertionError("unreachable")

        future = asyncio.run_coroutine_threadsafe(deliver(), self.runtime.loop)
        return future, sum(piece.ByteSize() for piece in pieces)


def microbatch_sizes(batch_size: int, microbatches: int) -> list[int]:
    """Sizes of `torch.tensor_split(batch, microbatches)`: what every stage expects per microbatch."""
    return [len(part) for part in torch.tensor_split(torch.arange(batch_size), microbatches)]
