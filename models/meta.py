"""Modules built on the meta device to read their names, shapes and sizes, without running their initialisers.

torch's layers initialise themselves as they are built (`nn.Linear` draws a uniform, `nn.Embedding` a normal), and
on the meta device those draws are torch._refs functions whose first use imports torch's compiler: 1.0-1.5 s on an
idle 2-core machine, 3-13 s in the kill soak's restarts, every time a node starts and sizes its run (`RunShape`),
for tensors that hold no values anyway. (`rope_tables` computes on the CPU for the same reason.) Our own
`Transformer.reset_parameters` already skips meta parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

RANDOM_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                          "xavier_uniform_", "xavier_normal_", "orthogonal_"})  # fmt: skip
"""In-place initialisers (torch.nn.init's and Tensor's) that are no-ops on a tensor without values."""


class _NoRandomFills(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in RANDOM_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules inside on the meta device, their random initialisers skipped (see the module docstring)."""
    with torch.device("meta"), _NoRandomFills():
        yield
