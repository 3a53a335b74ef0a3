"""The swarm fuzzer, short, against one serving peer (the full run against a training swarm is
`make bench-fuzz-swarm`): every input gets an outcome and the peer serves honest requests afterwards."""

from __future__ import annotations

import random

import pytest

from hetero_node.bench.fuzz_swarm import Campaign, render_markdown, stream_entries
from hetero_node.bench.poison import RUN_ID, swarm

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(240)]


def test_a_peer_survives_malformed_streams_and_records_and_serves_an_honest_fetch_after() -> None:
    with swarm(2) as (server, fuzzer):
        server.publish("state", 0, 1, b"honest state")
        targets = {"all": [server.peer_id], "stages": [server.peer_id], "bootstrap": [server.peer_id]}
        campaign = Campaign(fuzzer, RUN_ID, targets, random.Random(3))
        sent: list[int] = []
        fuzzer.run(campaign.streams(50 * len(stream_entries(RUN_ID)), 1, sent.append), timeout=180)
        campaign.dht(40, sent.append)
        assert sum(sent) == 50 * len(stream_entries(RUN_ID)) + 40
        for name, tally in campaign.tallies.items():
            assert tally.inputs == tally.answered + tally.refused + tally.held_open, name
        assert campaign.tallies["blob stream (state, payload)"].refused > 0
        assert campaign.tallies["DHT peer records"].inputs == 20
        assert fuzzer.fetch(server.peer_id, "state", 0, 1, 1 << 10, 10) == (1, b"honest state")
        view = fuzzer.read_records() or {}
        assert set(view) <= {str(fuzzer.peer_id)}, "a record claiming another peer's id got into the view"


def test_the_report_renders_every_entry_and_peer() -> None:
    tally = {"inputs": 10, "answered": 1, "refused": 8, "held_open": 1, "seconds": 0.5}
    report = {
        "entries": {"blob stream (state, payload)": tally}, "fuzz_seconds": 1.0, "rounds_fuzzed": 3,
        "rounds_disagreeing": 0, "contributed": {"r0": {"calm": "3/3", "fuzzed": "3/3"}},
        "alive_at_end": {"r0": True, "bootstrap": True}, "exits": {"r0": 0, "bootstrap": 0},
        "peak_rss_mb": {"calm": {"r0": 100.0, "bootstrap": 50.0}, "fuzzed": {"r0": 101.0, "bootstrap": 50.0}},
        "records_no_peer_wrote": [], "joiner_adopts_the_bootstraps_run": True,
    }  # fmt: skip
    text = render_markdown(report)
    assert "| blob stream (state, payload) | 10 | 1 | 8 | 1 |" in text
    assert "| r0 | True | 0 | 3/3 | 3/3 | 100.0 → 101.0 |" in text and "| bootstrap | True | 0 | – | – |" in text
