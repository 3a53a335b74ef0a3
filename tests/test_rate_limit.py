"""Requests that cost the server far more than the asker are budgeted per peer (security review H5)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from hetero_node.client.swarm.runtime import COPIES_PER_MINUTE, STATE_REQUESTS_PER_MINUTE, PeerRuntime, wire
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.probe import MAX_CONCURRENT_PROBES, MAX_PROBE_BYTES, PROBE_BUDGET_BYTES, ProbeServer
from hetero_node.protocol.rate_limit import PeerBudget
from hetero_node.protocol.round_wire import PAYLOAD


def test_a_budget_refuses_past_its_limit_refills_after_its_window_and_forgets_old_peers() -> None:
    budget = PeerBudget(limit=10, window_s=60, max_peers=2)
    assert budget.take("a", 6, now=0) and budget.take("a", 4, now=1)
    assert not budget.take("a", 1, now=2)  # spent 10 of 10
    assert budget.take("b", 10, now=2)  # another peer has its own budget
    assert not budget.take("a", 5, now=59.5) and budget.take("a", 5, now=60.5)  # the first 6 left the window
    budget.take("c", 1, now=61)  # a third peer: the least recently seen ("b") is forgotten
    assert set(budget._spent) == {"a", "c"}


def context(peer: str) -> Any:
    return SimpleNamespace(remote_id=peer)


async def served(server: PeerRuntime, request: Any, peer: str) -> bytes:
    """What `server`'s blob handler streams to `peer` for `request`."""
    return b"".join([piece.data async for piece in server._serve_blob(request, context(peer))])


def test_one_peer_cannot_draw_more_probe_bytes_than_its_budget_and_others_still_get_theirs() -> None:
    server = ProbeServer()

    async def download(peer: str) -> int:
        stream = server.serve_download(wire.ProbeRequest(size=MAX_PROBE_BYTES), context(peer))
        return sum([len(piece.data) async for piece in stream])

    async def scenario() -> None:
        for _ in range(PROBE_BUDGET_BYTES // MAX_PROBE_BYTES):
            assert await download("greedy") == MAX_PROBE_BYTES
        with pytest.raises(PayloadError, match="used its"):
            await download("greedy")
        assert await download("honest") == MAX_PROBE_BYTES

    asyncio.run(scenario())


def test_probes_beyond_the_concurrent_bound_wait_for_a_turn() -> None:
    server = ProbeServer()

    async def scenario() -> None:
        streams = [server.serve_download(wire.ProbeRequest(size=1 << 20), context(f"p{i}")) for i in range(3)]
        started = [await stream.__anext__() for stream in streams[:MAX_CONCURRENT_PROBES]]  # both turns taken
        assert len(started) == MAX_CONCURRENT_PROBES and server.waiting == 0
        third = asyncio.ensure_future(streams[2].__anext__())
        await asyncio.sleep(0.05)
        assert not third.done() and server.waiting == 1  # waits, not refused
        await streams[0].aclose()  # a turn comes free
        assert len((await asyncio.wait_for(third, 5)).data) > 0
        for stream in streams[1:]:
            await stream.aclose()

    asyncio.run(scenario())


@pytest.mark.multipeer
def test_one_peer_cannot_make_a_node_serve_states_in_a_loop() -> None:
    server = PeerRuntime([])
    try:
        server.join_run("0123456789abcdef")
        server.publish("state", 0, 1, b"a state")

        async def fetch(peer: str) -> bytes:
            return await served(server, wire.BlobRequest(kind="state", shard=0, round=1), peer)

        async def scenario() -> None:
            for _ in range(STATE_REQUESTS_PER_MINUTE):
                assert await fetch("looping") == b"a state"
            with pytest.raises(PayloadError, match="states in the last minute"):
                await fetch("looping")
            assert await fetch("honest") == b"a state"

        server.run(scenario(), timeout=60)
    finally:
        server.shutdown()


@pytest.mark.multipeer
def test_one_peer_cannot_make_a_node_resend_a_rounds_message_in_a_loop() -> None:
    server = PeerRuntime([])
    try:
        server.join_run("0123456789abcdef")
        for round_ in (1, 2):
            server.publish(PAYLOAD, 0, round_, b"a round's message")

        async def fetch(peer: str, round_: int = 1) -> bytes:
            return await served(server, wire.BlobRequest(kind=PAYLOAD, shard=0, round=round_), peer)

        async def scenario() -> None:
            for _ in range(COPIES_PER_MINUTE):
                assert await fetch("looping") == b"a round's message"
            with pytest.raises(PayloadError, match="times in the last minute"):
                await fetch("looping")
            assert await fetch("looping", round_=2) == b"a round's message"  # another blob, its own budget
            assert await fetch("honest") == b"a round's message"

        server.run(scenario(), timeout=60)
    finally:
        server.shutdown()
