"""A full replica: holds the whole model, trains it locally, and takes part in every shard's outer round.

What is particular to it (the round loop itself is `replica.py`): the inner loop on its own data shard, time-boxed
by the round's deadline; the embedding's drift transfer after each outer step in a subspace run; evaluation of
θ(t+1) on the held-out batches; a checkpoint of θ(t+1), the optimizer and the outer method's state every round.
With `--overlap` it trains the next round while a round's exchange runs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.local.collective import mean_gradients
from hetero_node.client.local.devices import resolve_devices
from hetero_node.client.local.group import LocalGroup
from hetero_node.client.roles.loss_judge import LossJudge
from hetero_node.client.roles.measured_speed import MeasuredSpeed, save_speed, speed_key
from hetero_node.client.roles.replica import STEP_STRIDE, Replica, replica_number
from hetero_node.client.roles.round_record import Trained
from hetero_node.client.roles.schedule import RoundPlan
from hetero_node.client.swarm import view
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.data import ShardBatches, TokenStore, val_batches
from hetero_node.models.replica_model import full_model
from hetero_node.models.shards import shard_parameter_names, shard_tensors
from hetero_node.models.trainer import InnerTrainer, compile_wanted
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)


class FullReplica(Replica):
    """See the module docstring."""

    full_replica = True

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        store: TokenStore,
        timeouts: SyncTimeouts,
        runtime: PeerRuntime,
        membership: Membership,
    ) -> None:
        super().__init__(run, node, timeouts, runtime, membership, overlap=run.outer.overlap)
        devices = resolve_devices(node.device, node.devices)
        self.device = devices[0]
        self.model, self.basis = full_model(run, self.device)
        names = shard_parameter_names(self.model.cfg, run.outer.stages)
        self.params = {s: shard_tensors(self.model, shard_names) for s, shard_names in enumerate(names)}
        self.judge = LossJudge(self.model, names, store, run) if run.outer.admission == "loss" else None
        """Scores each round's messages under `--admission loss` (a copy of the model)."""
        compile = compile_wanted(node.compile, self.device)
        self.ranks = LocalGroup(run, devices, compile) if len(devices) > 1 else None
        """The node's other local ranks (`--devices`): this process is rank 0, the one the swarm sees."""
        self._trainer = InnerTrainer(
            self.model, run.optim, run.total_inner_steps, self.device, compile,
            gradient_hook=mean_gradients if self.ranks is not None else None,
        )  # fmt: skip
        self.replica_id = replica_number(node, runtime)
        self.batches = ShardBatches(
            store, self.replica_id % run.training_shards, run.data_shards, run.batch_size, run.seq_len, run.seed
        )
        self._trainer.warm_up(*self.batches.batch(0))  # compile before the first round, not inside its clock
        self.val = val_batches(store, run.batch_size, run.seq_len, node.eval_batches)
        self.speed_key = None if node.checkpoint_dir is None else speed_key(run, node, devices)
        """What our measured speed is kept beside the checkpoint for (None: no checkpoint directory)."""
        self.eval_s = 0.0
        """How long the last evaluation took (0: none yet)."""

    @property
    def fixed_table(self) -> Tensor | None:
        return self.model.embed_fixed

    @property
    def embedding(self) -> Tensor | None:
        return None if self.basis is None else self.start_embedding(self.model)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def trainer(self) -> InnerTrainer:
        return self._trainer

    def setup(self) -> None:
        super().setup()
        if self.judge is not None:
            for shard, sync in self.syncs.items():
                sync.loss_judge = self.judge.for_shard(shard, lambda: self.start)

    def metrics_header(self) -> dict[str, Any]:
        return {
            "peer_id": self.me,
            "role": ROLE_FULL,
            "stage": None,
            "vr": None,
            "replica_id": self.replica_id,
            "n_params": sum(p.numel() for p in self.model.parameters()),
        }

    def donors(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        return view.full_replicas(records)

    # ---------------------------------------------------------------------------------------------- training

    def train(self, plan: RoundPlan) -> Trained | None:
        """Inner AdamW steps on our data shard until the plan says stop, each accumulating `plan.accumulation`
        batches (on each local rank); the LR schedule advances H per round."""
        from hivemind.utils import get_dht_time

        if plan.sit_out:
            return None
        t, H, a = plan.round, self.run_cfg.outer.inner_steps, plan.accumulation
        world = 1 if self.ranks is None else self.ranks.world
        if self.ranks is not None:  # θ(t) and the optimizer as this rank holds them, on every rank
            self.ranks.sync(self.model, self.trainer.optimizer)
        losses: list[Tensor] = []
        compute_s, started, last_check = 0.0, time.perf_counter(), [time.monotonic()]
        # a step still running on the device ends about a step from now: the next one would end a step later
        while plan.keep_training(
            len(losses), get_dht_time() + self.trainer.in_flight * a * self.clock.step_s, self.clock.step_s
        ):
            if self.stop.is_set():
                return None
            step_started = time.perf_counter()
            self.trainer.step = t * H + min(len(losses), H - 1)  # the schedule's position is a function of the round
            first = t * STEP_STRIDE + len(losses) * a * world
            losses.append(self.train_step([self.batches.batch(first + j) for j in range(a * world)]))
            if self.clock.step_s <= 0:  # the run's first step: wait for it, it is about to be timed alone
                self.trainer.synchronize()
            if self.node.step_delay_s:
                time.sleep(self.node.step_delay_s * a)
            step_s = time.perf_counter() - step_started
            compute_s += step_s
            if self.clock.step_s <= 0:  # the first step of the run: a first estimate for the deadline check
                self.clock.record_speed(a, step_s)
            flight = self.in_flight
            plan = self.between_steps(plan, last_check)  # may settle an overlapped round: not compute time
            if self.ranks is not None and self.in_flight is not flight:  # it did: θ changed here, not there
                self.ranks.sync(self.model, self.trainer.optimizer)
        step_started = time.perf_counter()
        self.trainer.synchronize()  # the last step's device time is compute time too
        compute_s += time.perf_counter() - step_started
        loss = sum(torch.stack(losses).tolist()) / len(losses) if losses else None
        tokens = len(losses) * a * world * self.run_cfg.batch_size * self.run_cfg.seq_len
        tokens_per_s = round(tokens / max(compute_s, 1e-9), 1)
        self.announce(
            train_round=t, loss=loss if loss is not None and math.isfinite(loss) else None, tokens_per_s=tokens_per_s
        )
        if self.speed_key is not None and self.node.checkpoint_dir is not None and tokens and self.clock.step_s > 0:
            save_speed(self.node.checkpoint_dir, self.speed_key, MeasuredSpeed(tokens_per_s, self.clock.step_s))
        return Trained(len(losses), tokens, loss, compute_s, time.perf_counter() - started, a)

    def train_step(self, batches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One inner step on `batches`: here, or split over the node's local ranks."""
        if self.ranks is None:
            return self.trainer.train_accumulated(batches)
        return self.ranks.step(self.trainer, batches)

    def close(self) -> None:
        super().close()
        if self.ranks is not None:
            self.ranks.close()

    def upkeep(self, new_round: int) -> bool:
        """After our own outer step: move the embedding's drift into T_fixed, as every peer of the run does."""
        if self.basis is not None and self.run_cfg.pipeline.drift_transfer:
            self.transfer_drift(self.model, self.basis.to(self.device))
        return True

    def behind_schedule(self, round_: int, extra_s: float) -> bool:
        """Whether spending `extra_s` now would leave too little time to train the minimum steps of `round_`
        before the deadline other replicas already announced for it (the round is then under way without us)."""
        from hivemind.utils import get_dht_time

        records = self.records(timeout=1.0)
        announced = [r.deadline for pid, r in records.items() if pid != self.me and r.train_round == round_]
        announced = [d for d in announced if d > 0]
        needed = extra_s + self.run_cfg.outer.min_inner_steps * self.clock.step_s
        return bool(announced) and get_dht_time() + needed > min(announced)

    def evaluate(self, round_: int, trained: bool) -> float | None:
        """Held-out loss of θ(t+1), when due, unless it would make us miss the next round's deadline: every full
        replica evaluates the same weights, so a slow one that is behind the schedule leaves it to the others."""
        due = (round_ + 1) % self.node.eval_every == 0 or round_ + 1 >= self.run_cfg.outer.rounds
        if not due:
            return None
        if self.behind_schedule(round_ + 1, self.eval_s):
            logger.info("round %d: skipping the evaluation (%.1f s) to make the next deadline", round_, self.eval_s)
            return None
        started = time.perf_counter()
        loss = self.trainer.evaluate(self.val)
        self.eval_s = time.perf_counter() - started
        return loss
