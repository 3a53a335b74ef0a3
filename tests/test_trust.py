"""What one lying peer, or a broken part of a node, cannot do: real DHT peers and libp2p streams in this process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from factories import record_fields
from hivemind.p2p import P2P

from hetero_node.bench.poison import RUN_ID, SHAPES, serve, swarm, wait_for_records
from hetero_node.client.outer.shard_state import ShardStates
from hetero_node.client.swarm.runtime import BLOB_PIECE_BYTES, MAX_STREAMS_PER_PEER, PeerRuntime, quiet_not_served, wire
from hetero_node.protocol import socket_dir
from hetero_node.protocol.errors import DaemonError, PayloadError
from hetero_node.protocol.frames import MAX_FRAME_BYTES
from hetero_node.protocol.keys import blob_handler_name, peers_key
from hetero_node.protocol.records import (
    PeerRecord,
    RunAnnouncement,
    is_sealed_announcement,
    parse_peer_record,
    parse_run_announcement,
    sealed_announcement,
    sealed_record,
)
from hetero_node.protocol.swarm_key import is_member, member_proof, open_value, seal_value

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(180)]


@pytest.mark.parametrize("liar_round", [6, 10**6, 5], ids=["one-ahead", "far-ahead", "same-round"])
def test_a_joiner_loads_the_state_most_peers_hold_not_one_donors(liar_round: int) -> None:
    """Two honest replicas hold round 5; a third serves other weights, advertised with their own (matching)
    fingerprint, at a later round or the same one. A joiner loads the honest state; before the quorum rule it
    took the newest round any donor claimed."""
    with swarm(4) as (honest1, honest2, liar, joiner):
        honest = serve(honest1, 5, 1.0)
        assert serve(honest2, 5, 1.0) == honest
        assert serve(liar, liar_round, 100.0) != honest
        wait_for_records(joiner, 3)
        states = ShardStates(joiner, SHAPES, None, fetch_timeout_s=10)
        loaded = states.load(lambda: joiner.read_records() or {}, 0, 10.0, threading.Event())
        assert loaded is not None
        round_, shards, size = loaded
        assert round_ == 5 and size > 0
        for shard, state in shards.items():
            assert all(torch.equal(t, torch.ones_like(t)) for t in state["tensors"]), shard


def test_a_frame_declared_larger_than_the_cap_is_refused_at_its_header() -> None:
    """hivemind would buffer a declared 1 GiB frame in full before our handler runs; the cap closes the stream at the
    header, and the peer goes on serving."""
    with swarm(2) as (server, client):
        server.publish("state", 0, 1, b"honest bytes")

        async def declare_a_huge_frame() -> None:
            """Returns once the server has closed the stream; without the cap it waits for the rest of 1 GiB."""
            _, reader, writer = await client.p2p._client.stream_open(server.peer_id, (blob_handler_name(RUN_ID),))
            with contextlib.suppress(ConnectionError):  # the server may reset the stream while we still write
                writer.write(P2P.MESSAGE_MARKER + (1 << 30).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(1 << 20))
                await writer.drain()
                await asyncio.wait_for(reader.read(), 10)
            writer.close()

        client.run(declare_a_huge_frame(), timeout=30)
        assert client.fetch(server.peer_id, "state", 0, 1, 1 << 10, 10) == (1, b"honest bytes")

    async def frame(length: int, body: bytes) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        reader.feed_eof()
        return await P2P.receive_raw_data(reader)

    assert asyncio.run(frame(5, b"hello")) == b"hello"
    with pytest.raises(PayloadError, match=f"limit is {MAX_FRAME_BYTES}"):
        asyncio.run(frame(MAX_FRAME_BYTES + 1, b"x"))


def test_a_blob_not_held_yet_is_refused_without_a_logged_failure_and_real_failures_still_log() -> None:
    """A relay child polls its parent until the parent holds the message: hivemind logged each refusal as a failed
    handler with its traceback (a screenful per round). The refusal still reaches the asker, as "no <kind>"."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    daemon_log = logging.getLogger("hivemind.p2p.p2p_daemon")
    daemon_log.addHandler(handler)
    try:
        with swarm(2) as (server, client):
            with pytest.raises(Exception, match="no msg:ab"):
                client.fetch(server.peer_id, "msg:ab", 0, 1, 1 << 10, 10)
            server.publish("msg:ab", 0, 1, b"verified bytes")
            assert client.fetch(server.peer_id, "msg:ab", 0, 1, 1 << 10, 10) == (1, b"verified bytes")
    finally:
        daemon_log.removeHandler(handler)
    assert not [r for r in records if "Handler failed" in r.getMessage()]
    failure = logging.LogRecord("hivemind.p2p.p2p_daemon", logging.WARNING, __file__, 1, "Handler failed", None,
                                (ValueError, ValueError("offset past the blob"), None))  # fmt: skip
    assert quiet_not_served(failure)  # any other exception is still logged


