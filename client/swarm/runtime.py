"""A node's connection to the swarm: hivemind DHT, a background event loop, and blob serving over P2P streams.

Blobs are what peers fetch from each other outside hivemind's averaging protocol: a round's compressed
pseudo-gradient (`payload`) and a shard's current weights (`state`, for late joiners and re-syncs). They are
served from memory by a stream handler registered on the DHT's own libp2p daemon, so they share its peer id.
Every byte served or fetched is counted here, from the messages actually written to or read from the stream.

Over ~450 lines on purpose: the DHT, the event loop, the blob handlers and the signed stores all go through one
daemon connection, one loop and one DHT lock, which a split would pass from module to module; what needs none of
them lives apart (`addresses.py`, `record_reader.py`, `reachability.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from hetero_node.client.swarm.addresses import IDENTITY_TAKEN, identity_taken, join_failure, parse_peer_multiaddrs
from hetero_node.client.swarm.reachability import PeerDialer, relay_addresses
from hetero_node.client.swarm.record_reader import read_dictionary, read_peer_records
from hetero_node.client.swarm.work_ledger import ANSWERED, ASKING, SILENT, WorkLedger
from hetero_node.protocol.errors import ConfigError, DaemonError, PayloadError, PeerAddressError
from hetero_node.protocol.frames import bound_hivemind_frames
from hetero_node.protocol.identity import create_identity, load_identity, owner_peer_id
from hetero_node.protocol.introduction import ask_introduction, register_introduction_handler
from hetero_node.protocol.keys import blob_handler_name, peers_key, runs_key
from hetero_node.protocol.probe import register_probe_handlers
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.rate_limit import PeerBudget
from hetero_node.protocol.reachability import register_dialback_handler
from hetero_node.protocol.records import PeerRecord, base_validators, run_validators, sealed_record
from hetero_node.protocol.round_wire import reveals_a_message
from hetero_node.protocol.socket_dir import use_private_socket_dir
from hetero_node.protocol.swarm_key import MemberProofValidator

logger = logging.getLogger(__name__)
wire = load_proto_module("wire")

T = TypeVar("T")
LATEST_KINDS = ("state", "fixed", "embed")
"""Blob kinds a peer serves its newest copy of, whatever round others are in (state for late joiners)."""
BLOB_PIECE_BYTES = 1 << 20
"""Stream pieces stay far below libp2p's 4 MiB message cap (ARCHITECTURE.md, hivemind pitfall A)."""
RELAYED_PIECE_BYTES = 32 << 10
"""Pieces from a peer behind a circuit relay: several fit in the 128 KiB a relayed connection carries."""
MIN_PIECE_BYTES = 16 << 10
"""The smallest piece a fetcher may ask for: 1-byte pieces made a 256 KiB blob 262,144 messages (18× its bytes)."""
MAX_RELAYED_STALLS = 3
"""Fresh circuits in a row that may bring no byte of a blob before its fetch fails."""
KEPT_ROUNDS = 4
"""Blobs of the last rounds stay served, so a slow peer can still fetch them (or catch up from them) after we
moved on; older ones, and their byte counters, are forgotten."""
KEPT_STATES = 2
"""Whole states (the biggest blobs) are kept for fewer rounds: a peer that needs one takes the newest."""
MAX_STREAMS_PER_PEER = 16
"""Blob streams one peer may hold open here at once; more are refused. An honest peer opens one per shard it
fetches at a time (8 stages at most) plus a manifest; one that loops requests must not take every upload slot."""
STATE_REQUESTS_PER_MINUTE = 60
"""Whole states (and T_fixed tables) one peer may ask us for per minute: a 10-byte request makes us serialize and
stream a shard, so a looping peer must not turn us into its amplifier (security review H5). An honest stage asks for
T_fixed once per round and for states once per shard when it (re)loads, with retries. A request resumed at an
offset (through a relay) counts as the share of the blob it asks for."""
COPIES_PER_MINUTE = 4
"""Times one peer may fetch the same round message (its author's or a re-served copy: kind, shard, round) from us per
minute: an honest member fetches each once, plus a retry or a fallback after a failed prefetch; a looping one must
not make us re-send a round's messages without end (security review: they had no budget but the stream cap). A
transfer resumed at an offset counts as the share it asks for. Manifests (kilobytes) are asked again by design: a
late member reads a donor's manifest for each certificate and rebuild it checks."""
CHALLENGE_S = 3.0
"""How long a liveness challenge (a dial at the peer's recorded addresses) may take before the peer counts as silent."""
MAX_CHALLENGES = 64
"""Peers one call challenges at most (the others at the next call): a flood of records cannot make one wait long."""
INTRODUCTION_S = 5.0
"""How long a joiner waits for the peers it joined through to introduce it (`protocol/introduction.py`)."""
RECORDS_REREAD_S = 1.0
"""Least time between two reads of the records made on demand: for an unknown peer asking for a blob (private
swarms) and for a failed fetch (the peer may have moved to new addresses)."""


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


