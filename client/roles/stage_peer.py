"""A pipeline-stage peer: one stage of a virtual replica (VR), trained through the pipeline and averaged in its
shard's group together with the full replicas (the VR counts as one replica there, with its own error feedback).

Round t, on every stage of the VR:

1. Start point θ_s(t) and T_fixed(t): published as state, fingerprint and round t in our record.
2. Optionally project the start point into the subspace; the pseudo-gradient is measured from there.
3. Wait for the pipeline: stage 0 until every stage of its VR announces round t, later stages for stage 0's
   first message. Meanwhile, if the swarm moves past round t, load its newest state instead.
4. H inner steps, each a global batch of M microbatches, GPipe-style: stage 0 sends all M forwards, every stage
   processes messages as they arrive, the last computes the loss and sends gradients back; each stage steps its
   AdamW once per global batch and re-projects.
5. Outer step in the shard's group (`ShardSync`): Δ = (projected) start − current, θ(t+1) = θ(t) − α·aggregate.
6. Upkeep: stage 0 moves the embedding's drift into T_fixed; later stages load T_fixed(t+1) from a peer that
   has it, checked against its advertised fingerprint.
7. Eval pass: stage 0 sends the validation batches through, the last stage records the loss.

A stage that hears nothing for `stage_timeout_s`, sees a neighbour's record vanish, or has a message refused
gives up the round (a clear log line, never a hang): it restores θ(t), keeps its error feedback, loads θ(t+1)
from its shard group and waits for its VR to be whole again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.outer.shard_state import FIXED, ShardStates, state_fingerprint
from hetero_node.client.outer.shard_sync import ShardOutcome, ShardSync
from hetero_node.client.roles.metrics import MetricsWriter, RoundRecord
from hetero_node.client.roles.pipeline_stage import PipelineStage
from hetero_node.client.roles.stage_link import (
    BACKWARD,
    EVAL,
    FORWARD,
    Expectation,
    Header,
    StageInbox,
    StageMessage,
    StageSender,
    microbatch_sizes,
    wire,
)
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.planner import ROLE_STAGE
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.client.swarm.view import expected_group_size, replica_count, shard_donors
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, val_batches
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.subspace import drift_transfer_
from hetero_node.models.trainer import resolve_device
from hetero_node.protocol.errors import HeteroNodeError, PayloadError
from hetero_node.protocol.keys import stage_handler_name
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 2.0
"""While waiting for a neighbour's message, re-read the records this often to notice a vanished neighbour."""


class PipelineAborted(HeteroNodeError):
    """This round's pipeline cannot finish (a neighbour vanished, went silent, or refused a message)."""


