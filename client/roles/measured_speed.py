"""A full replica's training speed as its own rounds measured it, kept beside its checkpoint.

A restarted node advertises it at once instead of probing again. The probe builds the model and times three steps
on random tokens; in the kill soak's restarts a full replica's measuring took 3.1-4.1 s where a stage peer's, which
skips the probe, took 1.2-1.3 s, out of a restart that must fit in a round or two (about 5 s each there), and the
rounds' figure is the better one anyway: the node's steady speed with the swarm's load around it. The first round
measures the speed again, so a figure that no longer holds lasts one round. The file names the run, the devices and
their hardware it was measured on; any difference means a probe.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hetero_node.client.config import NodeConfig
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)

SPEED_NAME = "speed.json"


@dataclass(frozen=True)
class MeasuredSpeed:
    """What a full replica's record advertises about its speed."""

    tokens_per_s: float
    """The whole node's training tokens/s (all its local ranks)."""
    step_s: float
    """Seconds per inner step of one batch, as the round loop timed it."""


def speed_key(run: RunConfig, node: NodeConfig, devices: list[torch.device]) -> str:
    """What a measured speed holds for: one run (its model and batch) on these devices, these GPUs and cores, and
    the artificial step delay the labs slow a node with."""
    gpus = [torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"]
    machine = [*gpus, f"{os.cpu_count()} cores", f"delay {node.step_delay_s}"]
    return f"{run.run_id}|{','.join(str(d) for d in devices)}|{','.join(machine)}"


def save_speed(directory: Path, key: str, speed: MeasuredSpeed) -> None:
    """Write `speed` for `key` (write, then rename); a disk that refuses costs the next restart a probe, nothing
    more, so it is logged and not raised."""
    path = directory / SPEED_NAME
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, **asdict(speed)}))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not keep this node's measured speed in %s (%s)", path, e.strerror or e)


def load_speed(directory: Path | None, key: str) -> MeasuredSpeed | None:
    """The speed kept for `key`, or None (no file, another run or hardware, or anything malformed: probe then)."""
    if directory is None:
        return None
    try:
        data = json.loads((directory / SPEED_NAME).read_text())
        speed = MeasuredSpeed(float(data["tokens_per_s"]), float(data["step_s"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:  # a corrupt file is not worth failing a join over
        logger.warning("ignoring %s (%r): measuring this node instead", directory / SPEED_NAME, e)
        return None
    if data.get("key") != key:
        return None
    if not all(math.isfinite(v) and v > 0 for v in (speed.tokens_per_s, speed.step_s)):
        return None
    return speed
