"""Reading the run's peer records from the DHT: only records signed by the key of the peer id they claim (and, in
a private swarm, with a member proof) count, and at most a bounded number of them, each live for a bounded time."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from hetero_node.client.swarm.work_ledger import WorkLedger
from hetero_node.protocol.identity import owner_peer_id
from hetero_node.protocol.keys import peers_key
from hetero_node.protocol.records import PeerRecord, parse_peer_record
from hetero_node.protocol.swarm_key import is_member

logger = logging.getLogger(__name__)

MAX_RECORDS = 4096
"""Records of one run a reader takes into account (hivemind answers a DHT get with at most 4 MiB; a record is
well under 1 KB)."""
MAX_RECORD_LIFETIME_S = 600.0
"""A record counts as live for at most this long after the time it says it was written (`written_at`), whatever
expiration its writer chose: records are refreshed every few seconds, and a far expiration kept a record stored
once in everyone's view for good (the cap was once applied relative to each read)."""

REWRITE_PERIODS = 1.5
"""A live node rewrites its record every `refresh_s`; one not rewritten within this many periods of its `written_at`
(one, and half of one for a store a loaded machine makes late) is a node that stopped, or is frozen."""


def rewritten_lately(record: PeerRecord, now: float) -> bool:
    """Whether the record's node rewrote it within `REWRITE_PERIODS` refresh periods of DHT time `now`."""
    return now - record.written_at <= REWRITE_PERIODS * record.refresh_s


def latest_valid_records(
    found: dict[Any, tuple[Any, float]],
    now: float,
    swarm_key: bytes | None = None,
    limit: int = MAX_RECORDS,
    ledger: WorkLedger | None = None,
    me: str = "",
) -> dict[str, tuple[PeerRecord, float]]:
    """(record, expiration) of the records that pass the schema and are signed by the key of the peer id they
    claim (`protocol/identity.py`), by peer id. A record signed by any other key is dropped: it is a forgery. In a
    private swarm, so is one not sealed with the swarm key or without a valid member proof.

    `ledger` is the reader's memory (`work_ledger.py`; a throwaway one without): it notes first sights, keeps at most
    `limit` records (working peers, then incumbents: a flood costs the planner a bounded amount and cannot push
    them out), and dates each other peer's slot claim no earlier than this reader first saw it."""
    ledger = ledger if ledger is not None else WorkLedger()
    best: dict[str, tuple[PeerRecord, float]] = {}
    for subkey, (value, expiration) in found.items():
        record = parse_peer_record(value, swarm_key)
        if record is None or owner_peer_id(subkey) != record.peer_id:
            continue
        if not is_member(swarm_key, record.peer_id, record.member_proof):
            continue
        live_until = min(expiration, record.written_at + min(3 * record.refresh_s, MAX_RECORD_LIFETIME_S))
        if live_until <= now or record.written_at > now + MAX_RECORD_LIFETIME_S:  # stale, or dated far ahead
            continue
        best[record.peer_id] = (record, live_until)
    ledger.note_records((record for record, _ in best.values()), now)
    if len(best) > limit:
        logger.warning("%d peer records in the run; keeping %d: peers seen working, then the earliest seen",
                       len(best), limit)  # fmt: skip
        best = {pid: best[pid] for pid in ledger.keep(best, limit, now)}
    return {pid: (_dated(record, ledger, me), until) for pid, (record, until) in best.items()}


def _dated(record: PeerRecord, ledger: WorkLedger, me: str) -> PeerRecord:
    """`record` with its slot claim dated as this reader saw it (our own claim is ours to know)."""
    if record.peer_id == me or (claimed_at := ledger.claimed_at(record)) == record.claimed_at:
        return record
    return record.copy(update={"claimed_at": claimed_at})


def read_dictionary(
    dht: Any, key: str, timeout: float, lock: contextlib.AbstractContextManager = contextlib.nullcontext()
) -> dict[Any, tuple[Any, float]] | None:
    """A DHT dictionary as {subkey: (value, expiration)}; {} if absent, None if the DHT did not answer in time.
    `lock` guards only the request (the DHT's pipe), not the wait."""
    with lock:
        future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout)
    except Exception as e:  # a DHT that does not answer must not stall training (hivemind pitfall H)
        logger.warning("reading %s from the DHT failed: %r", key, e)
        return None
    if found is None or not isinstance(found.value, dict):
        return {}
    return {k: (v.value, v.expiration_time) for k, v in found.value.items()}


def read_peer_records(
    dht: Any,
    run_id: str,
    swarm_key: bytes | None,
    timeout: float,
    ledger: WorkLedger,
    me: str = "",
    lock: contextlib.AbstractContextManager = contextlib.nullcontext(),
) -> dict[str, tuple[PeerRecord, float]] | None:
    """The run's valid peer records with their expiration times (None: the DHT did not answer), as `me` with its
    `ledger` sees them; used by peers and by the bootstrap's dashboard, which reads its own DHT."""
    from hivemind.utils import get_dht_time

    found = read_dictionary(dht, peers_key(run_id), timeout, lock)
    return None if found is None else latest_valid_records(found, get_dht_time(), swarm_key, ledger=ledger, me=me)