def not_served(kind: str) -> str:
    """How a peer's refusal starts when it holds no blob of `kind` (yet): a fetcher tells "ask again later" from a
    failure by it."""
    return f"no {kind}"


class NotServed(KeyError):
    """We hold no such blob (yet): the asker polls again (a relay child waiting for its parent), no failure of ours."""


def quiet_not_served(record: logging.LogRecord) -> bool:
    """A logging filter for hivemind's p2p daemon, which logs every exception a handler raises as a failure, with
    its traceback: a relay child polling its parent made a screenful per round of "Handler failed" warnings."""
    return not (record.exc_info and isinstance(record.exc_info[1], NotServed))


def relay_options(relays: list[str]) -> dict[str, Any]:
    """hivemind.DHT options of a node that cannot be dialed: reserve a slot on `relays` at once (p2pd's AutoNAT
    would need several peers to decide we are private before looking for relays)."""
    return {"use_auto_relay": True, "force_reachability": "private", "trusted_relays": relays}


def use_fork_start_method() -> None:
    """hivemind's DHT is a `multiprocessing.Process` subclass that only works when forked (its state holds weakrefs
    that cannot be pickled); Python 3.14 changes the default start method, so pin it."""
    multiprocessing.set_start_method("fork", force=True)


def p2pd_alive(dht: Any) -> bool:
    """Whether the p2p daemon of `dht` (a started `hivemind.DHT`, whose process is p2pd's parent) still runs."""
    import psutil

    try:
        children = psutil.Process(dht.pid).children(recursive=True)
        return any(c.name().startswith("p2pd") and c.status() != psutil.STATUS_ZOMBIE for c in children)
    except psutil.Error:  # the DHT process (p2pd's parent) is gone, or p2pd went while we looked
        return False


class PartialBlob:
    """The pieces of one blob received so far, checked as they come: never more than announced or allowed, and
    never pieces of two different rounds (a resumed transfer must continue the same blob)."""

    def __init__(self, peer: str, kind: str, max_size: int) -> None:
        self.peer, self.kind, self.max_size = peer, kind, max_size
        self.pieces: list[bytes] = []
        self.received, self.size = 0, -1
        self.round: int | None = None

    def add(self, piece: Any) -> None:
        if piece.total_size > self.max_size:
            raise ValueError(
                f"peer {self.peer} offers {piece.total_size} bytes, more than the {self.max_size} expected"
            )
        if self.round is not None and (piece.round, piece.total_size) != (self.round, self.size):
            raise ValueError(f"peer {self.peer}'s {self.kind} changed while it was being fetched")
        self.round, self.size = piece.round, piece.total_size
        self.pieces.append(piece.data)
        self.received += len(piece.data)
        if self.received > self.size:
            raise ValueError(f"peer {self.peer} sent more bytes than it announced")

    @property
    def complete(self) -> bool:
        return self.round is not None and self.received == self.size

    @property
    def data(self) -> bytes:
        return b"".join(self.pieces)


