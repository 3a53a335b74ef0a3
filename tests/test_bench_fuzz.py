"""The fuzzer, short (the full run is `make bench-fuzz`): no parser a peer's bytes reach may crash."""

from __future__ import annotations

import json
from pathlib import Path

from hetero_node.bench.fuzz import ENTRY_POINTS, run_fuzz
from hetero_node.protocol.records import parse_peer_record, parse_run_announcement


def test_no_entry_point_crashes_on_malformed_input(tmp_path: Path) -> None:
    results = run_fuzz(300 * len(ENTRY_POINTS), seed=1, out=tmp_path)
    assert set(results) == {e.name for e in ENTRY_POINTS}
    for name, r in results.items():
        assert r.crashes == 0, f"{name}: {r.examples}"
        assert r.cases == 300 and r.accepted + r.refused == 300 and r.refused > 0, name
    assert json.loads((tmp_path / "report.json").read_text()).keys() == results.keys()


def test_a_record_whose_keys_are_not_strings_is_refused_not_a_crash() -> None:
    """Found by the fuzzer: msgpack allows integer keys, and pydantic raised TypeError on them."""
    assert parse_peer_record({7: "x"}) is None and parse_run_announcement({b"peer_id": 1}) is None
    assert parse_peer_record(["not", "a", "dict"]) is None
