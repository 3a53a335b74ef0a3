"""Record-only identities against a real swarm: full-replica records whose nodes are gone (each cost one key).

A fresh swarm's first rounds need the seal of every member anyone names (`protocol/quorum.py`), and every member
the records show coming is waited for: counted as records, three such ids voided two honest replicas' first two
rounds, and their claimed speed can send joiners to standby. Counted as running nodes (`WorkLedger.running`: a
failed dial is a silent challenge), they are left out of rounds and plans, and the two train together."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from record_only import record_only_ids, wait_until_seen
from swarm_helpers import assert_all_exit_cleanly, join_args, rounds_of, run_args

from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.swarm.runtime import PeerRuntime

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(300)]
RECORD_ONLY = 3


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
