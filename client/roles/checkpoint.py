"""Per-round checkpoints: written atomically, refused loudly when corrupt or from another run.

A checkpoint holds what a replica cannot get back from its peers: its error-feedback buffers and inner optimizer
state, plus the weights and round it had, and the run id they belong to. It is written to a temporary file
and renamed, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hetero_node.protocol.errors import CheckpointError

CHECKPOINT_NAME = "replica.ckpt"


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write `state` to `directory/replica.ckpt` via write-then-rename."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: Path, run_id: str) -> dict[str, Any] | None:
    """The checkpoint's state, or None if there is none; `CheckpointError` if it is corrupt or from another run."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises a zoo of types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {e}") from None
    if not isinstance(state, dict) or "run_id" not in state or "round" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hetero-node replica checkpoint")
    if state["run_id"] != run_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to run {state['run_id']}, not to this run ({run_id}); "
            "use another --checkpoint-dir or remove it"
        )
    return state
