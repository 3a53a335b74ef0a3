"""When a round we did not complete is over (`client/roles/catch_up_driver.py: CatchingUp.obtain`): the decision
alone, on records that change while it waits, with no network (the rebuild it then asks for is
`tests/test_catch_up.py`'s)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace
from typing import Any

from factories import peer_id, peer_record
from hivemind.utils import get_dht_time

from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.shard_sync import ShardOutcome
from hetero_node.client.roles.catch_up_driver import CatchingUp
from hetero_node.client.roles.round_record import InFlight
from hetero_node.client.roles.schedule import RoundPlan
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE

ROUND = 15
SHARD = 1


class GaveTheRoundUp(CatchingUp):
    """A stage 1 that gave round 15 up at its start (its stage 0 had loaded a later state), reading records that
    change `after_s` seconds in: the two full replicas, first still taking round 14's result, then past round 15."""

    def __init__(self, before: dict[str, PeerRecord], after: dict[str, PeerRecord], after_s: float) -> None:
        self.me = peer_id("s1")
        self.timeouts = SyncTimeouts(round_timeout_s=5.0)
        self.membership = SimpleNamespace(record=peer_record("s1", role=ROLE_STAGE, stage=SHARD, train_round=-1))
        self.stop = threading.Event()
        self.certified = ROUND
        self.start = {SHARD: []}
        self.syncs = {SHARD: SimpleNamespace(serve_void=lambda *args: None, certificate=None)}
        self.before, self.after, self.switch = before, after, time.monotonic() + after_s

    def records(self, timeout: float = 5.0) -> dict[str, PeerRecord]:
        return self.before if time.monotonic() < self.switch else self.after

    def announce(self, **fields: Any) -> None:
        pass

    def fingerprints(self) -> dict[str, str]:
        return {str(SHARD): "a" * 32}

    def messages_cheaper(self, behind: int, records: dict[str, PeerRecord]) -> bool:
        return True

    def rebuild_round(self, round_: int, shards: list[int]) -> tuple[dict[int, Any], int]:
        return {shard: f"round {round_} rebuilt" for shard in shards}, 1234


def full(name: str, round_: int, certified: int, train_round: int) -> tuple[str, PeerRecord]:
    return peer_id(name), peer_record(name, role=ROLE_FULL, round=round_, certified=certified, train_round=train_round)


def flight(deadline: float) -> InFlight:
    plan = RoundPlan(ROUND, deadline, 4.0, 0.5, 1, 0, 10, sit_out=False)
    done: concurrent.futures.Future[ShardOutcome] = concurrent.futures.Future()
    done.set_result(ShardOutcome(new_tensors=None))
    return InFlight(plan, None, {}, {SHARD: done}, None)


def test_a_round_given_up_at_its_start_is_not_void_before_its_deadline() -> None:
    """The kill soak's last disagreeing round: the full replicas had taken round 14's result from others (records at
    round 14, train_round −1: not coming to round 15 by their records), so a stage that gave round 15 up at its start
    found nobody in it, voided it in 0.2 s, and the replicas certified it 4 s later."""
    taking_14 = dict([full("r1", 14, 14, -1), full("r2", 14, 14, -1)])
    certified_15 = dict([full("r1", 16, 16, 16), full("r2", 16, 16, 16)])
    waiting = GaveTheRoundUp(taking_14, certified_15, after_s=1.0)
    started = time.monotonic()
    how, size, rebuilt = waiting.obtain(flight(get_dht_time() + 2.0), [SHARD])
    assert (how, size, rebuilt) == ("messages", 1234, {SHARD: "round 15 rebuilt"})
    assert time.monotonic() - started >= 1.0  # it waited for them


def test_a_round_nobody_comes_to_is_void_once_its_deadline_passed() -> None:
    alone = GaveTheRoundUp({}, {}, after_s=0.0)
    started = time.monotonic()
    how, _, rebuilt = alone.obtain(flight(get_dht_time() + 1.0), [SHARD])
    assert how == "void" and rebuilt[SHARD].digests == {}
    assert 0.9 <= time.monotonic() - started < 5.0  # at its deadline, not the round timeout's end
