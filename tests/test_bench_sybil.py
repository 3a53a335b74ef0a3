"""`hetero-node-lab sybil` on one flood: the rules before counting work lose the honest view to ids ground low;
an established node, a joiner that challenged all its peers, and one introduced by its bootstrap keep it; one that
challenged 64 a read for 30 reads keeps the slot and the round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_node.bench.config import SybilConfig
from hetero_node.bench.sybil import HONEST_ROUND, JOINER_READS, ground_id, honest_records, run_sybil
from hetero_node.protocol.errors import ConfigError


def test_a_flood_of_ground_ids_eclipsed_the_records_rule_and_changes_nothing_a_working_node_decides(
    tmp_path: Path,
) -> None:
    report = run_sybil(SybilConfig(floods="4097", out=tmp_path))
    readers = report["floods"]["4097"]
    before, reading = readers["records (before)"], readers[f"joiner, {JOINER_READS} reads"]
    assert before["honest_kept"] == 0 and before["swarm_round"] == HONEST_ROUND + 1 and not before["vouched_honest"]
    for name in ("established", "joiner", f"introduced, {JOINER_READS} reads"):
        after = readers[name]
        assert after["swarm_round"] == after["certified_round"] == HONEST_ROUND
        assert after["vouched_honest"] and after["vouched_ahead"] is None
        assert after["honest_kept"] == 5 and after["slot_kept"]  # the joiners: contested claimants asked first
    # on its own, a joiner's 30 × 64 challenges find each full replica with odds of about a half (its salt's draw),
    # but the contested slot's incumbent always: it votes round 7, and no Sybil is ever vouched for
    assert reading["honest_kept"] == 5 and reading["slot_kept"] and reading["swarm_round"] == HONEST_ROUND
    assert reading["vouched_ahead"] is None
    assert not before["slot_kept"]
    assert json.loads((tmp_path / "report.json").read_text())["floods"].keys() == {"4097"}
    assert "| 4,097 | established | 5 / 5 | yes |" in (tmp_path / "report.md").read_text()


def test_ground_ids_sort_below_every_honest_one_and_floods_must_be_positive() -> None:
    assert len({ground_id(i) for i in range(5000)}) == 5000
    assert ground_id(4999) < min(honest_records())
    with pytest.raises(ConfigError, match="--floods"):
        SybilConfig(floods="0")
    with pytest.raises(ConfigError, match="--floods"):
        SybilConfig(floods="many")
