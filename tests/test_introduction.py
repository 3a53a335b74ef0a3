"""Trusted introduction (`protocol/introduction.py`): the peer a joiner joined through names the peers it has seen
running, and the joiner challenges and keeps those first. At 10⁵ record-only ids a joiner on its own kept each honest
record with odds of 4% and found none in 30 reads (`make bench-sybil`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from factories import peer_id, peer_record
from hivemind.utils import get_dht_time
from record_only import record_only_ids, wait_until_seen
from swarm_helpers import run_args

from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.client.swarm.work_ledger import ANSWERED, INTRODUCED_S, SILENT, WorkLedger
from hetero_node.protocol.introduction import MAX_INTRODUCED

NOW = 10_000.0


def test_introduced_peers_are_challenged_and_kept_first_until_the_introduction_is_old() -> None:
    records = {r.peer_id: r for r in (peer_record(f"p{i}") for i in range(2000))}
    introduced = [peer_id(f"p{i}") for i in (3, 700, 1999)]
    ledger = WorkLedger()
    ledger.note_records(records.values(), NOW)
    ledger.note_introduced([*introduced, peer_id("not-in-the-records")], NOW)
    assert set(ledger.to_challenge(records, NOW)[:3]) == set(introduced)
    assert set(ledger.keep(records, 10, NOW)) >= set(introduced)
    later = NOW + INTRODUCED_S + 1
    ledger.note_records(records.values(), later)
    assert not ledger.introduced  # forgotten: by now the joiner has seen them work, or they did not
    assert set(WorkLedger(salt=ledger.salt).keep(records, 10, later)) == set(ledger.keep(records, 10, later))


def test_a_node_introduces_the_peers_it_saw_working_then_those_that_answered() -> None:
    ledger = WorkLedger()
    ledger.note_work([peer_id("w")], NOW)
    ledger.note_challenge(peer_id("a"), ANSWERED, NOW)
    ledger.note_challenge(peer_id("w"), ANSWERED, NOW)
    ledger.note_challenge(peer_id("s"), SILENT, NOW)
    assert ledger.introduction(NOW) == [peer_id("w"), peer_id("a")]


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_bootstrap_introduces_running_nodes_and_no_record_only_id(tmp_path: Path) -> None:
    """Over real libp2p: a bootstrap names the DHT nodes that talked to it, never ids that only have records; a
    running node names whom its ledger saw working; a peer's reply past `MAX_INTRODUCED` is cut."""
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(run_args(rounds=1))
        run_id = re.search(r"run ([0-9a-f]{16}):", swarm.log_path("bootstrap").read_text()).group(1)
        runtimes: list[PeerRuntime] = []
        try:
            with record_only_ids(peers, run_id, 3) as ids:
                running = PeerRuntime([peers])
                runtimes.append(running)
                running.join_run(run_id, serve=False)
                joiner = PeerRuntime([peers])
                runtimes.append(joiner)
                joiner.join_run(run_id, serve=False)
                assert wait_until_seen(joiner, set(ids))
                assert str(running.peer_id) in joiner.work.introduced
                assert not set(ids) & joiner.work.introduced.keys()
                assert str(joiner.peer_id) not in joiner.work.introduced
            workers = [peer_id(f"w{i}") for i in range(MAX_INTRODUCED + 10)]
            running.work.note_work(workers, get_dht_time())
            through_a_peer = PeerRuntime(running.visible_maddrs)
            runtimes.append(through_a_peer)
            through_a_peer.join_run(run_id, serve=False)
            assert set(through_a_peer.work.introduced) == set(sorted(workers)[:MAX_INTRODUCED])
        finally:
            for runtime in runtimes:
                runtime.shutdown()
