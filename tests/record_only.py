"""Record-only identities in a real swarm: records of many ids, each costing one key, re-stored by one node that is
none of them (`test_record_only_ids.py`, `test_introduction.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hetero_node.bench.samples import record_fields
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.identity import owner_peer_id
from hetero_node.protocol.keys import peers_key
from hetero_node.protocol.records import base_validators, run_validators
from hetero_node.protocol.roles import ROLE_FULL


def wait_until_seen(reader: PeerRuntime, ids: set[str], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ids <= set(reader.read_records() or {}) and time.monotonic() < deadline:
        time.sleep(0.5)
    return ids <= set(reader.read_records() or {})


class ManyKeySigner(RecordValidatorBase):
    """Signs records for every key it holds: one running node storing the records of many ids, as an attacker's
    client would (hivemind's own validator signs for the node's key alone). Nobody can dial those ids."""

    def __init__(self, keys: list[RSAPrivateKey]) -> None:
        self.signers = [RSASignatureValidator(key) for key in keys]

    def validate(self, record: DHTRecord) -> bool:
        return True  # hivemind's RSASignatureValidator checks every signature

    def sign_value(self, record: DHTRecord) -> bytes:
        for signer in self.signers:
            record = dataclasses.replace(record, value=signer.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 9  # signs after the schema validator serialized the value, like hivemind's own


@contextlib.contextmanager
def record_only_ids(peers: str, run_id: str, count: int) -> Iterator[list[str]]:
    """`count` full-replica records coming to round 0 and claiming 10⁹ tokens/s, re-stored every second by one node
    that is none of them, each naming an address where nothing listens."""
    keys = [RSAPrivateKey() for _ in range(count)]
    subkeys = [RSASignatureValidator(key).local_public_key for key in keys]
    ids = [owner_peer_id(subkey) for subkey in subkeys]
    dht = hivemind.DHT(initial_peers=[peers], client_mode=True, start=True,
                       record_validators=[*base_validators(RSASignatureValidator()), *run_validators(run_id),
                                          ManyKeySigner(keys)])  # fmt: skip
    stop = threading.Event()

    def keep_storing() -> None:
        while not stop.is_set():
            now = get_dht_time()
            for pid, subkey in zip(ids, subkeys, strict=True):
                record = record_fields(pid, role=ROLE_FULL, round=0, train_round=0, written_at=now, refresh_s=2.0,
                                       tokens_per_s=1e9, addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{pid}"])  # fmt: skip
                dht.store(peers_key(run_id), subkey=subkey, value=record, expiration_time=now + 6, return_future=True)
            stop.wait(1.0)

    storer = threading.Thread(target=keep_storing, daemon=True)
    storer.start()
    try:
        yield ids
    finally:
        stop.set()
        storer.join()
        dht.shutdown()
