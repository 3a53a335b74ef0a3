"""The round-modes comparison's arithmetic on synthetic demo reports (no processes)."""

from __future__ import annotations

import pytest
from command_lines import parse_argv

from hetero_node.bench.config import RoundModesConfig
from hetero_node.bench.round_modes import curve, demo_argv, loss_at, mode_fields
from hetero_node.protocol.errors import ConfigError


def report(per_round: list[tuple[int, float | None]], peers: int = 2) -> dict:
    rounds = [{"round": t, "tokens": tokens, "eval_loss": loss} for t, (tokens, loss) in enumerate(per_round)]
    return {"peers": [{"rounds": rounds} for _ in range(peers)]}


def test_curve_sums_the_swarms_tokens_and_interpolation_compares_at_equal_tokens() -> None:
    points = curve(report([(100, 5.0), (50, None), (100, 3.0)]))  # round 1 had no evaluation
    assert points == [(200, 5.0), (500, 3.0)]
    assert loss_at(points, 350) == pytest.approx(4.0)
    assert loss_at(points, 600) == 3.0 and loss_at(points, 100) == 5.0


def test_modes_run_the_demo_with_their_round_options(tmp_path) -> None:
    assert mode_fields("synchronous", 30) == {"min_inner_steps": 30, "max_inner_steps": 30}
    assert mode_fields("overlap", 30) == {"overlap": True} and mode_fields("time-boxed", 30) == {}
    command, options, _ = parse_argv(demo_argv(RoundModesConfig(seeds=1), "overlap", 2, tmp_path / "r.json"))
    assert command == "demo" and (options["seed"], options["overlap"], options["virtual"]) == (2, True, 0)
    options = parse_argv(demo_argv(RoundModesConfig(inner_steps=12), "synchronous", 0, tmp_path / "r.json"))[1]
    assert (options["min_inner_steps"], options["max_inner_steps"], options["report"]) == (12, 12, tmp_path / "r.json")
    with pytest.raises(ConfigError, match="--modes"):
        RoundModesConfig(modes="synchronous,asynchronous")