class PeerRuntime:
    """Owns the DHT, a background asyncio loop thread, the blob and probe handlers, and the byte counters.

    It connects before the run is known (a joiner learns it from the bootstrap); `join_run` then adds the run's
    record schema and starts serving the run's blobs.
    """

    def __init__(
        self,
        initial_peers: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        identity_path: Path | None = None,
        announce_maddrs: list[str] | None = None,
        client_mode: bool = False,
        swarm_key: bytes | None = None,
        relays: list[str] | None = None,
    ) -> None:
        """`relays`: peers to be reachable through (this node cannot be dialed: `client/swarm/reachability.py`);
        a relayed node is a DHT client, since nobody could route DHT requests to it."""
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator

        peers = parse_peer_multiaddrs(initial_peers)
        scratch = None if identity_path else Path(tempfile.mkdtemp(prefix="hetero-node-identity-"))
        identity = identity_path if scratch is None else scratch / "identity"
        fresh = not identity.exists()
        if fresh:
            create_identity(identity)
        self.signer = RSASignatureValidator(load_identity(identity))  # one key: peer id and record signatures
        bound_hivemind_frames()
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(quiet_not_served)  # once: a filter is added once
        use_private_socket_dir()
        use_fork_start_method()
        try:
            self.dht = hivemind.DHT(
                initial_peers=peers,
                host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                announce_maddrs=announce_maddrs,
                identity_path=str(identity),
                check_if_identity_free=not fresh,  # a key made just now is nobody else's
                record_validators=base_validators(self.signer),
                client_mode=client_mode or bool(relays),
                start=True,
                **(relay_options(relays) if relays else {}),
            )
        except Exception as e:  # hivemind reports unreachable bootstraps as a generic error from its child
            if IDENTITY_TAKEN in str(e):
                raise ConfigError(identity_taken(identity)) from None
            raise PeerAddressError(join_failure(peers, e)) from None
        finally:
            if scratch is not None:  # p2pd has read the key by now (or failed): a temporary name leaves no file
                shutil.rmtree(scratch, ignore_errors=True)
        self.initial_peers = peers
        self.relays = relays or []
        self.swarm_key = swarm_key
        """A private swarm's key (`protocol/swarm_key.py`); None in a public swarm."""
        self._members: set[str] = set()
        """Peer ids whose records were in our last read: who may fetch blobs in a private swarm."""
        self._members_read = 0.0
        self.store_s = 0.0
        """How long our signed DHT stores (statements, seals) take to land: a node on a far link stops training this
        much before a round's deadline, so its statement is in when the others' are (`RoundPlan.lead_s`)."""
        self.uplinks: dict[str, float] = {}
        """Each peer's advertised upload (Mbit/s) in our last read of the records: who relays round messages."""
        self.work = WorkLedger()
        """Whom this node has seen first, working or answering (`work_ledger.py`): what its votes count."""
        self.run_id: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hetero-node-p2p", daemon=True)
        self._thread.start()
        self._blobs: dict[tuple[str, int], dict[int, bytes | Callable[[], bytes]]] = defaultdict(dict)
        self._blobs_lock = threading.Lock()
        self._open_streams: Counter[str] = Counter()
        self._state_budget = PeerBudget(STATE_REQUESTS_PER_MINUTE, 60.0)
        self._copy_budget = PeerBudget(COPIES_PER_MINUTE, 60.0)
        self.reveal_gates: dict[int, Callable[[str, int], Awaitable[bool]]] = {}
        """Per shard, whether a peer may fetch our messages of a round (`client/outer/reveal.py`): commit, then
        reveal."""
        self._dht_lock = threading.Lock()  # hivemind's DHT writes requests to one pipe without a lock of its own
        self._last_request = 0.0
        self.bytes_served_total = 0
        """Every blob byte served so far (what a round's `bytes_sent` is taken from)."""
        self.lying_relays: set[str] = set()
        """Peers that re-served a round's message with bytes not matching its agreed digest: every shard fetches
        from authors instead of them from then on (`ShardSync`)."""
        self._record: tuple[PeerRecord | None, float] = (None, 0.0)
        self._heartbeat: Any = None
        self.p2p = self.run(self.dht.replicate_p2p())
        self.peer_id = self.p2p.peer_id
        self.dialer = PeerDialer(self)
        self.run(register_introduction_handler(self.p2p, lambda: self.work.introduction(_dht_time())))
        if not client_mode and not relays:
            self.run(register_probe_handlers(self.p2p))
            self.run(register_dialback_handler(self.p2p))

    def join_run(self, run_id: str, serve: bool = True) -> None:
        """Validate this run's peer records and (unless only watching) serve its blobs."""
        self.run_id = run_id
        self.dht.add_validators(run_validators(run_id))
        if self.swarm_key is not None:
            self.dht.add_validators([MemberProofValidator(self.swarm_key, peers_key(run_id))])
        self.ask_introductions()
        if serve:
            self.run(
                self.p2p.add_protobuf_handler(
                    blob_handler_name(run_id), self._serve_blob, wire.BlobRequest, stream_output=True
                )
            )

    def ask_introductions(self) -> None:
        """Ask the peers we joined through (`--peers`) whom they have seen running (`protocol/introduction.py`): our
        first challenges, and our view over the record cap, go to those."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        introducers = {Multiaddr(maddr).value_for_protocol("p2p") for maddr in self.initial_peers}

        async def ask_all() -> list[list[str]]:
            asks = (ask_introduction(self.p2p, PeerID.from_base58(p), INTRODUCTION_S) for p in introducers)
            return await asyncio.gather(*asks)

        introduced = {peer for peers in self.run(ask_all()) for peer in peers} - {str(self.peer_id)}
        self.work.note_introduced(introduced, _dht_time())
        if introducers:
            logger.info("introduced to %d running peers by %d we joined through", len(introduced), len(introducers))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background loop P2P calls run on (for callers that start a call without waiting for it)."""
        return self._loop

    @property
    def visible_maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    @property
    def advertised_addrs(self) -> list[str]:
        """What our record tells others to dial: our circuits when relayed, else our listen addresses."""
        return relay_addresses(self.relays) if self.relays else self.visible_maddrs

    def p2pd_alive(self) -> bool:
        """Whether this node's p2p daemon still runs. hivemind does not notice when it dies: every call just fails,
        and a node would go on training alone, round after round, without a word."""
        return p2pd_alive(self.dht)

    def ensure_daemon(self) -> None:
        """Raise `DaemonError` if the p2p daemon died (checked once per round)."""
        if not self.p2pd_alive():
            raise DaemonError(
                "this node's p2p daemon (p2pd) is gone, so it can no longer reach the swarm; "
                "start the node again (it resumes from its checkpoint and catches up)"
            )

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the background loop from the calling (training) thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------------------------------------ blobs

    def publish(self, kind: str, shard: int, round_: int, data: bytes | Callable[[], bytes]) -> None:
        """Serve `data` as (kind, shard, round); blobs of rounds KEPT_ROUNDS or more below it are forgotten (for
        every kind: one-off kinds such as a round's re-served messages go away entirely). `data` may be a function
        that makes the bytes: it runs when someone first asks (a whole state is serialized only if a peer needs it)."""
        with self._blobs_lock:
            self._blobs[(kind, shard)][round_] = data
            oldest = round_ - KEPT_ROUNDS + 1
            for key in list(self._blobs):
                rounds = self._blobs[key]
                if key[0] in LATEST_KINDS:  # pruned only against their own kind's rounds
                    stale = [r for r in rounds if key[0] == kind and r <= round_ - KEPT_STATES]
                else:
                    stale = [r for r in rounds if r < oldest]
                for old in stale:
                    del rounds[old]
                if not rounds:
                    del self._blobs[key]

    def _lookup(self, kind: str, shard: int, round_: int) -> tuple[int, bytes | Callable[[], bytes]] | None:
        with self._blobs_lock:
            rounds = self._blobs.get((kind, shard), {})
            if kind in LATEST_KINDS and round_ not in rounds:  # the asked round, else the newest one after it
                newest = max((r for r in rounds if r >= round_), default=None)
                return None if newest is None else (newest, rounds[newest])
            return (round_, rounds[round_]) if round_ in rounds else None

    @property
    def peers_seen(self) -> int:
        """Peers whose valid records were in our last read of the run's records (this node included)."""
        return len(self._members)

    async def _is_member(self, peer: str) -> bool:
        """In a private swarm, whether `peer`'s record (with a valid proof) is in the view; re-read for a peer we
        do not know yet (it may have just joined)."""
        if self.swarm_key is None or peer in self._members:
            return True
        await self._reread_records()
        return peer in self._members

    async def _reread_records(self) -> None:
        """Read the run's records now, unless they were read in the last `RECORDS_REREAD_S` (off the event loop:
        the read waits on the DHT)."""
        if time.monotonic() - self._members_read > RECORDS_REREAD_S:
            await asyncio.get_running_loop().run_in_executor(None, self.read_records, 2.0)

    async def _serve_blob(self, request: Any, context: Any) -> AsyncIterator[Any]:
        peer = str(context.remote_id)
        if not await self._is_member(peer):
            raise PayloadError(f"{peer} is not a member of this private swarm")
        if self._open_streams[peer] >= MAX_STREAMS_PER_PEER:  # the counter lives on the event loop: no lock
            raise PayloadError(f"{peer} already holds {MAX_STREAMS_PER_PEER} blob streams open here")
        self._open_streams[peer] += 1
        try:
            found = self._lookup(request.kind, request.shard, request.round)
            if found is None:
                raise NotServed(f"{not_served(request.kind)} for shard {request.shard} round {request.round} here")
            round_, data = found
            gate = self.reveal_gates.get(request.shard)
            if gate is not None and reveals_a_message(request.kind) and not await gate(peer, round_):
                raise NotServed(
                    f"{not_served(request.kind)} for shard {request.shard} round {round_} to {peer} yet: its own "
                    "statement of that round is not in (commit, then reveal)"
                )
            if callable(data):  # made on first request, off the event loop, then kept
                data = await asyncio.get_running_loop().run_in_executor(None, data)
                with self._blobs_lock:
                    self._blobs.get((request.kind, request.shard), {}).update({round_: data})
            if request.offset > len(data):
                raise ValueError(f"offset {request.offset} is past the {len(data)} bytes of this blob")
            resumed_share = (len(data) - request.offset) / max(len(data), 1)  # a resumed transfer pays what is left
            if request.kind in LATEST_KINDS and not self._state_budget.take(peer, resumed_share):
                raise PayloadError(f"{peer} asked for {STATE_REQUESTS_PER_MINUTE} states in the last minute")
            copy = f"{peer} {request.kind} {request.shard} {round_}"
            if reveals_a_message(request.kind) and not self._copy_budget.take(copy, resumed_share):
                raise PayloadError(
                    f"{peer} fetched this {request.kind} of round {round_} {COPIES_PER_MINUTE} times in the last minute"
                )
            asked = max(request.piece_bytes, MIN_PIECE_BYTES) if request.piece_bytes else BLOB_PIECE_BYTES
            step = min(asked, BLOB_PIECE_BYTES)
            for start in range(request.offset, max(len(data), request.offset + 1), step):
                piece = wire.BlobChunk(data=data[start : start + step], total_size=len(data), round=round_)
                self.bytes_served_total += piece.ByteSize()
                yield piece
            self._last_request = time.monotonic()
        finally:
            self._open_streams[peer] -= 1

    def fetch(
        self, peer_id: Any, kind: str, shard: int, round_: int, max_size: int, timeout: float
    ) -> tuple[int, bytes]:
        """Download a blob from `peer_id`; returns (its round, bytes). Raises on timeout, error or oversize."""
        return self.run(asyncio.wait_for(self.fetch_with_retries(peer_id, kind, shard, round_, max_size), timeout))

    async def fetch_with_retries(
        self, peer_id: Any, kind: str, shard: int, round_: int, max_size: int, attempts: int = 3
    ) -> tuple[int, bytes]:
        """`fetch_async`, retried: a libp2p stream occasionally closes early under load, and one lost payload
        would leave this peer out of agreement for a round. The records are read again before a retry: a peer
        that restarted elsewhere announces its new addresses there."""
        for attempt in range(attempts - 1):
            try:
                return await self.fetch_async(peer_id, kind, shard, round_, max_size)
            except Exception as e:  # transport errors come in many types; the last attempt raises them
                logger.info("fetching %s of shard %d from %s failed (%r); retrying", kind, shard, peer_id, e)
                await asyncio.sleep(0.2 * (attempt + 1))
                await self._reread_records()
        return await self.fetch_async(peer_id, kind, shard, round_, max_size)

    async def fetch_async(self, peer_id: Any, kind: str, shard: int, round_: int, max_size: int) -> tuple[int, bytes]:
        """Download a blob: (its round, its bytes), over a connection dialed at the addresses the peer's record
        carries (`PeerDialer`). From a peer reached through a circuit relay it comes in small pieces and resumes
        where a reset cut it off, over a fresh circuit: p2pd's relay service resets every relayed connection after
        128 KiB each way, whatever its flags say."""
        from hivemind.p2p import P2PHandlerError  # the peer answered with an error: resuming cannot help

        relayed = self.dialer.through_relay(str(peer_id))
        blob = PartialBlob(str(peer_id), kind, max_size)
        stalls = 0
        while True:
            request = wire.BlobRequest(
                kind=kind, shard=shard, round=round_ if blob.round is None else blob.round, offset=blob.received,
                piece_bytes=RELAYED_PIECE_BYTES if relayed else 0,
            )  # fmt: skip
            before, error = blob.received, None
            try:
                await self.dialer.dial(str(peer_id))
                stream = await self.p2p.iterate_protobuf_handler(
                    peer_id, blob_handler_name(self.run_id), request, wire.BlobChunk
                )
                async for piece in stream:
                    blob.add(piece)
            except Exception as e:  # the circuit was reset under us (or the peer failed): maybe resume below
                error = e
            if blob.complete:
                return blob.round, blob.data  # type: ignore[return-value]  # complete: the round is known
            stalls = 0 if blob.received > before else stalls + 1
            if not relayed or stalls > MAX_RELAYED_STALLS or isinstance(error, (ValueError, P2PHandlerError)):
                raise error or ValueError(
                    f"peer {peer_id} sent a truncated {kind} ({blob.received} of {blob.size} bytes)"
                )

    def served_since(self, since: float) -> bool:
        """Whether any blob was requested after `since` (monotonic time): others still fetch from us."""
        return self._last_request > since

    # ---------------------------------------------------------------------------------------------- records

    def announce(self, record: PeerRecord, refresh_s: float) -> None:
        """Publish our signed peer record now and re-publish it every `refresh_s` until replaced or shut down.

        It expires 3 × refresh_s after its last refresh, so a dead peer disappears from everyone's view while a
        live one stays visible however long its inner steps take.
        """
        self._record = (record, refresh_s)
        self._store_record()
        if self._heartbeat is None:
            self._heartbeat = asyncio.run_coroutine_threadsafe(self._refresh_record(), self._loop)

    def _store_record(self) -> None:
        from hivemind.utils import get_dht_time

        record, refresh_s = self._record
        assert record is not None
        now = get_dht_time()
        with self._dht_lock:
            self.dht.store(
                peers_key(self.run_id),
                subkey=self.signer.local_public_key,
                value=sealed_record({**record.dict(), "written_at": now}, self.swarm_key),  # readers age it by that
                expiration_time=now + 3 * refresh_s,
                return_future=True,  # a lost store is repaired by the next refresh (hivemind may report False)
            )

    async def _refresh_record(self) -> None:
        while True:
            await asyncio.sleep(self._record[1])
            self._store_record()

    def read_records(self, timeout: float = 5.0) -> dict[str, PeerRecord] | None:
        """Live peers' valid records by peer id (ours included); None when the DHT does not answer in time."""
        timed = self.read_records_timed(timeout)
        return None if timed is None else {pid: record for pid, (record, _) in timed.items()}

    def read_records_timed(self, timeout: float = 5.0) -> dict[str, tuple[PeerRecord, float]] | None:
        """As `read_records`, with each record's DHT expiration time."""
        if not self.dht.is_alive():  # a signal to the whole process group took the DHT down: do not wait
            return None
        me = str(self.peer_id)
        timed = read_peer_records(self.dht, self.run_id, self.swarm_key, timeout, self.work, me, self._dht_lock)
        if timed is not None:
            self._members, self._members_read = set(timed), time.monotonic()
            self.uplinks = {pid: record.upload_mbps for pid, (record, _) in timed.items()}
            self.dialer.note({pid: record for pid, (record, _) in timed.items()})
        return timed

    def voters(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """The records whose peers count in a vote (`WorkLedger.voters`): those seen working, else those that
        answer a liveness challenge (asked now, up to `CHALLENGE_S`); a record no running node stands behind never
        counts."""
        from hivemind.utils import get_dht_time

        me = str(self.peer_id)
        if not self.work.working(get_dht_time()) & (records.keys() - {me}):
            # every peer not known either way is asked first: the few that answered before the others (a
            # background dial) are no vote (the poison bench's joiner counted a liar and one of two honest donors,
            # and the upper median of their rounds was the liar's, 1 run in 6 on a loaded machine)
            self.challenge(records, wait=True)
        return self.work.voters(records, get_dht_time(), me) or {}

    def running(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """The records whose peers a round waits for and counts as live (`WorkLedger.running`): all but those that
        did not answer their last challenge. Peers not known either way are challenged in the background, not
        waited for."""
        from hivemind.utils import get_dht_time

        self.challenge(records, wait=False)
        return self.work.running(records, get_dht_time())

    def challenge(self, records: dict[str, PeerRecord], wait: bool) -> None:
        """Dial up to `MAX_CHALLENGES` of the peers of `records` not known alive or asked lately (contested slots'
        claimants first: `WorkLedger.to_challenge`), at their recorded addresses:
        libp2p's secure channel authenticates the answer, so one that connects is a running node holding that peer
        id's key. `wait`: until they answered or `CHALLENGE_S` passed, those an earlier challenge asked included."""
        from hivemind.utils import get_dht_time

        me = str(self.peer_id)
        asked = [p for p in self.work.to_challenge(records, get_dht_time()) if p != me][:MAX_CHALLENGES]
        for peer in asked:  # not asked again while the answer is due
            self.work.note_challenge(peer, ASKING, get_dht_time())

        async def ask(peer: str) -> None:
            try:
                await asyncio.wait_for(self.dialer.dial(peer, must_connect=True), CHALLENGE_S)
            except Exception:  # no address answered (a record with no node behind it), or another key did
                self.work.note_challenge(peer, SILENT, get_dht_time())
            else:
                self.work.note_challenge(peer, ANSWERED, get_dht_time())

        async def ask_all() -> None:
            await asyncio.gather(*(ask(peer) for peer in asked))

        if asked:
            future = asyncio.run_coroutine_threadsafe(ask_all(), self._loop)
            if wait:
                with contextlib.suppress(Exception):
                    future.result(CHALLENGE_S + 1.0)
                logger.info(
                    "challenged %d peers: %d answered", len(asked), len(self.work.alive(get_dht_time()) & set(asked))
                )
        if wait:
            self._await_answers(list(records))

    def _await_answers(self, peers: list[str]) -> None:
        """The answers of `peers` asked earlier by a challenge that did not wait (up to `CHALLENGE_S`): a vote taken
        while they are due would count only the quicker ones."""
        from hivemind.utils import get_dht_time

        deadline = time.monotonic() + CHALLENGE_S
        while time.monotonic() < deadline and self.work.asking(peers, get_dht_time()):
            time.sleep(0.05)

    def _get(self, key: str, timeout: float) -> dict[Any, Any] | None:
        """A DHT dictionary as {subkey: (value, expiration)}; {} if absent, None if the DHT did not answer."""
        if not self.dht.is_alive():  # a signal to the whole process group took the DHT down: do not wait
            return None
        return read_dictionary(self.dht, key, timeout, self._dht_lock)

    def store_signed(self, key: str, value: Any, lifetime_s: float) -> None:
        """Store `value` under `key` with our public key as its subkey: signed, so every reader knows it is ours and
        one author holds one value there (a later store replaces it)."""
        from hivemind.utils import get_dht_time

        started = time.monotonic()
        with self._dht_lock:
            stored = self.dht.store(
                key, subkey=self.signer.local_public_key, value=value,
                expiration_time=get_dht_time() + lifetime_s, return_future=True,
            )  # fmt: skip
        stored.add_done_callback(lambda _future: self._time_store(time.monotonic() - started))

    def _time_store(self, seconds: float) -> None:
        """Fold one signed store's duration into `store_s`: a larger figure at once, a smaller one by halves."""
        self.store_s = seconds if seconds > self.store_s else (self.store_s + seconds) / 2

    def read_signed(self, key: str, timeout: float) -> dict[str, Any] | None:
        """The values stored under `key` by `store_signed`, by the peer id of the key that signed each; None when
        the DHT did not answer in time."""
        found = self._get(key, timeout)
        if found is None:
            return None
        return {peer: value for subkey, (value, _) in found.items() if (peer := owner_peer_id(subkey)) is not None}

    def read_run_announcements(self, timeout: float = 5.0) -> dict[bytes, dict[str, Any]] | None:
        """Run announcements by signing key (validated by the DHT's schema and signature validators)."""
        found = self._get(runs_key(), timeout)
        return None if found is None else {k: v for k, (v, _) in found.items() if isinstance(v, dict)}

    def shutdown(self) -> None:
        """Stop the DHT (and its p2pd) and the loop; safe to call twice."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._loop.is_running():
            with contextlib.suppress(Exception):  # closing the replica's daemon connection before its loop stops
                self.run(self.p2p.shutdown(), timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if self.dht.is_alive():
            self.dht.shutdown()