def test_a_node_whose_p2p_daemon_died_says_so_instead_of_training_alone() -> None:
    import psutil

    with swarm(1) as (runtime,):
        assert runtime.p2pd_alive()
        runtime.ensure_daemon()
        daemons = [c for c in psutil.Process(runtime.dht.pid).children(recursive=True) if c.name().startswith("p2pd")]
        assert len(daemons) == 1
        daemons[0].kill()
        daemons[0].wait(10)
        assert not runtime.p2pd_alive()
        with pytest.raises(DaemonError, match="p2pd"):
            runtime.ensure_daemon()


def test_one_peer_cannot_hold_every_upload_slot() -> None:
    """Streams a peer holds open (reading slowly, or not at all) count against it alone: past the cap it is refused,
    while other peers are served and a released stream frees its slot."""
    with swarm(1) as (server,):
        server.publish("state", 0, 1, bytes(3 * BLOB_PIECE_BYTES))
        request = wire.BlobRequest(kind="state", shard=0, round=1)

        def opened(peer: str) -> Any:
            return server._serve_blob(request, SimpleNamespace(remote_id=peer))

        async def scenario() -> None:
            held = [opened("greedy") for _ in range(MAX_STREAMS_PER_PEER)]
            for stream in held:
                assert (await stream.__anext__()).total_size == 3 * BLOB_PIECE_BYTES  # open, first piece sent
            with pytest.raises(PayloadError, match="blob streams open"):
                await opened("greedy").__anext__()
            assert [len(piece.data) async for piece in opened("honest")] == [BLOB_PIECE_BYTES] * 3
            await held[0].aclose()  # the greedy peer lets one go
            assert (await opened("greedy").__anext__()).round == 1

        server.run(scenario(), timeout=60)


