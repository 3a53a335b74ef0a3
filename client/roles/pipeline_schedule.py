"""The GPipe schedule of one virtual replica's inner steps, as one stage runs it, and the message pump under it.

Stage 0 reads the data and drives: each inner step's batches (`accumulation` of them in a stretched round,
`roles/schedule.py`) are cut into M microbatches each, of which `BATCHES_IN_FLIGHT` × M are in flight at a time:
the forward of the next goes out as each gradient comes back, so a step pays the pipeline's round trips once, not
once per batch, and a stage holds at most that many batches' activations (the memory model counts them). Every
later stage handles messages as they arrive (a forward says how many microbatches its step has), the last computes
the loss and sends gradients back. Each stage steps its optimizer once per inner step. Rounds are time-boxed:
stage 0 decides, before each step, whether another one fits before the round's deadline, and when it stops it
sends END with the number of steps trained (0: the replica sits the round out), which every stage passes on.
After the outer step stage 0 sends the validation batches through (or an empty pass) and the last stage scores.

A neighbour that goes silent for `stage_timeout_s`, whose record vanishes, or that refuses our message aborts the
round (`PipelineAborted`), never hangs it. So does a message whose values cannot be used (a `PayloadError` from
the codec: e.g. finite values that overflow once expanded).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetero_node.client.roles.pipeline_stage import PipelineStage
from hetero_node.client.roles.stage_link import (
    BACKWARD,
    END,
    EVAL,
    FORWARD,
    KIND_NAMES,
    Header,
    StageInbox,
    StageMessage,
    StageSender,
)
from hetero_node.client.swarm import view
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.stages import BATCHES_IN_FLIGHT
from hetero_node.protocol.errors import HeteroNodeError, PayloadError

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
"""Token ids and targets."""
LIVENESS_CHECK_S = 2.0
"""While waiting for a neighbour's message, re-read the records this often to notice a vanished neighbour."""


class PipelineAborted(HeteroNodeError):
    """This round's pipeline cannot finish (a neighbour vanished, went silent, or refused a message)."""


@dataclass
class BoundaryBytes:
    """Training traffic of this stage in one round (eval passes excluded), as streamed."""

    sent: int = 0
    received: int = 0
    tokens: int = 0


