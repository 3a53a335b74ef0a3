"""Per-round checkpoints: written atomically, checksummed, refused loudly when corrupt or from another run.

A checkpoint holds what a replica cannot get back from its peers: its error-feedback buffers and inner optimizer
state, plus the weights and round it had, and the run id they belong to. It is written to a temporary file,
fsynced and renamed (and the directory fsynced), so a crash mid-write leaves the previous checkpoint intact.

The file is a magic line, the payload (the state in safetensors form, `protocol/tensor_file.py`: nothing in it is
unpickled), then the sha256 of the payload. Why a checksum: a flipped bit in a tensor still parses, and error
feedback or optimizer state that is silently off is never caught by any peer. Non-finite values are refused too. A
checkpoint of an older format (format 2 held a pickle) is refused with a message saying what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetero_node.protocol import tensor_file
from hetero_node.protocol.errors import CheckpointError, PayloadError

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "replica.ckpt"
MAGIC = b"hetero-node checkpoint 3\n"
MAGIC_PREFIX = b"hetero-node checkpoint "
DIGEST_BYTES = 32


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write `state` to `directory/replica.ckpt` via write-then-rename; `CheckpointError` if the disk refuses (the
    previous checkpoint is then intact and no temporary file is left)."""
    path = directory / CHECKPOINT_NAME
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f"{path.stem}.tmp*"):  # left by a process killed mid-write
            stale.unlink(missing_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            payload = tensor_file.dumps(state)  # one serialized copy in memory, as a state blob is
            f.write(payload)
            f.write(hashlib.sha256(payload).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {e}") from None
    return path


def cpu_snapshot(tree: Any, copy_device_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """`tree` with every tensor copied to the CPU: what a background writer may serialise while training goes on
    writing into the live tensors. `copy_device_tensor` copies the tensors that live on a CUDA device instead."""
    if isinstance(tree, torch.Tensor):
        if copy_device_tensor is not None and tree.device.type == "cuda":
            return copy_device_tensor(tree)
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu_snapshot(v, copy_device_tensor) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [cpu_snapshot(v, copy_device_tensor) for v in tree]
    return tree


def _has_cuda_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cuda"
    if isinstance(tree, dict):
        return any(_has_cuda_tensor(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return any(_has_cuda_tensor(v) for v in tree)
    return False


class PinnedStaging:
    """Page-locked host buffers, reused every round, for a snapshot of the tensors on a CUDA device. Copying a GPU
    replica's state (3.5 GB for 178m: weights, AdamW moments, θ(t), error feedback) into pageable memory blocks the
    training thread for the whole transfer, 1.7-2 s a round on an H200; into pinned buffers the copies are only
    queued on the device's stream, behind the work that wrote the values and ahead of the next step's writes."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._used = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def snapshot(self, tree: Any) -> tuple[Any, list[torch.cuda.Event]]:
        """`tree` copied into the buffers, and one event per device that completes once its copies are done."""
        self._used, self._streams = 0, {}
        snapshot = cpu_snapshot(tree, self._copy)
        del self._buffers[self._used :]  # a smaller state than last round's: keep no stale buffers
        events = []
        for stream in self._streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return snapshot, events

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self._used = self._used, self._used + 1
        if index < len(self._buffers) and (
            self._buffers[index].shape == tensor.shape and self._buffers[index].dtype == tensor.dtype
        ):
            buffer = self._buffers[index]
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[index : index + 1] = [buffer]
        buffer.copy_(tensor.detach(), non_blocking=True)
        self._streams.setdefault(tensor.device, torch.cuda.current_stream(tensor.device))
        return buffer


class CheckpointWriter:
    """Writes a replica's checkpoints in a background thread: serialising, hashing and fsyncing the model and its
    optimizer state (gigabytes for a 178M model) would otherwise stop training every round. `save` takes a CPU
    snapshot at once (of CUDA tensors: copies queued into `PinnedStaging`, unless the writer is still writing the
    previous round from it; then a blocking copy); a newer snapshot replaces one not yet written (only the latest
    matters); `close` writes the last one before the node exits. A write interrupted by a kill leaves the previous
    checkpoint intact (`save_checkpoint` writes then renames)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pending: tuple[dict[str, Any], list[torch.cuda.Event], bool] | None = None
        """(snapshot, the events its copies complete at, whether it lives in the staging buffers)"""
        self._writing = self._writing_staged = self._closed = False
        self._staging: PinnedStaging | None = PinnedStaging()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint", daemon=True)
        self._thread.start()

    def save(self, state: dict[str, Any]) -> None:
        with self._changed:  # the writer must not pick up the staging buffers while they are being refilled
            staged = self._staging is not None and not self._writing_staged and _has_cuda_tensor(state)
            if staged:
                try:
                    snapshot, events = self._staging.snapshot(state)
                except RuntimeError as e:  # no page-locked memory to be had: blocking copies, as on a CPU
                    logger.warning("checkpoints copy the state without pinned buffers (%s): slower rounds", e)
                    self._staging, staged = None, False
        if not staged:
            snapshot, events = cpu_snapshot(state), []
        with self._changed:
            self._pending = (snapshot, events, staged)
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until every snapshot handed to `save` is on disk (or refused by it, logged)."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending is None and not self._writing)

    def close(self) -> None:
        self.flush()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (state, events, staged), self._pending = self._pending, None
                self._writing, self._writing_staged = True, staged
            try:
                for event in events:
                    event.synchronize()
                save_checkpoint(self.directory, state)
            except CheckpointError as e:  # a full disk must not end training; the previous checkpoint stays
                logger.error("%s; training goes on without this round's checkpoint", e)
            finally:
                with self._changed:
                    self._writing = self._writing_staged = False
                    self._changed.notify_all()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state in a checkpoint file, checked against its checksum; `CheckpointError` if it is not one of ours,
    damaged, or holds non-finite values."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from None
    if not data.startswith(MAGIC):
        if data.startswith(MAGIC_PREFIX):
            version = data[len(MAGIC_PREFIX) :].split(b"\n")[0].decode(errors="replace")
            raise CheckpointError(
                f"checkpoint {path} is of another hetero-node version (format {version}, this one reads 3); "
                "move it away: the node then loads the swarm's current state"
            )
        raise CheckpointError(f"checkpoint {path} is not a hetero-node replica checkpoint")
    payload, digest = memoryview(data)[len(MAGIC) : -DIGEST_BYTES], data[-DIGEST_BYTES:]
    if len(data) < len(MAGIC) + DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: its checksum does not match (damaged or truncated)")
    try:
        state = tensor_file.loads(bytes(payload))
    except PayloadError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {e}") from None
    if not isinstance(state, dict) or "run_id" not in state or "round" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hetero-node replica checkpoint")
    if not _all_finite(state):
        raise CheckpointError(f"checkpoint {path} holds non-finite values")
    return state


def load_checkpoint(directory: Path, run_id: str) -> dict[str, Any] | None:
    """The checkpoint's state, or None if there is none; `CheckpointError` if it is corrupt or from another run."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    state = read_checkpoint(path)
    if state["run_id"] != run_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to run {state['run_id']}, not to this run ({run_id}); "
            "use another --checkpoint-dir or remove it"
        )
    return state


def _all_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(value.isfinite().all())
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_all_finite(v) for v in value)
    return True
