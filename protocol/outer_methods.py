"""Outer methods as strategies: how a replica turns its pseudo-gradient into a message, and how every member of a
shard's group turns the same messages into the same θ(t+1).

One interface; each method is a class bound with `@implements` to the spec it registered in `outer_specs.py`
(what callers ask about a method without building it), and `outer_method` builds the one a run names.
`--aggregation` picks how `combine` bounds each message (see `aggregation`):

* `encode(deltas)` → the wire message of Δ = θ(t) − θ_local, and a snapshot of the private state it changed
  (SparseLoCo's error feedback), which `restore` puts back when the round fails for this replica, and `defer`
  when the round left a valid message out (`--max-contributors`, SparseLoCo only: it keeps Δ owed);
* `decode(payload)` → a message, strictly checked (`PayloadError` on anything malformed);
* `combine(messages, weights, names)` → the aggregate of the messages, weighted by the tokens each replica
  trained, summed in canonical (peer-id) order whatever order they arrive in; malformed ones are dropped;
* `update(start, aggregate)` → θ(t+1) from θ(t). DiLoCo's outer momentum is shared state: every member updates
  it identically, so it travels with the shard's state to late joiners (`shared_state`); SparseLoCo has none.

Everything here is arithmetic every member must reproduce bit for bit, so it lives in `protocol/`; the transport
(groups, streams, verification) is `client/outer/`.

Where tensors live: a method works on its replica's `device` (the model's). Messages are bytes; decoding yields
CPU tensors; the aggregate, the outer state (error feedback, DiLoCo momentum) and θ(t+1) are on `device`, and
θ(t+1) keeps θ(t)'s device and dtype (computed in at least fp32). Members on a GPU and on a CPU still get the
same bits: every step of `combine` and `update` is one correctly rounded elementwise fp32 operation at a time, in
a fixed order (no reductions over coordinates, no fused multiply-add), and what is reduced (clip norms, weights)
is reduced on the host in float64. Checkpoints and shared state leave as CPU copies.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from hetero_node.protocol import dense_codec, sparse_codec
from hetero_node.protocol.aggregation import MEAN_WEIGHT_CAP, aggregate, capped_relative, lower_median
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.outer_specs import DILOCO, SPARSELOCO, OuterSpec, outer_spec
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.sparseloco import ErrorFeedbackCompressor

Shapes = Sequence[tuple[int, ...]]


@dataclass(frozen=True)
class Encoded:
    """A replica's message for one round, and how to undo what encoding it changed."""

    payload: bytes
    snapshot: Any
    """Private state before `encode` (SparseLoCo: error-feedback buffers); `restore` takes it."""


@dataclass(frozen=True)
class Combined:
    """The aggregate of one shard's messages and who took part."""

    tensors: list[Tensor]
    used: list[int]
    """Positions (in the input order) of the messages that were aggregated."""
    dropped: list[tuple[int, str]] = field(default_factory=list)


class OuterMethod(ABC):
    """One shard's outer optimizer (see the module docstring)."""

    spec: ClassVar[OuterSpec]
    """What the method is (set by `@implements`)."""

    def __init__(self, shapes: Shapes, run: RunConfig, device: torch.device | str = "cpu") -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.device = torch.device(device)
        self.max_message_bytes = self.spec.message_bytes(run, self.shapes)
        """The exact (sparse) or largest size of one message: what a fetch may accept."""

    @abstractmethod
    def encode(self, deltas: Sequence[Tensor]) -> Encoded:
        """This round's message; `PayloadError` (state untouched) when Δ is not finite."""

    @abstractmethod
    def restore(self, snapshot: Any) -> None:
        """Undo `encode`: the round failed for this replica, its contribution is dropped."""

    def defer(self, snapshot: Any, payload: bytes) -> None:
        """The round aggregated others but not this message (not selected): by default, as if it failed (a method
        without private state to keep Δ in is never left out: `flat_exchange.contributor_limit`)."""
        self.restore(snapshot)

    def count_deferred(self, payload: bytes, snapshot: Any) -> None:
        """A message `defer` kept owed was aggregated after all (a later round healed to a set that holds it): take
        it out of the private state again, and out of `snapshot` (the state before the message encoded since; None
        if none), so Δ counts once. By default nothing: a method without private state never defers."""
        return None

    @abstractmethod
    def decode(self, payload: bytes) -> Any:
        """A peer's message, strictly checked; `PayloadError` if malformed."""

    def combine(self, messages: Sequence[Any], weights: Sequence[float], names: Sequence[str]) -> Combined:
        """The weighted aggregate of `messages`, whatever order they come in: they are summed sorted by `names`
        (peer ids, unique), so every member gets the same bits. `used`/`dropped` index the given order."""
        if not (len(messages) == len(weights) == len(names)) or len(set(names)) != len(names):
            raise ValueError("combine needs one weight and one distinct name per message")
        order = sorted(range(len(names)), key=lambda i: names[i])
        result = self._combine_sorted([messages[i] for i in order], [weights[i] for i in order], sorted(names))
        return Combined(
            result.tensors, [order[i] for i in result.used], [(order[i], reason) for i, reason in result.dropped]
        )

    @abstractmethod
    def _combine_sorted(self, messages: Sequence[Any], weights: Sequence[float], names: Sequence[str]) -> Combined:
        """`combine` on messages already in canonical order."""

    @abstractmethod
    def update(self, start: Sequence[Tensor], combined: Combined) -> list[Tensor]:
        """θ(t+1) of the shard from θ(t) = `start`; advances shared outer state (DiLoCo momentum) once."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything to checkpoint: private and shared state."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`."""

    @abstractmethod
    def shared_state(self) -> list[Tensor] | None:
        """Outer state every member holds identically (it travels with the shard's state blob); None if none."""

    @abstractmethod
    def load_shared_state(self, tensors: Sequence[Tensor]) -> None:
        """Adopt a donor's shared state; `PayloadError` if it has the wrong shapes or is not finite."""

    @abstractmethod
    def private_tensors(self) -> list[Tensor]:
        """The replica's own outer state (what a resumed checkpoint must bring back); for logs and tests."""


