"""Which devices a node trains its replica on: `--device` alone, or `--devices` (`all`, or a list)."""

from __future__ import annotations

import torch

from hetero_node.models.trainer import resolve_device
from hetero_node.protocol.errors import ConfigError


def resolve_devices(device: str, devices: str) -> list[torch.device]:
    """`devices` empty: `--device` alone. `all`: every CUDA GPU of this machine. Otherwise a comma-separated list
    (`cuda:0,cuda:1`; `cpu,cpu` runs two CPU ranks, which tests use). Rank i trains on the i-th."""
    if not devices.strip():
        return [resolve_device(device)]
    if devices.strip() == "all":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError("--devices all: this machine has no CUDA device (try --device cpu)")
        return [torch.device("cuda", i) for i in range(count)]
    names = [name.strip() for name in devices.split(",")]
    if any(not name or name == "auto" for name in names):
        raise ConfigError(f"--devices {devices!r}: name each device (cuda:0,cuda:1), or say all")
    resolved = [resolve_device(name) for name in names]
    resolved = [torch.device("cuda", torch.cuda.current_device()) if d == torch.device("cuda") else d for d in resolved]
    if len({d.type for d in resolved}) > 1:
        raise ConfigError(f"--devices {devices!r}: a node's ranks are all CUDA devices or all CPU")
    cuda = [d for d in resolved if d.type == "cuda"]
    if len(set(cuda)) < len(cuda):
        raise ConfigError(f"--devices {devices!r}: a GPU can hold one rank (NCCL refuses two ranks on one device)")
    count = torch.cuda.device_count()
    for d in cuda:
        if d.index is not None and d.index >= count:
            raise ConfigError(f"--devices {devices!r}: {d} does not exist (this machine has {count} GPUs)")
    return resolved