def test_a_stopped_node_leaves_no_hivemind_sockets_and_a_killed_nodes_directory_is_cleared() -> None:
    scratch = Path(tempfile.gettempdir())
    before = set(scratch.glob("hivemind-*.sock"))
    code = (
        "import os\nfrom hetero_node.client.swarm import runtime\nfrom hetero_node.protocol import socket_dir\n"
        "node = runtime.PeerRuntime([])\nprint(len(list(socket_dir.use_private_socket_dir().glob('*.sock'))))\n"
        "node.shutdown()\nprint(os.getpid())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sockets_while_running, pid = done.stdout.split()
    assert int(sockets_while_running) >= 2  # hivemind's sockets were in the node's own directory ...
    assert set(scratch.glob("hivemind-*.sock")) - before == set()  # ... none in /tmp itself
    assert list(scratch.glob(f"{socket_dir.PREFIX}{pid}-*")) == []  # and the directory is gone
    dead = scratch / f"{socket_dir.PREFIX}999999999-test"  # what a SIGKILLed node leaves (no such pid)
    dead.mkdir(exist_ok=True)
    (dead / "hivemind-p2pclient-x.sock").touch()
    mine = Path(tempfile.mkdtemp(prefix=f"{socket_dir.PREFIX}{os.getpid()}-"))
    assert dead in socket_dir.remove_stale(scratch)
    assert not dead.exists() and mine.is_dir()  # a live process keeps its directory
    mine.rmdir()


def test_a_private_swarm_keeps_out_a_peer_that_knows_its_address_but_not_its_key() -> None:
    key = os.urandom(32)
    members = [PeerRuntime([], swarm_key=key)]
    entry = [str(members[0].dht.get_visible_maddrs()[0])]
    members.append(PeerRuntime(entry, swarm_key=key))
    outsider, forger = PeerRuntime(entry), PeerRuntime(entry, swarm_key=os.urandom(32))  # no key, a wrong key
    everyone = [*members, outsider, forger]
    try:
        for runtime in everyone:
            runtime.join_run(RUN_ID)
            pid = str(runtime.peer_id)
            fields = record_fields(pid, member_proof=member_proof(runtime.swarm_key, pid))
            runtime.announce(PeerRecord(**fields), refresh_s=2.0)
        # the outsider also copies a member's proof into its own record: the proof is bound to the member's id
        stolen = record_fields(str(outsider.peer_id), member_proof=member_proof(key, str(members[0].peer_id)))
        outsider.announce(PeerRecord(**stolen), refresh_s=2.0)
        wanted = {str(m.peer_id) for m in members}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and set(members[1].read_records() or {}) != wanted:
            time.sleep(0.5)
        time.sleep(3)  # time for the outsiders' stores to arrive, if anything accepted them
        assert set(members[0].read_records() or {}) == set(members[1].read_records() or {}) == wanted
        # what the DHT shows an outsider of the members' records: ids and proofs, nothing they said about themselves
        raw = outsider.read_signed(peers_key(RUN_ID), timeout=10) or {}
        assert wanted <= set(raw), "the outsider could not even see that the members exist"
        assert not set(outsider.read_records() or {}) & wanted, "an outsider read a member's record"
        for pid in wanted:
            assert set(raw[pid]) == {"peer_id", "member_proof", "sealed"}, raw[pid]
            assert b"cpu_cores" not in raw[pid]["sealed"] and b"upload_mbps" not in raw[pid]["sealed"]
        members[0].publish("msg:ab", 0, 1, b"weights")
        assert members[1].fetch(members[0].peer_id, "msg:ab", 0, 1, max_size=100, timeout=10) == (1, b"weights")
        for intruder in (outsider, forger):
            with pytest.raises(Exception, match="not a member"):
                intruder.fetch(members[0].peer_id, "msg:ab", 0, 1, max_size=100, timeout=10)
    finally:
        for runtime in everyone:
            runtime.shutdown()


def test_a_member_proof_is_bound_to_its_peer_id() -> None:
    key = os.urandom(32)
    assert is_member(key, "peer-a", member_proof(key, "peer-a"))
    assert not is_member(key, "peer-b", member_proof(key, "peer-a")) and not is_member(key, "peer-a", "")
    assert not is_member(key, "peer-a", None) and is_member(None, "peer-a", "")  # a public swarm admits anyone


def test_a_sealed_value_opens_only_with_its_key_and_context() -> None:
    key = os.urandom(32)
    sealed = seal_value(key, {"addrs": ["/ip4/10.0.0.7/tcp/31337"]}, "record of A")
    assert b"10.0.0.7" not in sealed and sealed != seal_value(
        key, {"addrs": ["/ip4/10.0.0.7/tcp/31337"]}, "record of A"
    )
    assert open_value(key, sealed, "record of A") == {"addrs": ["/ip4/10.0.0.7/tcp/31337"]}
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for other_key, context, value in ((os.urandom(32), "record of A", sealed), (key, "record of B", sealed),
                                      (key, "record of A", flipped), (key, "record of A", b"short"),
                                      (key, "record of A", "not bytes")):  # fmt: skip
        assert open_value(other_key, value, context) is None


def test_a_private_swarms_records_and_announcement_are_readable_with_its_key_only() -> None:
    key, a, b = (
        os.urandom(32),
        "QmWULMk9Qn4QxcmfeWAkWRxG29ZSKN6WPPB4K7Qhi5i1hp",
        "QmU41q44JxNgU7z294ZKhe3C2E6JL1aLXKswqrBhkHqHzS",
    )
    record = record_fields(a, addrs=["/ip4/10.0.0.7/tcp/31337"], member_proof=member_proof(key, a))
    stored = sealed_record(record, key)
    assert set(stored) == {"peer_id", "member_proof", "sealed"} and sealed_record(record, None) == record
    assert parse_peer_record(stored, key) == PeerRecord(**record)
    assert parse_peer_record(stored) is None and parse_peer_record(stored, os.urandom(32)) is None
    assert parse_peer_record(record, key) is None, "a private swarm took a record in the clear"
    passed_off = {**sealed_record(record_fields(b, member_proof=member_proof(key, b)), key), "peer_id": a}
    assert parse_peer_record(passed_off, key) is None, "b's sealed record was taken as a's"
    announcement = RunAnnouncement(peer_id=a, run_id="0123456789abcdef", software_version="0.1.0", protocol_version=13,
                                   data_source="bundled", config={"preset": "tiny"}, private=True).dict()  # fmt: skip
    sealed = sealed_announcement(announcement, key)
    assert is_sealed_announcement(sealed) and b"tiny" not in sealed["sealed"]
    assert parse_run_announcement(sealed, key) == RunAnnouncement(**announcement)
    assert parse_run_announcement(sealed) is None and parse_run_announcement(sealed, os.urandom(32)) is None
    public = {**announcement, "private": False}
    assert sealed_announcement(public, None) == public and parse_run_announcement(public) == RunAnnouncement(**public)
