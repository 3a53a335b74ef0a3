"""The poisoned-state bench, short (the full run is `make bench-poison`): a joiner among lying donors loads the
honest state or nothing, never the liars'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_node.bench.config import POISON_SCENARIOS, PoisonConfig
from hetero_node.bench.poison import SCENARIOS, render_markdown, run_poison
from hetero_node.protocol.errors import ConfigError


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_joiner_among_liars_loads_the_honest_state_or_waits(tmp_path: Path) -> None:
    """A liar claiming the honest fingerprint is asked first (highest peer id) and refused on its blob; a minority
    ahead is never asked, even when record-only ids make it a majority of records; a tie leaves the joiner
    waiting."""
    cfg = PoisonConfig(
        trials=1, scenarios="claims-honest-fp,minority-ahead,tie,record-only-ahead", wait_s=3.0, out=tmp_path
    )
    report = run_poison(cfg)
    trials = {name: s["trials"][0] for name, s in report["scenarios"].items()}
    assert {name: t["outcome"] for name, t in trials.items()} == {
        "claims-honest-fp": "honest", "minority-ahead": "honest", "tie": "none", "record-only-ahead": "honest",
    }  # fmt: skip
    assert trials["claims-honest-fp"]["liar_asked"] and not trials["minority-ahead"]["liar_asked"]
    assert trials["record-only-ahead"]["records_seen"] == 6 and not trials["record-only-ahead"]["liar_asked"]
    assert trials["claims-honest-fp"]["round"] == 5 and trials["tie"]["round"] is None
    assert json.loads((tmp_path / "report.json").read_text())["scenarios"].keys() == trials.keys()
    assert "| tie: " in (tmp_path / "report.md").read_text()


def test_the_table_counts_each_outcome_and_names_trials_that_saw_too_few_records() -> None:
    def trial(outcome: str, load_s: float, liar_asked: bool = False, seen: int = 3) -> dict:
        return {"outcome": outcome, "round": None, "load_s": load_s, "liar_asked": liar_asked, "records_seen": seen}

    scenario = {"description": "one liar", "honest": 2, "liars": 1, "expected": "honest"}
    trials = [trial("honest", 0.5), trial("liar", 1.5, liar_asked=True), trial("none", 10.0, seen=2)]
    report = {"trials": 3, "wait_s": 10.0, "wall_s": 42.0, "scenarios": {"one-ahead": {**scenario, "trials": trials}}}
    text = render_markdown(report)
    assert "3 trial(s) per scenario" in text and "42 s in all" in text
    assert "| one-ahead: one liar | 2 : 1 | honest | 1 | 1 | 1 | 1 | 1.5 / 10.0 |" in text
    assert "saw fewer records than donors before loading: one-ahead (saw 2)." in text


def test_every_scenario_the_option_names_is_defined() -> None:
    assert tuple(SCENARIOS) == POISON_SCENARIOS
    with pytest.raises(ConfigError, match="--scenarios"):
        PoisonConfig(scenarios="one-ahead,nonsense")
    with pytest.raises(ConfigError, match="--trials"):
        PoisonConfig(trials=0)