class StagePeer:
    """See the module docstring. `run()` blocks until the run's last round, a stop signal, or a lost slot."""

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        store: TokenStore,
        timeouts: SyncTimeouts,
        runtime: PeerRuntime,
        membership: Membership,
    ) -> None:
        self.run_cfg, self.node, self.timeouts = run, node, timeouts
        self.runtime, self.membership, self.stop = runtime, membership, membership.stop
        self.vr, self.shard = membership.slot
        self.device = resolve_device(node.device)
        self.stage = PipelineStage(run, self.shard, self.device)
        cfg = get_preset(run.preset, vocab_size=run.vocab_size)
        self.names = shard_parameter_names(cfg, run.outer.stages)[self.shard]
        self.params = shard_tensors(self.stage.module, self.names)
        self.sizes = microbatch_sizes(run.batch_size, run.pipeline.microbatches)
        self.inbox = StageInbox(self.stage.fmt, run.outer.inner_steps, self.sizes, run.seq_len, run.batch_size)
        self.sender = StageSender(runtime, run.run_id)
        self.round = 0
        self.neighbours: dict[int, str] = {}
        self.boundary = {"sent": 0, "received": 0, "tokens": 0}
        if self.stage.first:
            replica_id = node.replica_id if node.replica_id >= 0 else self._peer_number()
            self.batches = ShardBatches(
                store, replica_id % run.data_shards, run.data_shards, run.batch_size, run.seq_len, run.seed
            )
            self.val = val_batches(store, run.batch_size, run.seq_len, node.eval_batches)
        fixed = self.stage.fixed_table
        self.states = ShardStates(
            runtime, {self.shard: [tuple(p.shape) for p in self.params]},
            None if fixed is None else tuple(fixed.shape), timeouts.fetch_timeout_s,
        )  # fmt: skip
        self.sync: ShardSync | None = None
        self._in_flight: list[tuple[int, Any]] = []

    def _peer_number(self) -> int:
        return int.from_bytes(self.runtime.peer_id.to_bytes()[-4:], "big")

    # ------------------------------------------------------------------------------------------------ helpers

    @property
    def n_stages(self) -> int:
        return self.run_cfg.outer.stages

    def _clone(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def _set(self, tensors: list[torch.Tensor]) -> None:
        for p, value in zip(self.params, tensors, strict=True):
            p.copy_(value)

    def fingerprints(self) -> dict[str, str]:
        fixed = self.stage.fixed_table
        fps = {str(self.shard): state_fingerprint(self.params, fixed)}
        return fps if fixed is None else {**fps, FIXED: fingerprint([fixed])}

    def _records(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        return self.runtime.read_records(timeout) or {}

    def _mates(self, records: dict[str, dict[str, Any]]) -> dict[int, tuple[str, dict[str, Any]]]:
        """stage → (peer id, record) of our VR as the records show it (lowest id for a contested slot)."""
        mates: dict[int, tuple[str, dict[str, Any]]] = {}
        for pid, r in sorted(records.items()):
            if r.get("role") == ROLE_STAGE and r.get("vr") == self.vr:
                mates.setdefault(r.get("stage", -1), (pid, r))
        return mates

    def _swarm_round(self, records: dict[str, dict[str, Any]]) -> int:
        me = str(self.runtime.peer_id)
        return max((r.get("round", 0) for pid, r in shard_donors(records, self.shard).items() if pid != me), default=0)

    def _announce(self, **extra: Any) -> None:
        self.membership.update(round=self.round, fingerprints=self.fingerprints(), **extra)

    # ---------------------------------------------------------------------------------------------- lifecycle

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> None:
        """Serve the slot round after round; return at the run's end, on a stop signal, or when the slot is lost."""
        handler = stage_handler_name(self.run_cfg.run_id)
        self.runtime.run(
            self.runtime.p2p.add_protobuf_handler(handler, self.inbox.handle, wire.StagePiece, stream_input=True)
        )
        try:
            self.sync = ShardSync(
                self.runtime, self.run_cfg, self.shard, [tuple(p.shape) for p in self.params], self.timeouts
            )
            self.metrics = MetricsWriter(
                self.node.metrics,
                {"peer_id": str(self.runtime.peer_id), "role": "stage", "stage": self.shard, "vr": self.vr,
                 "n_params": sum(p.numel() for p in self.params), "run": self.run_cfg.to_dict()},
            )  # fmt: skip
            while self.round < self.run_cfg.outer.rounds and not self.stop.is_set():
                if self.membership.slot != (self.vr, self.shard):
                    logger.warning("slot vr %d stage %d was reassigned; leaving it", self.vr, self.shard)
                    return
                self._catch_up()
                if self.round >= self.run_cfg.outer.rounds:
                    break
                record = self._one_round()
                if record is not None:
                    self.metrics.write(record)
                    if on_round is not None:
                        on_round(record)
            if not self.stop.is_set():  # serve our final state to slower peers for a while
                self._publish_state()
                self._announce()
                self.stop.wait(self.node.linger_s)
        finally:
            if self.sync is not None:
                self.sync.shutdown()
            with contextlib.suppress(Exception):  # p2pd may already be gone (a signal to the whole process group)
                self.runtime.run(self.runtime.p2p.remove_protobuf_handler(handler, stream_input=True), timeout=5)

    # --------------------------------------------------------------------------------------- state & resync

    def _publish_state(self) -> None:
        momentum = None if self.sync is None or self.sync.sparse else {self.shard: self.sync.momentum}
        self.states.publish(self.round, {self.shard: self.params}, self.stage.fixed_table, momentum)

    def _load(self, min_round: int, wait_s: float) -> bool:
        """θ_s and T_fixed at round ≥ min_round from a full replica or a peer serving the same stage."""
        loaded = self.states.load(lambda: shard_donors(self._records(), self.shard), min_round, wait_s, self.stop)
        if loaded is None:
            return False
        self.round, states = loaded
        state = states[self.shard]
        self._set(state["tensors"])
        if self.stage.fixed_table is not None:
            self.stage.fixed_table.copy_(state[FIXED])
        if "momentum" in state and self.sync is not None and not self.sync.sparse:
            for m, saved in zip(self.sync.momentum, state["momentum"], strict=True):
                m.copy_(saved)
        return True

    def _catch_up(self) -> None:
        swarm_round = self._swarm_round(self._records())
        if swarm_round > self.round:
            self._load(min_round=swarm_round, wait_s=0.0)

    # ------------------------------------------------------------------------------------------------- a round

    def _one_round(self) -> RoundRecord | None:
        run, t = self.run_cfg, self.round
        start = self._clone()  # θ(t): what the outer step updates, and what the group's fingerprint check covers
        start_fp = self.fingerprints()[str(self.shard)]
        self._publish_state()
        self._announce()
        if run.pipeline.project_start:
            self.stage.project()
        train_start = self._clone()  # where the pseudo-gradient is measured from
        if not self._wait_for_pipeline(t):
            self._set(start)
            return None
        self.boundary = {"sent": 0, "received": 0, "tokens": 0}
        self.stage.trainer.step = t * run.outer.inner_steps  # LR schedule position is a function of the round
        compute_start = time.perf_counter()
        try:
            train_loss = self._inner_loop(t)
        except PipelineAborted as e:
            logger.error("vr %d round %d: %s; this virtual replica does not contribute this round", self.vr, t, e)
            self._skip_round(t, start)
            return None
        compute_s = time.perf_counter() - compute_start
        if train_loss is not None:
            self._announce(loss=train_loss if math.isfinite(train_loss) else None)

        comm_start = time.perf_counter()
        outcome = self._outer_step(t, start, train_start, start_fp, compute_s)
        if outcome.new_tensors is None:
            self._skip_round(t, start)
        else:
            self._set(outcome.new_tensors)
            if not self._subspace_upkeep(t + 1):
                return None
            self.round = t + 1
        comm_s = time.perf_counter() - comm_start
        eval_loss = self._eval_pass(t)
        tokens = run.outer.inner_steps * run.batch_size * run.seq_len
        return RoundRecord(
            round=t, inner_steps=run.outer.inner_steps, tokens=tokens, train_loss=train_loss, eval_loss=eval_loss,
            bytes_sent=outcome.bytes_sent, bytes_received=outcome.bytes_received, compute_s=compute_s, comm_s=comm_s,
            fingerprints=self.fingerprints(), group_size=outcome.group_size, contributors=outcome.contributors,
            dropped=outcome.dropped, resynced=outcome.new_tensors is None,
            boundary_bytes_sent=self.boundary["sent"], boundary_bytes_received=self.boundary["received"],
            boundary_tokens=self.boundary["tokens"],
        )  # fmt: skip

    def _skip_round(self, t: int, start: list[torch.Tensor]) -> None:
        """Leave round t without our contribution: θ(t+1) from the swarm, or θ(t) unchanged when nobody has it.

        A round is never run twice: its messages would collide with those of the failed attempt still queued at
        a neighbour. A stale θ is caught by the next group's start-fingerprint check, which re-syncs us.
        """
        self.stage.reset()
        self._set(start)
        if not self._load(min_round=t + 1, wait_s=self.timeouts.round_timeout_s):
            logger.warning("round %d: no peer has round %d; going on from round %d's weights", t, t + 1, t)
            self.round = t + 1

    def _wait_for_pipeline(self, t: int) -> bool:
        """Until the VR is whole and in round t (see the module docstring); False to skip the round (the swarm
        moved past it, our slot was reassigned, or we are stopping)."""
        told: tuple[int, ...] = ()
        while not self.stop.is_set():
            records = self._records()
            if self._swarm_round(records) > t:  # the run loop catches up once θ(t) is restored
                logger.warning("round %d: the swarm is in round %d; catching up", t, self._swarm_round(records))
                return False
            if self.membership.slot != (self.vr, self.shard):
                return False
            mates = self._mates(records)
            self.neighbours = {s: pid for s, (pid, _) in mates.items()}
            previous, next_ = self.neighbours.get(self.shard - 1), self.neighbours.get(self.shard + 1)
            self.inbox.expect_round(Expectation(self.vr, self.shard, t, previous, next_))
            missing = tuple(s for s in range(self.n_stages) if s not in mates)
            whole = not missing
            if missing and missing != told:  # said once per change, not every poll
                logger.warning(
                    "vr %d round %d: no peer serves stage %s; this virtual replica does not contribute until one "
                    "takes the slot", self.vr, t, ", ".join(map(str, missing)),
                )  # fmt: skip
            told = missing
            if self.stage.first:
                if whole and all(r.get("round") == t for _, r in mates.values()):
                    return True
            elif whole and self.inbox.take(lambda h: True, timeout=1.0, keep=True) is not None:
                return True
            time.sleep(0.3)
        return False

    # ------------------------------------------------------------------------------------------- the pipeline

    def _send(self, stage: int, kind: int, t: int, step: int, microbatch: int, payload: bytes, count: int = 0) -> Any:
        peer = self.neighbours.get(stage)
        if peer is None:
            raise PipelineAborted(f"stage {stage} of vr {self.vr} is missing")
        future, wire_bytes = self.sender.send(peer, Header(kind, self.vr, stage, t, step, microbatch, count), payload)
        if kind != EVAL:
            self.boundary["sent"] += wire_bytes
            self.boundary["tokens"] += (self.sizes[microbatch] * self.run_cfg.seq_len) if payload else 0
        self._in_flight.append((stage, future))
        return future

    def _take(self, match: Callable[[Header], bool], what: str) -> StageMessage:
        """The next matching message; PipelineAborted after `stage_timeout_s` of silence, when a send failed, when
        a neighbour's record vanished, or on stop."""
        deadline = time.monotonic() + self.timeouts.stage_timeout_s
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while True:
            self._check_sends()
            message = self.inbox.take(match, timeout=0.5)
            if message is not None:
                if message.header.kind != EVAL:
                    self.boundary["received"] += message.wire_bytes
                return message
            now = time.monotonic()
            if self.stop.is_set():
                raise PipelineAborted("stopping")
            if now > deadline:
                raise PipelineAborted(f"no {what} for {self.timeouts.stage_timeout_s:.0f} s")
            if now > next_check:
                next_check = now + LIVENESS_CHECK_S
                records = self.runtime.read_records(timeout=2.0)
                mates = {} if records is None else self._mates(records)
                for s, pid in self.neighbours.items() if records is not None else ():
                    if abs(s - self.shard) == 1 and mates.get(s, ("",))[0] != pid:
                        raise PipelineAborted(f"stage {s} ({pid}) left the swarm")

    def _check_sends(self, wait: bool = False) -> None:
        """Raise PipelineAborted if a message we sent was refused or could not be delivered."""
        still = []
        for stage, future in self._in_flight:
            if wait:
                try:
                    future.result(self.timeouts.stage_timeout_s)
                except Exception as e:  # transport and handler errors come in many types
                    raise PipelineAborted(f"stage {stage} did not take our message ({e})") from None
            elif future.done():
                if future.exception() is not None:
                    raise PipelineAborted(f"stage {stage} did not take our message ({future.exception()})")
            else:
                still.append((stage, future))
        self._in_flight = still

    def _inner_loop(self, t: int) -> float | None:
        """H global batches through the pipeline; the last stage returns the mean training loss."""
        self._in_flight: list[tuple[int, Any]] = []
        losses = []
        for i in range(self.run_cfg.outer.inner_steps):
            if self.stage.first:
                self._drive_step(t, i)
            else:
                losses.append(self._serve_step(t, i))
            self.stage.optimizer_step()
        self._check_sends(wait=True)
        return sum(losses) / len(losses) if self.stage.last else None

    def _drive_step(self, t: int, i: int) -> None:
        """Stage 0: all M forwards in flight, then their backwards as they come back."""
        x, y = self.batches.batch(t * self.run_cfg.outer.inner_steps + i)
        M = len(self.sizes)
        for j, (xj, yj) in enumerate(zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True)):
            self._send(1, FORWARD, t, i, j, self.stage.forward((i, j), xj, yj))
        for _ in range(M):
            message = self._take(lambda h: h.kind == BACKWARD and h.step == i, "gradient")
            self.stage.backward((i, message.header.microbatch), message.values)

    def _serve_step(self, t: int, i: int) -> float:
        """A later stage: process forwards and backwards of step i as they arrive; the last stage's loss."""
        done, loss = 0, 0.0
        batch = self.run_cfg.batch_size
        while done < len(self.sizes):
            m = self._take(lambda h: h.kind in (FORWARD, BACKWARD) and h.step == i, "pipeline message")
            j = m.header.microbatch
            if m.header.kind == FORWARD and self.stage.last:
                weight = self.sizes[j] / batch
                mb_loss, grad = self.stage.forward_backward_last(m.values, m.tokens, m.targets, weight)
                self._send(self.shard - 1, BACKWARD, t, i, j, grad)
                loss += mb_loss * weight
                done += 1
            elif m.header.kind == FORWARD:
                self._send(self.shard + 1, FORWARD, t, i, j, self.stage.forward((i, j), m.tokens, m.targets, m.values))
            else:
                try:
                    grad = self.stage.backward((i, j), m.values)
                except KeyError:
                    raise PipelineAborted(f"gradient for microbatch {j} of step {i}, never forwarded") from None
                self._send(self.shard - 1, BACKWARD, t, i, j, grad)
                done += 1
        return loss

    # -------------------------------------------------------------------------------------- outer step & upkeep

    def _outer_step(
        self, t: int, start: list[torch.Tensor], train_start: list[torch.Tensor], start_fp: str, compute_s: float
    ) -> ShardOutcome:
        assert self.sync is not None
        records = self._records()
        current = [p.detach() for p in self.params]
        if replica_count(records, self.n_stages) <= 1:  # our VR is the only replica alive
            return self.sync.solo(train_start, current, update_from=start)
        wait_s = max(self.timeouts.matchmaking_s, self.timeouts.straggler_fraction * compute_s)
        expected = expected_group_size(records, t, self.shard, self.n_stages)
        try:
            control = self.sync.begin(t, train_start, current, start_fp, expected, wait_s)
        except PayloadError as e:
            logger.error("round %d: my pseudo-gradient is unusable (%s); skipping the round", t, e)
            return ShardOutcome(new_tensors=None)

        def swarm_moved_on() -> bool:
            return any(r.get("round", -1) > t for r in self._records(timeout=1.0).values())

        return self.sync.finish(control, start, swarm_moved_on)

    def _subspace_upkeep(self, new_round: int) -> bool:
        """Drift transfer after our own outer step: stage 0 computes it, later stages load the resulting T_fixed."""
        if self.stage.basis is None or not self.run_cfg.pipeline.drift_transfer:
            return True
        if self.stage.first:
            drift_transfer_(self.stage.module, self.stage.basis)
            return True
        deadline = time.monotonic() + self.timeouts.round_timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            records = self._records()
            mate = self.neighbours.get(0)
            donors = sorted(
                (pid != mate, pid)
                for pid, r in records.items()
                if r.get("round") in (new_round, new_round + 1) and FIXED in r.get("fingerprints", {})
            )  # our own stage 0 first, then anyone who has it
            for _, pid in donors:
                fixed = self.states.fetch_fixed(pid, records[pid], new_round)
                if fixed is not None:
                    self.stage.fixed_table.copy_(fixed)
                    return True
            time.sleep(0.3)
        logger.error("round %d: no peer served the fixed table of round %d; re-syncing", new_round - 1, new_round)
        return self._load(min_round=new_round, wait_s=self.timeouts.round_timeout_s)

    # ---------------------------------------------------------------------------------------------------- eval

    def _eval_pass(self, t: int) -> float | None:
        """Stage 0 sends the validation batches (or an empty pass when eval is not due); the last stage's loss."""
        self._in_flight = []
        due = self.round % self.node.eval_every == 0 or self.round >= self.run_cfg.outer.rounds
        try:
            if self.stage.first:
                batches = list(self.val) if due else []
                for j, (x, y) in enumerate(batches):
                    self._send(1, EVAL, t, 0, j, self.stage.eval_forward(x, y), count=len(batches))
                if not batches:
                    self._send(1, EVAL, t, 0, 0, b"", count=0)
                self._check_sends(wait=True)
                return None
            return self._serve_eval(t)
        except PipelineAborted as e:
            logger.warning("round %d: eval pass abandoned (%s)", t, e)
            return None

    def _serve_eval(self, t: int) -> float | None:
        first = self._take(lambda h: h.kind == EVAL and h.microbatch == 0, "eval batch")
        count = first.header.count
        if count == 0:
            if not self.stage.last:
                self._send(self.shard + 1, EVAL, t, 0, 0, b"", count=0)
                self._check_sends(wait=True)
            return None
        losses, message = [], first
        for j in range(count):
            if j > 0:
                message = self._take(lambda h, j=j: h.kind == EVAL and h.microbatch == j, "eval batch")
            out = self.stage.eval_forward(message.tokens, message.targets, message.values)
            if self.stage.last:
                losses.append(out)
            else:
                self._send(self.shard + 1, EVAL, t, 0, j, out, count=count)
        self._check_sends(wait=True)
        return sum(losses) / len(losses) if losses else None
