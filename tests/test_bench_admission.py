"""`make bench-admission`'s smoke version: a real swarm under the mean rule with `--admission loss`, two honest full
replicas and a negating one; its judges leave the negating replica out of every round it was in."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_node.bench.admission import render_markdown, run_cell
from hetero_node.bench.config import AdmissionConfig
from hetero_node.protocol.errors import ConfigError


def test_cells_are_attack_rule_pairs() -> None:
    assert AdmissionConfig(cells="negate:robust+loss, none:mean").cell_list == ("negate:robust+loss", "none:mean")
    for bad in ("negate", "flip:mean", "negate:median", ""):
        with pytest.raises(ConfigError, match="--cells"):
            AdmissionConfig(cells=bad)


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_the_judges_leave_a_negating_replica_out_of_every_round_and_training_goes_on(tmp_path: Path) -> None:
    cfg = AdmissionConfig(cells="negate:mean+loss", rounds=3, inner_steps=8, out=tmp_path)
    cell = run_cell(cfg, "negate", "mean+loss", tmp_path / "swarm")
    assert cell["agree"], "the honest replicas disagree after a round"
    assert cell["attacked_rounds"] > 0, "the negating replica never made it into a group"
    assert cell["attacker_counted"] == 0 and cell["attacker_refused"] == cell["attacked_rounds"]
    assert cell["judge_s"] > 0  # scoring and agreeing the verdicts, timed apart from the fetch
    curve = cell["curves"][0]
    assert curve[-1] < curve[0] < 5.6  # ln(256) ≈ 5.55 at θ(0)
    table = render_markdown({"config": {"rounds": 3, "inner_steps": 8, "honest": 2}, "cells": [cell]})
    assert f"| negate | mean+loss | {curve[-1]:.3f} |" in table
