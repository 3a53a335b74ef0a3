"""The outer methods a run may name (`--outer`), and what the rest of the code may ask about one without building it.

Each method registers an `OuterSpec` here; its arithmetic is a class in `outer_methods.py` bound to the spec with
`@implements`. Callers ask a spec's properties instead of comparing method names: the run config whether the
robust rule applies (`sparse`), the flat exchange whether a left-out message can wait (`error_feedback`), the cost
model how large a message is, how much of a tensor it carries and whether it is relayed. Adding a method is a spec
here and a class there; no caller changes.

No torch at import: the run config validates `--outer` with this registry, and `hetero-node --help` loads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetero_node.protocol.errors import ConfigError

if TYPE_CHECKING:
    from hetero_node.protocol.run_config import RunConfig

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OuterSpec:
    """What an outer method is, as the protocol and the planners see it."""

    name: str
    """The `--outer` value (part of the run id: peers of one run agree on it)."""
    sparse: bool
    """A message carries a chosen subset of each tensor's coordinates: the robust rule bounds those per coordinate."""
    error_feedback: bool
    """What a message did not send waits in the sender's private state: a round may aggregate a subset of the
    contributors (`--max-contributors`) and leave the others' Δ owed."""
    relayed: bool
    """Messages are compressed far below the shard's state: members relay them down trees and re-serve them for
    catch-up (what the cost model assumes; `ShardSync` decides per shard from the sizes)."""
    message_bytes: Callable[[RunConfig, Sequence[Shape]], int]
    """The exact (sparse) or largest size of one message for a shard of these shapes: what a fetch may accept."""
    selected_fraction: Callable[[RunConfig, Shape], float]
    """The fraction of a tensor's entries one message carries."""


_SPECS: dict[str, OuterSpec] = {}


def register(spec: OuterSpec) -> OuterSpec:
    """Make `spec` a method runs may name; a name registered twice is a programming error."""
    if spec.name in _SPECS:
        raise ValueError(f"outer method {spec.name!r} is registered twice")
    _SPECS[spec.name] = spec
    return spec


def outer_names() -> tuple[str, ...]:
    """The `--outer` values, in registration order."""
    return tuple(_SPECS)


def outer_spec(name: str) -> OuterSpec:
    """The registered method `name`; `ConfigError` for a name no method registered."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ConfigError(f"--outer must be one of {', '.join(_SPECS)}, got {name!r}") from None


def _sparse_message_bytes(run: RunConfig, shapes: Sequence[Shape]) -> int:
    from hetero_node.protocol import sparse_codec

    return sparse_codec.message_size_bytes(shapes, run.sparseloco)


def _sparse_selected_fraction(run: RunConfig, shape: Shape) -> float:
    from hetero_node.protocol.sparseloco import chunk_plan

    return chunk_plan(shape, run.sparseloco.chunk, run.sparseloco.topk).num_selected / math.prod(shape)


def _dense_message_bytes(run: RunConfig, shapes: Sequence[Shape]) -> int:
    from hetero_node.protocol import dense_codec

    return dense_codec.message_size_bytes(shapes, run.outer.diloco_wire)


SPARSELOCO = register(
    OuterSpec(
        "sparseloco",
        sparse=True,
        error_feedback=True,
        relayed=True,
        message_bytes=_sparse_message_bytes,
        selected_fraction=_sparse_selected_fraction,
    )
)
"""Error feedback + chunked top-k + 2-bit values (`outer_methods.SparseLoCoMethod`)."""
DILOCO = register(
    OuterSpec(
        "diloco",
        sparse=False,
        error_feedback=False,
        relayed=False,
        message_bytes=_dense_message_bytes,
        selected_fraction=lambda run, shape: 1.0,
    )
)
"""The dense baseline: fp32/fp16 pseudo-gradients, outer Nesterov SGD (`outer_methods.DiLoCoMethod`)."""
