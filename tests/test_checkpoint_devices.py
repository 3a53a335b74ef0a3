"""A GPU replica's checkpoint: the state is staged into pinned host buffers by copies queued on the device's stream
(the training thread does not wait for 3.5 GB to cross PCIe every round), and what lands on disk is still the state
as it was when `save` was called, whatever training writes into the live tensors afterwards. Needs a GPU: `make
gpu-check` runs this file there; on a CPU-only machine it skips (the CPU path is `tests/test_node_units.py`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hetero_node.client.roles import checkpoint
from hetero_node.client.roles.checkpoint import CheckpointWriter, load_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: `make gpu-check` runs this test on a GPU"
)


def test_a_gpu_state_is_written_as_it_was_when_saved_staged_unless_the_staging_is_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[int, bool, int, torch.Tensor]] = []
    """(round, snapshot pinned, its buffer's address, its values when the writer took it)"""
    picked, release = threading.Event(), threading.Event()
    save = checkpoint.save_checkpoint

    def held_save(directory: Path, state: dict[str, Any]) -> Path:
        w = state["model"]["w"]
        written.append((state["round"], w.is_pinned(), w.data_ptr(), w.clone()))
        picked.set()
        assert release.wait(60)
        return save(directory, state)

    monkeypatch.setattr(checkpoint, "save_checkpoint", held_save)
    original = torch.arange(1 << 22, dtype=torch.float32)
    weights = original.to("cuda")
    writer = CheckpointWriter(tmp_path)
    try:
        writer.save({"run_id": "abc", "round": 3, "model": {"w": weights}})
        weights.add_(1.0)  # queued behind the snapshot's copy: the snapshot must not see it
        assert picked.wait(60)  # the writer holds round 3's snapshot, in the staging buffers
        writer.save({"run_id": "abc", "round": 4, "model": {"w": weights}})  # a blocking copy instead
        weights.add_(1.0)
        release.set()
        writer.flush()
        writer.save({"run_id": "abc", "round": 5, "model": {"w": weights}})  # staged again, into the same buffers
        weights.add_(1.0)
        writer.flush()
    finally:
        release.set()
        writer.close()
    assert [(r, pinned) for r, pinned, _, _ in written] == [(3, True), (4, False), (5, True)]
    assert written[0][2] == written[2][2]  # the staging buffer is reused, not allocated again each round
    for (_, _, _, values), expected in zip(written, (original, original + 1, original + 2), strict=True):
        assert torch.equal(values, expected)
    assert torch.equal(load_checkpoint(tmp_path, "abc")["model"]["w"], original + 2)