@dataclass
class PipelineSchedule:
    """One stage's side of its virtual replica's pipeline (see the module docstring)."""

    runtime: PeerRuntime
    stage: PipelineStage
    inbox: StageInbox
    sender: StageSender
    vr: int
    index: int
    """This stage's position in the pipeline (= the parameter shard it holds)."""
    n_stages: int
    sizes: list[int]
    seq_len: int
    stage_timeout_s: float
    stop: Callable[[], bool]
    neighbours: dict[int, str] = field(default_factory=dict)
    lr: tuple[int, int] = (0, 1)
    """(first LR-schedule position of the round, H): step i of a round trains at position first + min(i, H − 1)."""
    boundary: BoundaryBytes = field(default_factory=BoundaryBytes)
    batches: int = 0
    """Batches trained in this round (a step accumulates one or more)."""
    _in_flight: list[tuple[int, concurrent.futures.Future]] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------ the pump

    def send(self, stage: int, kind: int, t: int, step: int, microbatch: int, payload: bytes, count: int = 0) -> None:
        peer = self.neighbours.get(stage)
        if peer is None:
            raise PipelineAborted(f"stage {stage} of vr {self.vr} is missing")
        future, wire_bytes = self.sender.send(peer, Header(kind, self.vr, stage, t, step, microbatch, count), payload)
        if kind in (FORWARD, BACKWARD):
            self.boundary.sent += wire_bytes
            self.boundary.tokens += (self.inbox.size(microbatch) * self.seq_len) if payload else 0
        self._in_flight.append((stage, future))

    def take(self, match: Callable[[Header], bool], what: str) -> StageMessage:
        """The next matching message; PipelineAborted after `stage_timeout_s` of silence, when a send failed, when
        a neighbour's record vanished, or on stop."""
        deadline = time.monotonic() + self.stage_timeout_s
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while True:
            self.check_sends()
            message = self.inbox.take(match, timeout=0.5)
            if message is not None:
                if message.header.kind in (FORWARD, BACKWARD):
                    self.boundary.received += message.wire_bytes
                return message
            now = time.monotonic()
            if self.stop():
                raise PipelineAborted("stopping")
            if now > deadline:
                raise PipelineAborted(f"no {what} for {self.stage_timeout_s:.0f} s")
            if now > next_check:
                next_check = now + LIVENESS_CHECK_S
                self.check_neighbours()

    def check_neighbours(self) -> None:
        """PipelineAborted when an adjacent stage's holder is no longer the one we talk to."""
        records = self.runtime.read_records(timeout=2.0)
        if records is None:
            return
        holders = view.vr_stages(records, self.vr, self.n_stages)
        for s, pid in self.neighbours.items():
            if abs(s - self.index) == 1 and holders.get(s) != pid:
                raise PipelineAborted(f"stage {s} ({pid}) left the swarm")

    def check_sends(self, wait: bool = False) -> None:
        """PipelineAborted if a message we sent was refused or could not be delivered."""
        still = []
        for stage, future in self._in_flight:
            if wait:
                try:
                    future.result(self.stage_timeout_s)
                except Exception as e:  # transport and handler errors come in many types
                    raise PipelineAborted(f"stage {stage} did not take our message ({e})") from None
            elif future.done():
                if future.exception() is not None:
                    raise PipelineAborted(f"stage {stage} did not take our message ({future.exception()})")
            else:
                still.append((stage, future))
        self._in_flight = still

    # ---------------------------------------------------------------------------------------- training

    def drive(
        self,
        t: int,
        batch: Callable[[int], Batch],
        more: Callable[[int], bool],
        accumulation: int = 1,
    ) -> int:
        """Stage 0: inner steps of `accumulation` batches each (`batch(k)`: the round's k-th) while `more(steps so
        far)` says so, then END; returns the steps trained."""
        self._in_flight, self.boundary, self.batches = [], BoundaryBytes(), 0
        steps, window = 0, BATCHES_IN_FLIGHT * len(self.sizes)
        while more(steps):
            parts = self._microbatches([batch(steps * accumulation + k) for k in range(accumulation)])
            sent = 0
            for done in range(len(parts)):
                while sent < min(len(parts), done + window):
                    xj, yj = parts[sent]
                    message = self.stage.forward((steps, sent), xj, yj)  # our own data
                    self.send(1, FORWARD, t, steps, sent, message, count=len(parts))
                    sent += 1
                gradient = self.take(lambda h, i=steps: h.kind == BACKWARD and h.step == i, "gradient")
                key = (steps, gradient.header.microbatch)
                self._compute(lambda key=key, m=gradient: self.stage.backward(key, m.values))
            self._optimizer_step(steps)
            steps, self.batches = steps + 1, self.batches + accumulation
        self.send(1, END, t, 0, 0, b"", count=steps)
        self.check_sends(wait=True)
        return steps

    def _microbatches(self, batches: list[Batch]) -> list[Batch]:
        """Each batch cut into the run's M microbatches, in order."""
        M = len(self.sizes)
        return [mb for x, y in batches for mb in zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True)]

    def serve(self, t: int) -> tuple[int, list[float]]:
        """A later stage: handle each step's messages until END; (steps trained, the last stage's losses)."""
        self._in_flight, self.boundary, self.batches = [], BoundaryBytes(), 0
        steps, losses = 0, []
        while True:
            first = self.take(
                lambda h, i=steps: h.kind == END or (h.kind in (FORWARD, BACKWARD) and h.step == i), "pipeline message"
            )
            if first.header.kind == END:
                if first.header.count != steps:
                    raise PipelineAborted(f"stage 0 ended the round after {first.header.count} steps, we saw {steps}")
                if not self.stage.last:
                    self.send(self.index + 1, END, t, 0, 0, b"", count=steps)
                self.check_sends(wait=True)
                return steps, losses
            loss = self._serve_step(t, steps, first)
            if self.stage.last:
                losses.append(loss)
            self._optimizer_step(steps)
            steps, self.batches = steps + 1, self.batches + first.header.count // len(self.sizes)

    def _serve_step(self, t: int, i: int, first: StageMessage) -> float:
        """Process step i's forwards and backwards as they arrive (the first already taken: the step's first
        forward, which says how many microbatches the step has); the last stage's loss."""
        if first.header.kind != FORWARD:
            raise PipelineAborted(f"step {i} began with a {KIND_NAMES[first.header.kind]} message")
        count = first.header.count
        done, loss, message = 0, 0.0, first
        total = sum(self.inbox.size(j) for j in range(count))
        while True:
            j = message.header.microbatch
            if message.header.kind == FORWARD and message.header.count != count:
                raise PipelineAborted(f"step {i}'s forwards disagree on its microbatches ({count}, then "
                                      f"{message.header.count})")  # fmt: skip
            if message.header.kind == FORWARD and self.stage.last:
                weight = self.inbox.size(j) / total
                mb_loss, grad = self._compute(
                    lambda m=message, w=weight: self.stage.forward_backward_last(m.values, m.tokens, m.targets, w)
                )
                self.send(self.index - 1, BACKWARD, t, i, j, grad)
                loss += mb_loss * weight
                done += 1
            elif message.header.kind == FORWARD:
                out = self._compute(lambda m=message, j=j: self.stage.forward((i, j), m.tokens, m.targets, m.values))
                self.send(self.index + 1, FORWARD, t, i, j, out, count=count)
            else:
                try:
                    grad = self._compute(lambda m=message, j=j: self.stage.backward((i, j), m.values))
                except KeyError:
                    raise PipelineAborted(f"gradient for microbatch {j} of step {i}, never forwarded") from None
                self.send(self.index - 1, BACKWARD, t, i, j, grad)
                done += 1
            if done == count:
                return loss
            message = self.take(lambda h: h.kind in (FORWARD, BACKWARD) and h.step == i, "pipeline message")

    def _optimizer_step(self, i: int) -> None:
        first, reference = self.lr
        self.stage.trainer.step = first + min(i, reference - 1)
        self.stage.optimizer_step()

    @staticmethod
    def _compute(work: Callable[[], object]) -> object:
        """A stage computation on a neighbour's values: unusable values abort the round, never the process."""
        try:
            return work()
        except PayloadError as e:
            raise PipelineAborted(f"a neighbour's values are unusable ({e})") from None

    # ---------------------------------------------------------------------------------------------- eval

    def eval_pass(self, t: int, batches: list[Batch] | None) -> float | None:
        """Stage 0 sends `batches` (an empty pass when eval is not due); the last stage returns the mean loss."""
        self._in_flight = []
        try:
            if self.stage.first:
                batches = batches or []
                for j, (x, y) in enumerate(batches):
                    self.send(1, EVAL, t, 0, j, self.stage.eval_forward(x, y), count=len(batches))
                if not batches:
                    self.send(1, EVAL, t, 0, 0, b"", count=0)
                self.check_sends(wait=True)
                return None
            return self._serve_eval(t)
        except PipelineAborted as e:
            logger.warning("round %d: eval pass abandoned (%s)", t, e)
            return None

    def _serve_eval(self, t: int) -> float | None:
        first = self.take(lambda h: h.kind == EVAL and h.microbatch == 0, "eval batch")
        count = first.header.count
        if count == 0:
            if not self.stage.last:
                self.send(self.index + 1, EVAL, t, 0, 0, b"", count=0)
                self.check_sends(wait=True)
            return None
        losses, message = [], first
        for j in range(count):
            if j > 0:
                message = self.take(lambda h, j=j: h.kind == EVAL and h.microbatch == j, "eval batch")
            out = self._compute(lambda m=message: self.stage.eval_forward(m.tokens, m.targets, m.values))
            if self.stage.last:
                losses.append(out)
            else:
                self.send(self.index + 1, EVAL, t, 0, j, out, count=count)
        self.check_sends(wait=True)
        return sum(losses) / len(losses) if losses else None
