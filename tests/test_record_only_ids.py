"""Record-only identities against a real swarm: full-replica records whose nodes are gone (each cost one key).

A fresh swarm's first rounds need the seal of every member anyone names (`protocol/quorum.py`), and every member
the records show coming is waited for: counted as records, three such ids voided two honest replicas' first two
rounds, and their claimed speed can send joiners to standby. Counted as running nodes (`WorkLedger.running`: a
failed dial is a silent challenge), they are left out of rounds and plans, and the two train together."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm_helpers import assert_all_exit_cleanly, join_args, rounds_of, run_args

from hetero_node.bench.samples import record_fields
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.identity import owner_peer_id
from hetero_node.protocol.keys import peers_key
from hetero_node.protocol.records import base_validators, run_validators
from hetero_node.protocol.roles import ROLE_FULL

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(300)]
RECORD_ONLY = 3


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


def test_two_replicas_train_together_beside_full_replica_records_no_node_stands_behind(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(run_args(rounds=3))
        run_id = re.search(r"run ([0-9a-f]{16}):", swarm.log_path("bootstrap").read_text()).group(1)
        with record_only_ids(peers, run_id, RECORD_ONLY) as ids:
            reader = PeerRuntime([peers])
            try:
                reader.join_run(run_id, serve=False)
                assert wait_until_seen(reader, set(ids))
            finally:
                reader.shutdown()
            for i in range(2):  # the planner decides their roles
                swarm.start(f"r{i}", join_args(peers, i, tmp_path, role="auto", min_peers=2))
            assert_all_exit_cleanly(swarm, ["r0", "r1"])
    replicas = [rounds_of(tmp_path, i) for i in range(2)]
    for t in range(3):
        assert len({json.dumps(r[t]["fingerprints"], sort_keys=True) for r in replicas}) == 1, f"round {t} disagrees"
    together = [t for t in range(3) if all(r[t]["contributors"] == 2 for r in replicas)]
    assert len(together) >= 2, {t: [r[t]["contributors"] for r in replicas] for t in range(3)}
