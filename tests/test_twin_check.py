"""The records half of refusing a second node with a live node's key (`client/swarm/twin_check.py`): a record of
our peer id that is rewritten while we wait is a live twin; one that is not is a stopped node (our own previous
run). The whole refusal, with real processes, is `tests/test_deploy.py::test_a_second_node_with_a_live_identity...`;
this covers the case it cannot stage on demand, hivemind's dial check answering "free" for a live key."""

from __future__ import annotations

import threading

from factories import peer_id, peer_record
from hivemind.utils import get_dht_time

from hetero_node.client.swarm.twin_check import live_twin
from hetero_node.protocol.records import PeerRecord

ME = peer_id("me")


class SwarmRecords:
    """What `live_twin` reads of a runtime: our peer id and the swarm's records, one snapshot per read."""

    def __init__(self, *reads: dict[str, PeerRecord] | None) -> None:
        self.peer_id, self.reads, self.count = ME, list(reads), 0

    def read_records(self, timeout: float = 5.0) -> dict[str, PeerRecord] | None:
        self.count += 1
        return self.reads.pop(0)


def mine(age_s: float = 0.0) -> PeerRecord:
    """A record of our key written `age_s` ago, rewritten every 0.2 s by its node."""
    return peer_record("me", refresh_s=0.2, written_at=get_dht_time() - age_s)


def test_a_record_of_our_key_rewritten_while_we_wait_is_a_live_twin() -> None:
    first = mine()
    rewritten = first.copy(update={"written_at": first.written_at + 0.2})
    assert live_twin(SwarmRecords({ME: first}, {ME: rewritten}), threading.Event())  # type: ignore[arg-type]


def test_a_record_of_our_key_left_as_it_was_is_a_stopped_node() -> None:
    first = mine()
    assert not live_twin(SwarmRecords({ME: first}, {ME: first}), threading.Event())  # type: ignore[arg-type]
    assert not live_twin(SwarmRecords({ME: first}, {}), threading.Event())  # type: ignore[arg-type]  # expired
    stale = SwarmRecords({ME: mine(age_s=0.5)})  # its rewrite was due 0.3 s after it, 0.2 s ago: one read
    assert not live_twin(stale, threading.Event())  # type: ignore[arg-type]
    assert stale.count == 1


def test_no_record_of_our_key_or_no_answer_costs_no_wait() -> None:
    others = SwarmRecords({peer_id("other"): peer_record("other")})
    assert not live_twin(others, threading.Event())  # type: ignore[arg-type]
    assert others.count == 1
    assert not live_twin(SwarmRecords(None), threading.Event())  # type: ignore[arg-type]


def test_a_node_told_to_leave_stops_checking() -> None:
    stop = threading.Event()
    stop.set()
    records = SwarmRecords({ME: mine()}, {ME: mine()})
    assert not live_twin(records, stop)  # type: ignore[arg-type]
    assert records.count == 1
