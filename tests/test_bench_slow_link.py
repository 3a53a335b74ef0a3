"""`hetero-node-lab slow-link`'s figures from round records (the netlab runs themselves: `make bench-slow-link`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_node.bench.config import SlowLinkConfig
from hetero_node.bench.slow_link import compare, render_markdown, run_summary
from hetero_node.protocol.errors import ConfigError


def write_rounds(logs: Path, node: str, ends: list[float], contributed: list[bool]) -> None:
    lines = [json.dumps({"header": {"role": "full"}})]  # the metrics file's first line is no round
    lines += [json.dumps({"round": t, "ended_at": end, "contributed": c, "comm_s": 1.0, "inner_steps": 10})
              for t, (end, c) in enumerate(zip(ends, contributed, strict=True))]  # fmt: skip
    (logs / f"{node}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_volunteers_share_and_the_others_lengthening_come_from_their_round_records(tmp_path: Path) -> None:
    runs = {}
    for name, period, home_contributes in (("baseline", 20.0, [True] * 5), ("slow link", 20.5, [True] * 4 + [False])):
        logs = tmp_path / name
        logs.mkdir()
        for node in ("dc0", "dc1"):
            write_rounds(logs, node, [100 + period * t for t in range(5)], [True] * 5)
        write_rounds(logs, "home0", [100 + 30.0 * t for t in range(5)], home_contributes)  # its own period: no matter
        runs[name] = run_summary(logs)
    assert runs["slow link"]["dc0"] == {"rounds": 5, "contributed": 5, "period_s": 20.5, "comm_s": 1.0,
                                        "inner_steps": 50}  # fmt: skip
    result = compare(runs)
    assert result["volunteer_contribution_share"] == 0.8
    assert result["others_lengthening"] == pytest.approx(0.025)
    assert all(result["targets"].values())  # 80% and 2.5%: both within the targets
    runs["slow link"]["home0"]["contributed"] = 3
    runs["slow link"]["dc1"]["period_s"] = 23.5  # the others' mean: 22 s, 10% longer
    worse = compare(runs)
    assert worse["others_lengthening"] == pytest.approx(0.1) and not any(worse["targets"].values())
    text = render_markdown({"runs": runs, **worse})
    assert "| slow link | home0 | 5 | 3 |" in text and "+10.0% longer" in text and "missed:" in text


def test_a_volunteer_that_finished_no_round_meets_no_target(tmp_path: Path) -> None:
    logs = tmp_path / "base"
    logs.mkdir()
    write_rounds(logs, "dc0", [1.0, 2.0], [True, True])
    result = compare({"baseline": run_summary(logs), "slow link": run_summary(logs) | {"home0": run_summary(logs)["dc0"]
                      | {"rounds": 0, "contributed": 0}}})  # fmt: skip
    assert result["volunteer_contribution_share"] is None
    assert not result["targets"]["volunteer contributes in ≥ 80% of the rounds it finished"]
    with pytest.raises(ConfigError, match="--round-s"):
        SlowLinkConfig(round_s=-1)