M = TypeVar("M", bound=type[OuterMethod])
_IMPLEMENTATIONS: dict[str, type[OuterMethod]] = {}


def implements(spec: OuterSpec) -> Callable[[M], M]:
    """Bind a method class to its registered spec: `outer_method` builds it for runs that name the spec."""

    def bind(cls: M) -> M:
        if spec.name in _IMPLEMENTATIONS:
            raise ValueError(f"outer method {spec.name!r} is implemented twice")
        cls.spec = spec
        _IMPLEMENTATIONS[spec.name] = cls
        return cls

    return bind


@implements(SPARSELOCO)
class SparseLoCoMethod(OuterMethod):
    """Error feedback + chunked top-k + 2-bit values; token-weighted mean over selectors; θ(t+1) = θ(t) − α·agg."""

    def __init__(self, shapes: Shapes, run: RunConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(shapes, run, device)
        self.config, self.alpha = run.sparseloco, run.outer.outer_lr
        self.robust = run.outer.aggregation == "robust"
        self.compressor = ErrorFeedbackCompressor(self.shapes, self.config, self.device)

    def encode(self, deltas: Sequence[Tensor]) -> Encoded:
        """The message, and as the snapshot the buffers before it: `compress` replaces them, so the old tensors
        are the snapshot as they are (with a copy to the CPU, encoding a 178m shard took 0.30-0.32 s on an H200;
        without, 0.12-0.13 s)."""
        snapshot = {"buffers": self.compressor.buffers}
        payload = sparse_codec.encode(self.compressor.compress(deltas))  # a failed compress leaves the buffers
        return Encoded(payload, snapshot)

    def restore(self, snapshot: Any) -> None:
        self.compressor.load_state_dict(snapshot)

    def defer(self, snapshot: Any, payload: bytes) -> None:
        """Put what the message sent back into the error feedback: Δ waits in it for a later round."""
        self.compressor.return_sent(self.decode(payload))

    def count_deferred(self, payload: bytes, snapshot: Any) -> None:
        """`defer` added the message's values back; one message has been encoded since, which decayed them by β
        (rounds settle before the next one encodes), while the snapshot taken before that encode holds them whole."""
        message = self.decode(payload)
        self.compressor.add_sent(self.compressor.buffers, message, -self.config.ef_decay)
        if snapshot is not None:
            self.compressor.add_sent(snapshot["buffers"], message, -1.0)

    def decode(self, payload: bytes) -> Any:
        return sparse_codec.decode(payload, self.shapes, self.config)

    def _combine_sorted(self, messages: Sequence[Any], weights: Sequence[float], names: Sequence[str]) -> Combined:
        result = aggregate(messages, self.shapes, weights, names, robust=self.robust, device=self.device)
        return Combined(result.tensors, result.used, result.dropped)

    def update(self, start: Sequence[Tensor], combined: Combined) -> list[Tensor]:
        """Plain SGD: the error feedback already plays the role of momentum."""
        return [_minus(s, self.alpha * a) for s, a in zip(start, combined.tensors, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {"error_feedback": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["error_feedback"])

    def shared_state(self) -> list[Tensor] | None:
        return None

    def load_shared_state(self, tensors: Sequence[Tensor]) -> None:
        if tensors:
            raise PayloadError("SparseLoCo has no shared outer state")

    def private_tensors(self) -> list[Tensor]:
        return self.compressor.state_dict()["buffers"]


@implements(DILOCO)
class DiLoCoMethod(OuterMethod):
    """The dense baseline: fp32/fp16 pseudo-gradients, token-weighted mean, outer Nesterov SGD."""

    def __init__(self, shapes: Shapes, run: RunConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(shapes, run, device)
        self.wire, self.lr, self.mu = run.outer.diloco_wire, run.outer.diloco_lr, run.outer.diloco_momentum
        self.momentum = [torch.zeros(s, device=self.device) for s in self.shapes]

    def encode(self, deltas: Sequence[Tensor]) -> Encoded:
        return Encoded(dense_codec.encode(deltas, self.wire), None)

    def restore(self, snapshot: Any) -> None:
        """Encoding changed nothing."""

    def decode(self, payload: bytes) -> Any:
        return dense_codec.decode(payload, self.shapes, self.wire)

    def _combine_sorted(self, messages: Sequence[Any], weights: Sequence[float], names: Sequence[str]) -> Combined:
        """Σ w_r·f_r·Δ_r / Σ w_r, summed in canonical order, with each claimed weight capped at `MEAN_WEIGHT_CAP` ×
        the lower median and each Δ_r's norm clipped to `DILOCO_NORM_CAP` × the lower-median norm (f_r ≤ 1): one
        member claiming 2⁴⁰ tokens and sending a huge step took θ to 1.3·10³⁰ in a round (review M1)."""
        used = [i for i, w in enumerate(weights) if math.isfinite(w) and w > 0]
        dropped = [(i, f"weight {weights[i]!r} is not a positive number") for i in range(len(weights)) if i not in used]
        sums = [torch.zeros(s, device=self.device) for s in self.shapes]
        if not used:
            return Combined(sums, [], dropped)
        relative = capped_relative([weights[i] for i in used], MEAN_WEIGHT_CAP)
        factors = norm_clip([dense_norm(messages[i]) for i in used], DILOCO_NORM_CAP)
        total = math.fsum(relative)
        for i, w, factor in zip(used, relative, factors, strict=True):
            scale = torch.tensor(w / total * factor, dtype=torch.float32, device=self.device)
            for acc, t in zip(sums, messages[i], strict=True):
                acc.add_(t.to(self.device) * scale)
        return Combined(sums, used, dropped)

    def update(self, start: Sequence[Tensor], combined: Combined) -> list[Tensor]:
        """m ← μ·m + Δ̄; θ(t+1) = θ(t) − lr·(Δ̄ + μ·m)."""
        new = []
        for s, d, m in zip(start, combined.tensors, self.momentum, strict=True):
            d = d.to(m.device)
            m.mul_(self.mu).add_(d)
            new.append(_minus(s, self.lr * (d + self.mu * m)))
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": [m.detach().to("cpu", copy=True) for m in self.momentum]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_shared_state(state["momentum"])

    def shared_state(self) -> list[Tensor] | None:
        return self.momentum

    def load_shared_state(self, tensors: Sequence[Tensor]) -> None:
        if [tuple(t.shape) for t in tensors] != self.shapes or not all(bool(t.isfinite().all()) for t in tensors):
            raise PayloadError("outer momentum of the wrong shapes, or not finite")
        for m, saved in zip(self.momentum, tensors, strict=True):
            m.copy_(saved)

    def private_tensors(self) -> list[Tensor]:
        return self.momentum


DILOCO_NORM_CAP = 2.0
"""A dense pseudo-gradient counts with at most this many times the lower-median member's norm: honest replicas'
norms differ by less (their tokens are capped alike), a member sending a step scaled by 10⁶ is cut to twice a
median one."""
CLIP_GRID = 2.0**-20
"""Clip factors below 1 are rounded down to this grid: norms are float64 sums whose last bits depend on the device
and summation order, and every member must scale each message by the same float32."""


def dense_norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm of a dense message, summed in float64."""
    return math.sqrt(math.fsum(float(t.double().square().sum()) for t in tensors))


def norm_clip(norms: Sequence[float], cap: float) -> list[float]:
    """f_r = min(1, cap · lower median / n_r), factors below 1 rounded down to `CLIP_GRID` (see there)."""
    bound = cap * lower_median(norms)
    return [1.0 if n <= bound else math.floor(bound / n / CLIP_GRID) * CLIP_GRID for n in norms]


def _minus(start: Tensor, step: Tensor) -> Tensor:
    """θ − step on θ's device, in θ's dtype promoted to at least fp32, returned in θ's dtype (a bf16 or fp64 θ stays
    one; an fp32 θ beside an fp32 step on its device costs no copy)."""
    dtype = torch.promote_types(start.dtype, torch.float32)
    return (start.to(dtype) - step.to(start.device, dtype)).to(start.dtype)


def outer_method(run: RunConfig, shapes: Shapes, device: torch.device | str = "cpu") -> OuterMethod:
    """The run's outer method for one shard of `shapes`, its state and arithmetic on `device` (the model's)."""
    return _IMPLEMENTATIONS[outer_spec(run.outer.outer).name](shapes, run, device)
