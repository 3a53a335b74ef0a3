"""A full replica: holds the whole model, trains H inner steps, then takes part in every shard's outer round.

The loop, once per round t:  publish θ(t) and progress → H AdamW steps → per shard: Δ, compress, group, exchange,
aggregate → θ(t+1) → checkpoint, metrics. A replica that misses a round (no group, or a start point that differs
from the group's) keeps its error feedback, loads θ(t+1) from a peer that has it, and carries on.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.outer.shard_state import FIXED, ShardStates, state_fingerprint
from hetero_node.client.outer.shard_sync import ShardOutcome, ShardSync
from hetero_node.client.roles.checkpoint import load_checkpoint, save_checkpoint
from hetero_node.client.roles.metrics import MetricsWriter, RoundRecord
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.client.swarm.view import expected_group_size, full_replicas, replica_count
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, val_batches
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.subspace import drift_transfer_, enable_subspace, subspace_basis
from hetero_node.models.trainer import InnerTrainer, resolve_device
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.errors import CheckpointError, HeteroNodeError, PayloadError
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)


class FullReplica:
    """See the module docstring. `run()` blocks until the run's last round or a stop signal."""

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        store: TokenStore,
        timeouts: SyncTimeouts,
        runtime: PeerRuntime,
        membership: Membership,
    ) -> None:
        self.run_cfg, self.node, self.store, self.timeouts = run, node, store, timeouts
        self.runtime, self.membership = runtime, membership
        self.device = resolve_device(node.device)
        model_cfg = get_preset(run.preset, vocab_size=run.vocab_size)
        self.model = Transformer(model_cfg, seed=run.seed).to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.shard_names = shard_parameter_names(model_cfg, run.outer.stages)
        self.basis = None
        if run.uses_subspace:  # embedding = T_fixed + E_S, as on the virtual replicas (the FR stays unconstrained)
            self.basis = subspace_basis(model_cfg.d_model, run.pipeline.rank(model_cfg.d_model), run.seed)
            enable_subspace(self.model, self.basis.to(self.device))
        self.trainer = InnerTrainer(self.model, run.optim, run.total_inner_steps, self.device)
        self.val = val_batches(store, run.batch_size, run.seq_len, node.eval_batches)
        self.stop = membership.stop
        self.round = 0
        self.syncs: list[ShardSync] = []

    # ------------------------------------------------------------------------------------------------ helpers

    def shard_params(self, shard: int) -> list[torch.Tensor]:
        return shard_tensors(self.model, self.shard_names[shard])

    def _clone_shards(self) -> list[list[torch.Tensor]]:
        return [[p.detach().clone() for p in self.shard_params(s)] for s in range(len(self.syncs))]

    def shard_fingerprints(self) -> dict[str, str]:
        fixed = self.model.embed_fixed
        fps = {str(s): state_fingerprint(self.shard_params(s), fixed) for s in range(len(self.shard_names))}
        return fps if fixed is None else {**fps, FIXED: fingerprint([fixed])}

    @torch.no_grad()
    def set_shard(self, shard: int, tensors: list[torch.Tensor]) -> None:
        for param, value in zip(self.shard_params(shard), tensors, strict=True):
            param.copy_(value)

    def _announce(self, fingerprints: dict[str, str], **extra: Any) -> None:
        """Our record's progress part: the round we hold the start weights of, and their fingerprints (donors are
        checked against them)."""
        self.membership.update(round=self.round, fingerprints=fingerprints, **extra)

    def _replica_records(self, timeout: float = 5.0) -> dict[str, dict[str, Any]] | None:
        """Records of the run's full replicas (None: the DHT did not answer)."""
        records = self.runtime.read_records(timeout)
        return None if records is None else full_replicas(records)

    def _install_signal_handlers(self) -> None:
        """Ctrl-C / SIGTERM end the run after the current step; hivemind's averager ignores SIGINT otherwise."""

        def request_stop(signum: int, _frame: Any) -> None:
            logger.warning("signal %d: leaving the swarm after the current step", signum)
            self.stop.set()

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    # ---------------------------------------------------------------------------------------------- lifecycle

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> None:
        """Join, catch up, train every round, leave cleanly (no p2pd or child process left behind)."""
        try:
            shapes = [[tuple(p.shape) for p in self.shard_params(s)] for s in range(len(self.shard_names))]
            self.syncs = [
                ShardSync(self.runtime, self.run_cfg, s, shapes[s], self.timeouts) for s in range(len(shapes))
            ]
            fixed = self.model.embed_fixed
            self.states = ShardStates(
                self.runtime, dict(enumerate(shapes)), None if fixed is None else tuple(fixed.shape),
                self.timeouts.fetch_timeout_s,
            )  # fmt: skip
            self._install_signal_handlers()
            replica_id = self.node.replica_id
            if replica_id < 0:
                replica_id = int.from_bytes(self.runtime.peer_id.to_bytes()[-4:], "big")
            self.batches = ShardBatches(
                self.store, replica_id % self.run_cfg.data_shards, self.run_cfg.data_shards,
                self.run_cfg.batch_size, self.run_cfg.seq_len, self.run_cfg.seed,
            )  # fmt: skip
            self.metrics = MetricsWriter(
                self.node.metrics,
                {"peer_id": str(self.runtime.peer_id), "role": "full", "stage": None, "vr": None,
                 "replica_id": replica_id, "n_params": self.n_params, "run": self.run_cfg.to_dict()},
            )  # fmt: skip
            self._restore()
            self._wait_for_peers()
            while self.round < self.run_cfg.outer.rounds and not self.stop.is_set():
                self._catch_up()
                if self.round >= self.run_cfg.outer.rounds:
                    break
                record = self._one_round()
                if record is not None:
                    self.metrics.write(record)
                    if on_round is not None:
                        on_round(record)
            if not self.stop.is_set():  # serve the final state and our last payload to slower peers for a while
                self._publish_state()
                self._announce(self.shard_fingerprints())
                self.stop.wait(self.node.linger_s)
        finally:
            self.close()

    def close(self) -> None:
        """Leave the averaging groups; the runtime (DHT, p2pd) belongs to the caller."""
        for sync in self.syncs:
            sync.shutdown()

    # --------------------------------------------------------------------------------------- state & resync

    def _restore(self) -> None:
        """Resume from our checkpoint, then catch up with the swarm if it is ahead (late join or restart)."""
        if self.node.checkpoint_dir is not None:
            try:
                state = load_checkpoint(self.node.checkpoint_dir, self.run_cfg.run_id)
            except CheckpointError as e:
                logger.error("%s; loading the current state from peers instead", e)
                state = None
                if not self._load_from_peers(min_round=0):
                    raise CheckpointError(f"{e}, and no peer could provide the current state") from None
            if state is not None:
                self.model.load_state_dict(state["model"])
                self.trainer.load_state_dict(state["trainer"])
                for sync, sync_state in zip(self.syncs, state["syncs"], strict=True):
                    sync.load_state_dict(sync_state)
                self.round = int(state["round"])
                outer_state = fingerprint([t for sync in self.syncs for t in sync.outer_state_tensors()])
                logger.info("resumed from checkpoint at round %d (error feedback %s)", self.round, outer_state)
        self._catch_up()

    def _wait_for_peers(self, timeout_s: float = 300.0) -> None:
        """Start together: replicas that begin a run seconds apart would miss each other's first rounds."""
        self._announce(self.shard_fingerprints())
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            online = replica_count(self.runtime.read_records() or {}, self.run_cfg.outer.stages)
            if online >= self.node.min_peers:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "only %d of --min-peers %d replicas online; starting anyway", online, self.node.min_peers
                )
                return
            time.sleep(0.5)

    def _catch_up(self) -> None:
        """If the swarm is ahead of us (we joined late, restarted, or fell behind), load its newest state."""
        records = self._replica_records() or {}
        swarm_round = max((r.get("round", 0) for r in records.values()), default=0)
        if swarm_round > self.round:
            self._load_from_peers(min_round=swarm_round)

    def _publish_state(self) -> None:
        momentum = None if self.syncs[0].sparse else {s: sync.momentum for s, sync in enumerate(self.syncs)}
        tensors = {s: self.shard_params(s) for s in range(len(self.syncs))}
        self.states.publish(self.round, tensors, self.model.embed_fixed, momentum)

    def _load_from_peers(self, min_round: int, wait_s: float = 0.0) -> bool:
        """Download every shard at round ≥ min_round from a full replica whose advertised fingerprints it matches."""
        loaded = self.states.load(lambda: self._replica_records() or {}, min_round, wait_s, self.stop)
        if loaded is None:
            return False
        self.round, states = loaded
        for shard, state in states.items():
            self.set_shard(shard, state["tensors"])
            if "momentum" in state and not self.syncs[shard].sparse:
                for m, saved in zip(self.syncs[shard].momentum, state["momentum"], strict=True):
                    m.copy_(saved)
        if self.model.embed_fixed is not None:
            self.model.embed_fixed.copy_(states[0][FIXED])
        return True

    # ------------------------------------------------------------------------------------------------- a round

    def _one_round(self) -> RoundRecord | None:
        run, t = self.run_cfg, self.round
        start_fps = self.shard_fingerprints()
        self._publish_state()
        self._announce(start_fps)
        start = self._clone_shards()

        compute_start = time.perf_counter()
        self.trainer.step = t * run.outer.inner_steps  # LR schedule position is a function of the round
        losses = []
        for i in range(run.outer.inner_steps):
            if self.stop.is_set():
                return None
            x, y = self.batches.batch(t * run.outer.inner_steps + i)
            losses.append(self.trainer.train_step(x, y))
        compute_s = time.perf_counter() - compute_start
        train_loss = sum(losses) / len(losses)
        rate = run.outer.inner_steps * run.batch_size * run.seq_len / max(compute_s, 1e-9)
        self._announce(start_fps, loss=train_loss if math.isfinite(train_loss) else None, tokens_per_s=rate)

        comm_start = time.perf_counter()
        outcomes = self._outer_step(t, start, start_fps, compute_s)
        resynced = any(o.new_tensors is None for o in outcomes)
        if resynced:
            trained = self._clone_shards()
            for shard, shard_start in enumerate(start):  # roll back to θ(t), then fetch θ(t+1) or go solo
                self.set_shard(shard, shard_start)
            if not self._load_from_peers(min_round=t + 1, wait_s=self.timeouts.round_timeout_s):
                logger.warning("round %d: no peer reached round %d; applying my own contribution alone", t, t + 1)
                outcomes = self._solo_step(t, start, trained)
                resynced = False
        else:
            for shard, outcome in enumerate(outcomes):
                self.set_shard(shard, outcome.new_tensors)
            self._subspace_upkeep()
            self.round = t + 1
        comm_s = time.perf_counter() - comm_start

        eval_loss = None
        if self.round % self.node.eval_every == 0 or self.round >= run.outer.rounds:
            eval_loss = self.trainer.evaluate(self.val)
        if self.node.checkpoint_dir is not None:
            save_checkpoint(self.node.checkpoint_dir, self._checkpoint_state())
        group = max((o.group_size for o in outcomes), default=0)
        return RoundRecord(
            round=t,
            inner_steps=run.outer.inner_steps,
            tokens=run.outer.inner_steps * run.batch_size * run.seq_len,
            train_loss=train_loss,
            eval_loss=eval_loss,
            bytes_sent=sum(o.bytes_sent for o in outcomes),
            bytes_received=sum(o.bytes_received for o in outcomes),
            compute_s=compute_s,
            comm_s=comm_s,
            fingerprints=self.shard_fingerprints(),
            group_size=group,
            contributors=min((o.contributors for o in outcomes), default=0),
            dropped=[d for o in outcomes for d in o.dropped],
            resynced=resynced,
            dense_allreduce_bytes=int(2 * 4 * self.n_params * (group - 1) / group) if group > 1 else 0,
        )

    def _outer_step(
        self, t: int, start: list[list[torch.Tensor]], start_fps: dict[str, str], compute_s: float
    ) -> list[ShardOutcome]:
        """Run all shards' rounds concurrently: matchmaking for every shard starts before any result is awaited."""
        records = self.runtime.read_records()
        if records is not None and replica_count(records, len(self.syncs)) <= 1:  # no other replica is alive
            return self._solo_step(t, start, self._clone_shards())
        records = records or {}
        wait_s = max(self.timeouts.matchmaking_s, self.timeouts.straggler_fraction * compute_s)
        controls = []
        for shard, sync in enumerate(self.syncs):
            current = [p.detach() for p in self.shard_params(shard)]
            try:
                expected = expected_group_size(records, t, shard, len(self.syncs))
                controls.append(sync.begin(t, start[shard], current, start_fps[str(shard)], expected, wait_s))
            except PayloadError as e:
                logger.error("round %d shard %d: my pseudo-gradient is unusable (%s); skipping the round", t, shard, e)
                controls.append(None)

        def swarm_moved_on() -> bool:
            records = self.runtime.read_records(timeout=1.0) or {}
            return any(r.get("round", -1) > t for r in records.values())

        return [
            sync.finish(control, start[shard], swarm_moved_on)
            if control is not None
            else ShardOutcome(new_tensors=None)
            for shard, (sync, control) in enumerate(zip(self.syncs, controls, strict=True))
        ]

    def _solo_step(
        self, t: int, start: list[list[torch.Tensor]], trained: list[list[torch.Tensor]]
    ) -> list[ShardOutcome]:
        """Nobody else is in this round: the aggregate of one contribution (keeps the same update rule)."""
        outcomes = []
        for shard, sync in enumerate(self.syncs):
            try:
                outcomes.append(sync.solo(start[shard], trained[shard]))
            except HeteroNodeError as e:
                logger.error("round %d shard %d: %s; keeping θ(t)", t, shard, e)
                outcomes.append(ShardOutcome(new_tensors=[s.clone() for s in start[shard]]))
        for shard, outcome in enumerate(outcomes):
            self.set_shard(shard, outcome.new_tensors)
        self._subspace_upkeep()
        self.round = t + 1
        return outcomes

    def _subspace_upkeep(self) -> None:
        """After our own outer step: move the embedding's drift into T_fixed, as every peer of the run does."""
        if self.basis is not None and self.run_cfg.pipeline.drift_transfer:
            drift_transfer_(self.model, self.basis.to(self.device))

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_cfg.run_id,
            "round": self.round,
            "model": self.model.state_dict(),
            "trainer": self.trainer.state_dict(),
            "syncs": [sync.state_dict() for sync in self.syncs],
        }
