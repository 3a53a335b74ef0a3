"""A full replica keeps the speed its rounds measured beside its checkpoint; a restart advertises it instead of
probing, but only for the same run on the same devices and machine, and never from a damaged file."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from factories import run_config

from hetero_node.client.config import NodeConfig
from hetero_node.client.roles.measured_speed import SPEED_NAME, MeasuredSpeed, load_speed, save_speed, speed_key

CPU = torch.device("cpu")


def test_a_kept_speed_is_read_back_for_the_same_run_devices_and_machine_only(tmp_path: Path) -> None:
    run, node = run_config(), NodeConfig()
    key = speed_key(run, node, [CPU])
    save_speed(tmp_path, key, MeasuredSpeed(tokens_per_s=1234.5, step_s=0.25))
    assert load_speed(tmp_path, key) == MeasuredSpeed(1234.5, 0.25)
    slower = dataclasses.replace(node, step_delay_s=0.5)
    for other in (speed_key(run, node, [CPU, CPU]), speed_key(run, slower, [CPU]), key.replace(run.run_id, "0" * 16)):
        assert other != key and load_speed(tmp_path, other) is None, f"a speed measured for {key} read for {other}"
    assert load_speed(None, key) is None and load_speed(tmp_path / "nowhere", key) is None
    save_speed(tmp_path, key, MeasuredSpeed(99.0, 0.5))  # each round's figure replaces the last
    assert load_speed(tmp_path, key) == MeasuredSpeed(99.0, 0.5)
    assert [p.name for p in tmp_path.iterdir()] == [SPEED_NAME], "a temporary file was left behind"


@pytest.mark.parametrize(
    "text", ['{"key": "K", "tokens_per_s": "fast", "step_s": 1}', '{"key": "K"}', "not json", '{"key": "K", '
             '"tokens_per_s": NaN, "step_s": 1}', '{"key": "K", "tokens_per_s": 10, "step_s": 0}', "[1, 2]"],
)  # fmt: skip
def test_a_damaged_or_impossible_file_means_a_probe(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / SPEED_NAME).write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_speed(tmp_path, "K") is None
