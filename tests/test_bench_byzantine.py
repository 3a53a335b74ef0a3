"""The Byzantine lab, short: both rules against the head-row attack (the full run is `make bench-byzantine`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.progress import Progress

from hetero_node.bench.byzantine import render_markdown, run_byzantine, worst_round
from hetero_node.bench.config import ByzantineConfig
from hetero_node.protocol.errors import ConfigError


# long: a lab run (35 s); `make test` checks the rule's arithmetic against attacks (test_aggregation.py)
@pytest.mark.long
@pytest.mark.usefixtures("bundled_cache_dir")
def test_the_robust_rule_blunts_an_attack_the_mean_rule_lets_through(tmp_path: Path) -> None:
    cfg = ByzantineConfig(
        attacks="concentrate", honest="3", rounds=2, inner_steps=10, warm_steps=50, out=tmp_path
    )  # fmt: skip
    with Progress(disable=True) as progress:
        report = run_byzantine(cfg, progress)
    final = {(c["rule"], c["attack"]): c["finals"][0] for c in report["cells"]}
    assert set(final) == {("mean", "none"), ("mean", "concentrate"), ("robust", "none"), ("robust", "concentrate")}
    assert final[("mean", "concentrate")] > 1.2 * final[("mean", "none")]  # the attack works on the mean rule
    assert final[("robust", "concentrate")] < 1.05 * final[("robust", "none")]
    assert json.loads((tmp_path / "report.json").read_text())["cells"] == report["cells"]
    assert "| 3 honest + 1 | concentrate |" in render_markdown(report)


@pytest.mark.usefixtures("bundled_cache_dir")
def test_loss_scored_admission_leaves_a_negating_member_out(tmp_path: Path) -> None:
    """`+loss` (Gauntlet-style, lab only): the member whose step alone raises the probe batch's loss is not counted,
    so the honest pair's round is what it is without it."""
    cfg = ByzantineConfig(attacks="negate", honest="2", rules="mean,mean+loss", rounds=1, inner_steps=4,
                          warm_steps=20, out=tmp_path)  # fmt: skip
    with Progress(disable=True) as progress:
        report = run_byzantine(cfg, progress)
    final = {(c["rule"], c["attack"]): c["finals"][0] for c in report["cells"]}
    assert final[("mean+loss", "negate")] == pytest.approx(final[("mean+loss", "none")], rel=1e-3)
    assert final[("mean", "negate")] > final[("mean", "none")] + 1e-3  # without admission, it moves the round


def test_the_worst_round_is_the_largest_excess_over_the_clean_run_in_any_round() -> None:
    clean = {"curves": [[3.0, 2.0, 1.8, 1.6], [3.0, 2.1, 1.9, 1.7]]}
    attacked = {"curves": [[3.0, 2.02, 1.8, 1.6], [3.0, 2.1, 1.938, 1.6]]}
    assert worst_round(attacked, clean) == pytest.approx(0.02)  # seed 1's second round: 1.938 over 1.9
    assert worst_round({"curves": [[3.0, 1.0, 1.0, 1.0]] * 2}, clean) == 0.0  # helping moves nothing the wrong way


@pytest.mark.parametrize("change", [{"attacks": "bogus"}, {"rules": "median"}, {"honest": "4,x"}, {"honest": "0"}])
def test_bad_lab_options_are_refused(change: dict) -> None:
    with pytest.raises(ConfigError):
        ByzantineConfig(**change)
