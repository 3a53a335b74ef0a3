"""Commit, then reveal (`client/outer/reveal.py`): a member's message of a round is fetched only by peers whose own
statement of that round is in the DHT, or by anyone once the round is decided. Two real runtimes on loopback: the
asker's fetches go over libp2p to the server's blob handler."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hivemind.p2p import P2PHandlerError

from hetero_node.client.outer.reveal import RevealGate
from hetero_node.client.outer.roster_round import RosterRound
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.round_wire import PAYLOAD, GroupMeta, digest, message_kind

RUN_ID = "0123456789abcdef"
MESSAGE = b"an honest member's SparseLoCo message"


@pytest.mark.multipeer
def test_a_message_goes_only_to_peers_that_stated_theirs_and_to_anyone_once_the_round_is_decided() -> None:
    server = PeerRuntime([])
    asker = None
    try:
        asker = PeerRuntime(server.visible_maddrs)
        for runtime in (server, asker):
            runtime.join_run(RUN_ID)
        stop, decided = threading.Event(), [-1]

        def roster(runtime: PeerRuntime, round_: int) -> RosterRound:
            return RosterRound(runtime, RUN_ID, 0, round_, 1 << 20, stop)

        gate = RevealGate(lambda t: roster(server, t), lambda: decided[0])
        server.reveal_gates[0] = gate.allows
        for t in (3, 4):
            server.publish(PAYLOAD, 0, t, MESSAGE)
            server.publish(message_kind(digest(MESSAGE)), 0, t, MESSAGE)

        def fetch(kind: str, round_: int) -> bytes:  # one attempt: a refusal comes after the gate's 5 s wait
            return asker.run(asker.fetch_async(server.peer_id, kind, 0, round_, len(MESSAGE)), timeout=30)[1]

        for kind in (PAYLOAD, message_kind(digest(MESSAGE))):  # its own message and a re-served copy alike
            with pytest.raises(P2PHandlerError, match="commit, then reveal"):
                fetch(kind, 3)
        ours = GroupMeta(3, "ab" * 8, 20, digest(b"the asker's message"), 512, "")
        roster(asker, 3).state(ours)
        assert fetch(PAYLOAD, 3) == MESSAGE  # the server read round 3's statements again on being asked
        assert fetch(message_kind(digest(MESSAGE)), 3) == MESSAGE
        with pytest.raises(P2PHandlerError, match="commit, then reveal"):
            fetch(PAYLOAD, 4)  # a statement of round 3 opens round 3 only
        decided[0] = 4
        assert fetch(PAYLOAD, 4) == MESSAGE  # a decided round is open to catch-up
    finally:
        for runtime in (asker, server):
            if runtime is not None:
                runtime.shutdown()


def test_a_known_statement_or_a_decided_round_is_answered_without_reading_the_dht() -> None:
    """The common case costs the serving peer nothing: the round's own wait for its statements told the gate."""
    gate = RevealGate(lambda t: pytest.fail("the gate read the DHT"), lambda: 2)
    gate.note_statements(7, {"stated"})
    assert asyncio.run(gate.allows("stated", 7))
    assert asyncio.run(gate.allows("catching up", 2))
