"""The round-modes comparison's arithmetic on synthetic demo reports (no processes)."""

from __future__ import annotations

import pytest

from hetero_node.bench.config import RoundModesConfig
from hetero_node.bench.round_modes import curve, demo_argv, loss_at, mode_args
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
    assert mode_args("synchronous", 30) == ["--min-inner-steps", "30", "--max-inner-steps", "30"]
    assert mode_args("overlap", 30) == ["--overlap"] and mode_args("time-boxed", 30) == []
    argv = demo_argv(RoundModesConfig(seeds=1), "overlap", 2, tmp_path / "r.json")
    assert argv[argv.index("--seed") + 1] == "2" and "--overlap" in argv and argv[argv.index("--virtual") + 1] == "0"
    with pytest.raises(ConfigError, match="--modes"):
        RoundModesConfig(modes="synchronous,asynchronous")
