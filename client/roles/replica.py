"""The round loop every replica runs, a full replica or one stage of a virtual replica, top to bottom:

    catch up if the swarm is ahead → plan round t (its deadline) → train until the deadline → contribute Δ to every
    held shard's group → settle: θ(t+1) from the group, else from the round's messages, else from a peer's state
    → upkeep (subspace), publish, eval, checkpoint, metrics

A role supplies only what differs (`train`, `upkeep`, `evaluate`, who may serve its shards); the rest is written
once: the loop and a round's end here, and parts of `Replica` written apart in their own files: the held θ(t), its
record, served state and checkpoint (`held_state.py`), our Δ and its group (`contribution.py`), catching up
(`catch_up_driver.py`); a round's bookkeeping and metrics line are `round_record.py`, the overlap's `overlap.py`.

State: `start[s]` is θ(t) of each held shard, the weights every member of round t agrees on (their fingerprints
are what records advertise and groups compare); the live parameters are the local weights that train.

Overlap (`--overlap`, full replicas): round t's exchange runs in worker threads while round t+1 already trains;
θ(t+1) then goes under the local progress made meanwhile (`overlap.py`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.outer.shard_state import ShardStates
from hetero_node.client.outer.shard_sync import ShardSync
from hetero_node.client.roles.catch_up_driver import CatchingUp
from hetero_node.client.roles.checkpoint import CheckpointWriter
from hetero_node.client.roles.contribution import Contributing
from hetero_node.client.roles.held_state import HeldState
from hetero_node.client.roles.leaving import leave_on_signals
from hetero_node.client.roles.metrics import MetricsWriter, RoundRecord, round_summary
from hetero_node.client.roles.overlap import local_progress, rebase
from hetero_node.client.roles.round_record import InFlight, Settled, Trained, round_record
from hetero_node.client.roles.schedule import RoundClock, RoundPlan
from hetero_node.client.swarm import view
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.subspace import drift_transfer_, embedding_change
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.errors import DaemonError
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)

DEADLINE_REFRESH_S = (0.25, 2.0)
"""While training, re-read the records every quarter of a round, within these bounds (seconds), to adopt an
earlier deadline of the round."""
STEP_STRIDE = 1 << 20
"""Batch index of inner step i of round t: t·STEP_STRIDE + i (unique however many steps a round has)."""
MAX_BACK_OFF_S = 5.0
"""Longest wait before planning again after rounds whose result nobody served us yet."""


def replica_number(node: NodeConfig, runtime: PeerRuntime) -> int:
    """This replica's data shard index: --replica-id, or a number derived from the peer id."""
    return node.replica_id if node.replica_id >= 0 else int.from_bytes(runtime.peer_id.to_bytes()[-4:], "big")


class Replica(HeldState, Contributing, CatchingUp, ABC):
    """A replica's life in the swarm (see the module docstring); `run()` blocks until the run ends."""

    full_replica = False
    """This role holds the whole model: its overhead is one of those that size rounds (`RoundClock.full`)."""

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        timeouts: SyncTimeouts,
        runtime: PeerRuntime,
        membership: Membership,
        overlap: bool,
    ) -> None:
        self.run_cfg, self.node, self.timeouts = run, node, timeouts
        self.runtime, self.membership, self.stop = runtime, membership, membership.stop
        self.me = str(runtime.peer_id)
        self.overlap = overlap
        self.round = 0
        self.certified = 0
        """The latest round whose θ we hold from a certified round (or from peers that did); see `PeerRecord`."""
        self.clock = RoundClock(
            run.outer, timeouts.matchmaking_s, timeouts.straggler_fraction, cadence=overlap, full=self.full_replica
        )
        self.params: dict[int, list[Tensor]] = {}
        """The live parameter tensors of every shard this replica holds (the role fills it in)."""
        self.syncs: dict[int, ShardSync] = {}
        self.start: dict[int, list[Tensor]] = {}
        self._fingerprints: dict[str, str] = {}
        self.embed_change: tuple[Tensor, Tensor] | None = None
        """The entries of E_S the last outer step changed (subspace runs), served to later stages."""
        self.in_flight: InFlight | None = None
        self.trained_until: tuple[int, float, float] | None = None
        """(round, perf_counter time, its `Trained.idle_s` plus its planning) at which this replica's last training
        ended: the next round's overhead (`RoundClock.record_overhead`) is measured from it."""
        self.checkpoints: CheckpointWriter | None = None
        self.failed_settles = 0
        """Rounds in a row whose result we could not get though others are ahead: we wait before trying again."""
        self.on_round: Callable[[RoundRecord], None] | None = None
        self._served_mark = 0
        self.apply_phases_s: dict[str, float] = {}
        """Seconds the last `apply` spent applying, evaluating and checkpointing (`RoundRecord.phases_s`)."""
        self.upkeep_fallback: str | None = None
        """How the last `apply` ended when the round's upkeep failed: "state" (a peer's state replaced θ(t+1)), or
        "failed" (no state came either: we hold θ(t) again and catch up later); None when the upkeep ran."""
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=run.outer.stages, thread_name_prefix="outer")

    # ------------------------------------------------------------------------------------------- role hooks

    @property
    @abstractmethod
    def fixed_table(self) -> Tensor | None:
        """T_fixed in a subspace run (part of every shard's state and fingerprint), else None."""

    @property
    def embedding(self) -> Tensor | None:
        """E_S of θ(t), where this peer holds it or a copy (subspace runs), as a tensor nobody writes into; else
        None."""
        return None

    @abstractmethod
    def train(self, plan: RoundPlan) -> Trained | None:
        """Inner steps of round `plan.round` until the plan says stop (calling `between_steps` after each);
        None when this replica does not train the round (`plan.sit_out`, or it could not): it then receives the
        round's result."""

    @abstractmethod
    def upkeep(self, new_round: int) -> bool:
        """After θ(t+1) is in the parameters: the subspace upkeep every peer does; False when it failed."""

    @abstractmethod
    def evaluate(self, round_: int, trained: bool) -> float | None:
        """Held-out loss of θ(t+1) after round `round_` (None when this peer does not compute it, or eval is not
        due); `trained`: whether this replica trained the round (a virtual replica that did not skips its eval
        pass, all stages alike)."""

    @abstractmethod
    def donors(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """The peers whose certified rounds say whether the swarm is ahead of us (`catch_up`, with the holders of
        our shards): full replicas for a full replica, the stage's holders for a stage peer."""

    @abstractmethod
    def metrics_header(self) -> dict[str, Any]:
        """The metrics file's header: role, stage, vr, replica id, parameters."""

    def deltas(self, shard: int) -> list[Tensor]:
        """Δ = θ(t) − θ_local of a shard (a virtual replica measures it from its projected start)."""
        return [s - p.detach() for s, p in zip(self.start[shard], self.params[shard], strict=True)]

    def start_embedding(self, module: torch.nn.Module) -> Tensor | None:
        """E_S of θ(t) on a peer holding it (stage 0, a full replica): the start point's copy of `embed.weight`,
        never written in place, so it can be served and fingerprinted without another copy."""
        if 0 not in self.start:  # before the first start point is taken
            return None
        weight = module.embed.weight
        return next(s for s, p in zip(self.start[0], self.params[0], strict=True) if p is weight)

    @torch.no_grad()
    def transfer_drift(self, module: torch.nn.Module, basis: Tensor) -> None:
        """Upkeep on a peer holding E_S (stage 0, a full replica): note which entries of E_S the outer step changed
        since θ(t), served to later stages so they rebuild T_fixed(t+1) without the table, then move the drift."""
        self.embed_change = embedding_change(self.start_embedding(module), module.embed.weight)
        drift_transfer_(module, basis)

    def tables_move(self, void: frozenset[int]) -> bool:
        """Whether the subspace upkeep runs after a round whose `void` shards nobody completed: on a peer holding
        the embedding (shard 0), only when shard 0's round was not void."""
        return 0 not in void

    def round_extras(self) -> dict[str, Any]:
        """Role-specific fields of the round's metrics (pipeline boundary bytes)."""
        return {}

    def checkpoint_extras(self) -> dict[str, Any]:
        """Role-specific state to checkpoint besides the module, optimizer and outer state."""
        return {}

    def restore_extras(self, state: dict[str, Any]) -> None:
        """Take back `checkpoint_extras` from a checkpoint being resumed (it may predate them)."""
        return None

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The trained module (the whole model, or this stage's layers)."""

    @property
    @abstractmethod
    def trainer(self) -> InnerTrainer:
        """The module's inner optimizer."""

    def slot(self) -> list[int]:
        """Which part of the model this replica holds (a checkpoint only resumes the same part)."""
        return sorted(self.syncs)

    # -------------------------------------------------------------------------------------------- the loop

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> None:
        """Join, catch up, train every round, leave cleanly (the runtime, DHT and p2pd, belongs to the caller)."""
        self.on_round = on_round
        try:
            self.setup()
            self.restore()
            self.wait_for_peers()
            rounds = self.run_cfg.outer.rounds
            while not self.stop.is_set() and self.keep_serving():
                if self.check_daemon() or self.back_off():
                    break
                if self.in_flight is None:
                    self.catch_up()
                t = self.round + (self.in_flight is not None)  # under overlap, the round after the one in flight
                if t >= rounds:
                    self.settle(wait=True)
                    break
                self.measure_overhead(t)
                planning = time.perf_counter()
                plan = self.plan(t)
                planning = time.perf_counter() - planning
                trained = self.train(plan)
                self.trained_until = None if trained is None else (t, time.perf_counter(), trained.idle_s + planning)
                if self.stop.is_set():
                    break
                self.settle(wait=True)  # Δ is measured from θ(t): round t−1's result must be in
                if self.round != t:  # the swarm moved past the round we trained: that work is stale
                    continue
                self.contribute(plan, trained)
                if not self.overlap:
                    self.settle(wait=True)
            self.linger()
        finally:
            self.close()

    def check_daemon(self) -> bool:
        """Stop the node with a clear error when p2pd died (pitfall K), unless it went down because we are leaving:
        a signal to our whole process group takes p2pd down just as it tells us to leave. Returns whether the node
        is leaving."""
        try:
            self.runtime.ensure_daemon()
        except DaemonError:
            if self.stop.wait(1.0):
                return True
            raise
        return False

    def back_off(self) -> bool:
        """After rounds whose result nobody served us yet (others are ahead, their messages and states not in
        reach), wait before planning again, longer each time (0.5 s to `MAX_BACK_OFF_S`): planning at once only
        sits the next round out as well, in a loop. Returns whether the node is leaving."""
        if not self.failed_settles:
            return False
        return self.stop.wait(min(MAX_BACK_OFF_S, 0.5 * 2 ** (self.failed_settles - 1)))

    def measure_overhead(self, t: int) -> None:
        """What round t − 1 cost outside training: from the end of its training to now, the start of round t's
        planning (settling, exchange, outer step, catch-up), plus its own planning (a records read and an announce:
        this round's comes after the measure) and what its training loop spent not training (under --overlap the
        previous round settles between steps). Only between consecutive rounds we trained."""
        if self.trained_until is not None and self.trained_until[0] == t - 1:
            _, ended, idle_s = self.trained_until
            self.clock.record_overhead(time.perf_counter() - ended + idle_s)

    def linger(self) -> None:
        """Serve the final state and messages to slower peers before leaving: at least --linger-s, and on while
        they still fetch (up to the fetch deadline), since leaving mid-transfer would truncate theirs."""
        started = time.monotonic()
        self.stop.wait(self.node.linger_s)
        deadline = started + self.node.linger_s + self.timeouts.fetch_timeout_s
        while (
            not self.stop.is_set() and time.monotonic() < deadline and self.runtime.served_since(time.monotonic() - 2)
        ):
            self.stop.wait(0.5)

    def keep_serving(self) -> bool:
        """Whether to run another round (a stage peer stops when its slot was reassigned)."""
        return self.round < self.run_cfg.outer.rounds or self.in_flight is not None

    def setup(self) -> None:
        """Each shard's round transport, state blobs, signal handlers and the metrics file."""
        shapes = {s: [tuple(p.shape) for p in tensors] for s, tensors in self.params.items()}
        self.syncs = {
            s: ShardSync(self.runtime, self.run_cfg, s, shape, self.timeouts, self.stop, self.params[s][0].device)
            for s, shape in shapes.items()
        }
        leave_on_signals(self.stop)
        fixed = self.fixed_table
        self.states = ShardStates(
            self.runtime, shapes, None if fixed is None else tuple(fixed.shape), self.timeouts.fetch_timeout_s,
            self.membership.record.download_mbps,
        )  # fmt: skip
        self.metrics = MetricsWriter(self.node.metrics, {**self.metrics_header(), "run": self.run_cfg.to_dict()})
        self.adopt_start()

    def close(self) -> None:
        """Stop the round workers and write the last checkpoint before the node exits."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.checkpoints is not None:
            self.checkpoints.close()

    def wait_for_peers(self, timeout_s: float = 300.0) -> None:
        """Start together: replicas that begin a run seconds apart would miss each other's first rounds. A peer
        counts once its record advertises fingerprints: it has built (and compiled) its model, which takes a GPU
        peer up to a minute after it claimed its role; stage peers that started without it trained alone."""
        self.announce()
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            ready = {pid: r for pid, r in self.records().items() if r.fingerprints}
            online = view.replica_count(ready, self.run_cfg.outer.stages)
            if online >= self.node.min_peers:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "only %d of --min-peers %d replicas online; starting anyway", online, self.node.min_peers
                )
                return
            time.sleep(0.5)

    # ----------------------------------------------------------------------------------------------- round

    def plan(self, t: int) -> RoundPlan:
        """Round t's deadline and step limits; announced so the round's other replicas can adopt it."""
        from hivemind.utils import get_dht_time

        # a round no certificate came before is decided unanimously: its members wait up to --round-timeout-s for
        # every live member's statement (`ShardSync.begin`), so one late by seconds still trains and states. Sitting
        # it out instead voids it for them, and the two sides of a void leapfrog (the killed-replica test: a restart
        # loaded a void round's state 6 s into a 2 s round, sat it out, and the survivor waited 20 s for it; then the
        # other way round, every round to the end)
        waited = self.timeouts.round_timeout_s if all(s.certificate is None for s in self.syncs.values()) else 0.0
        plan = self.clock.plan(t, self.records(), self.me, get_dht_time(), waited, self.runtime.store_s)
        self.announce(
            train_round=t,
            deadline=plan.deadline or 0.0,
            step_s=round(self.clock.step_s, 4),
            overhead_s=round(self.clock.overhead_s, 4),
        )
        if plan.sit_out:
            logger.warning(
                "round %d: too late to train %d steps before its deadline; receiving only", t, plan.min_steps
            )
        return plan

    def between_steps(self, plan: RoundPlan, last_check: list[float]) -> RoundPlan:
        """Called by `train` after each inner step: settle an overlapped round whose result arrived, and adopt an
        earlier deadline another replica announced. Returns the (possibly tightened) plan."""
        self.settle(wait=False)
        low, high = DEADLINE_REFRESH_S
        if time.monotonic() - last_check[0] > min(high, max(low, (plan.length_s or high) / 4)):
            last_check[0] = time.monotonic()
            refreshed = self.clock.refresh(plan, self.records(timeout=1.0), self.me)
            if refreshed.deadline != plan.deadline:
                self.announce(train_round=plan.round, deadline=refreshed.deadline or 0.0)
            return refreshed
        return plan

    def settle(self, wait: bool) -> None:
        """Finish the round in flight (if its workers are done, or `wait`): θ(t+1) from the group, else from the
        round's messages, else from a peer's state, else (nobody completed it) θ(t) again; then the metrics."""
        flight = self.in_flight
        if flight is None or (not wait and not flight.done()):
            return
        self.in_flight = None
        waited = time.perf_counter()
        outcomes = {s: future.result() for s, future in flight.futures.items()}
        flight.wait_s += time.perf_counter() - waited
        progress = local_progress(self.params, flight.cutoff)  # before θ(t+1) or a state is written into them
        settled = Settled(outcomes)
        if self.stop.is_set():  # leaving: the checkpoint keeps θ(t) and the error feedback as they were
            for shard, pending in flight.pendings.items():
                self.syncs[shard].drop(pending)
            return
        new = {s: o.new_tensors for s, o in outcomes.items() if o.new_tensors is not None}
        missing = [s for s in self.syncs if s not in new]
        void: frozenset[int] = frozenset()
        if missing:
            how, size, rebuilt = self.obtain(flight, missing)
            self.failed_settles = self.failed_settles + 1 if how == "failed" else 0
            settled.caught_up, settled.catch_up_bytes = how, size
            void = frozenset(s for s, got in rebuilt.items() if not got.digests)  # as we saw it, or its members
            for shard, got in rebuilt.items():
                new[shard] = got.tensors
                pending = flight.pendings.get(shard)
                if shard in outcomes:  # a shard we trained this round (a stage peer may rebuild one it did not)
                    outcomes[shard].contributors = len(got.digests)  # what the round aggregated, by its manifest
                if pending is not None and got.digests.get(self.me) == pending.meta.digest != "":
                    outcomes[shard].contributed = True  # the group used our message though we missed its end
                    outcomes[shard].deferred = False
            if how in ("state", "failed", "behind"):  # a state replaced ours, or we stay in round t for catch-up
                self.drop_unused(flight, outcomes)
                if how == "state":  # a state of round t+1 or later: recorded under the round that led to it
                    rebase(self.params, progress)
                self.record_round(self.round - 1 if how == "state" else flight.round, flight, None, settled)
                return
        else:
            self.failed_settles = 0
        self.drop_unused(flight, outcomes)
        cut_off = settled.caught_up == "void" and void == set(self.syncs)
        eval_loss = self.apply(new, flight.round + 1, flight, progress=progress, void=void, cut_off=cut_off)
        settled.phases_s = self.apply_phases_s
        recorded = flight.round
        if self.upkeep_fallback == "failed":
            self.failed_settles += 1
        elif self.upkeep_fallback == "state":  # what we hold is a later round's state: recorded as that round's
            recorded = self.round - 1
        settled.caught_up = self.upkeep_fallback or settled.caught_up
        self.record_round(recorded, flight, eval_loss, settled)

    def apply(
        self,
        new: dict[int, list[Tensor]],
        new_round: int,
        flight: InFlight | None = None,
        caught_up: tuple[str, int] | None = None,
        progress: dict[int, list[Tensor]] | None = None,
        void: frozenset[int] = frozenset(),
        cut_off: bool = False,
    ) -> float | None:
        """Make θ(t+1) ours: parameters, subspace upkeep, start point, record, served state; eval and checkpoint
        it; then put back `progress`, the local progress made since the deadline (overlap). Returns the eval loss.

        `void`: shards whose round nobody completed (they keep θ(t)), as we saw it or as the round's members served
        it (a void manifest is a void round, rebuilt or not). T_fixed follows shard 0's round alone (the embedding's;
        `tables_move`): a round certified for shard 0 and void for shard 1 moves it exactly as on a stage 0 peer,
        which holds shard 0 alone. Our certified round moves unless we voided every shard ourselves (`cut_off`: we
        may be the cut-off side, which catches up from its certified round): a replica that certified shard 0 and
        voided shard 1 must say so, or a member catching up finds no donor for shard 1's void round.

        A round rebuilt while catching up (`caught_up`: how, and the bytes it cost) is recorded here, and not
        evaluated: the other stages of a virtual replica are not in an eval pass then."""
        started = time.perf_counter()
        for shard, tensors in new.items():
            self.set_params(shard, tensors)
            if caught_up is not None:  # rebuilt from a donor's set, not ours: nothing of ours to heal
                self.syncs[shard].applied = None
        if not self.tables_move(void):  # a void round moved nothing: θ(t) and T_fixed(t) stay as they were
            self.embed_change = None
        elif not self.upkeep(new_round):
            loaded = self.load_state(min_round=new_round, wait_s=self.timeouts.round_timeout_s) is not None
            self.upkeep_fallback = "state" if loaded else "failed"
            if not loaded:  # θ(t+1) without its tables is nobody's state: back to θ(t), caught up later
                for shard, tensors in self.start.items():
                    self.set_params(shard, tensors)
            rebase(self.params, progress)
            return None
        self.upkeep_fallback = None
        self.adopt_start()
        self.round = new_round
        if not cut_off:  # a void shard's θ(t) is what every member that completed the round holds of it too
            self.certified = new_round
        self.publish_state()
        self.announce()
        applied = time.perf_counter()
        trained = flight is not None and flight.trained is not None
        eval_loss = self.evaluate(new_round - 1, trained) if caught_up is None else None
        evaluated = time.perf_counter()
        self.checkpoint()
        rebase(self.params, progress)
        self.apply_phases_s = {
            "apply": applied - started,
            "eval": evaluated - applied,
            "checkpoint": time.perf_counter() - evaluated,
        }
        if caught_up is not None:
            settled = Settled(caught_up=caught_up[0], catch_up_bytes=caught_up[1], phases_s=self.apply_phases_s)
            self.record_round(new_round - 1, None, eval_loss, settled)
        return eval_loss

    def _bytes_sent_since_last_record(self) -> int:
        """Blob bytes we served since the previous round's record: our messages as the others fetched them (at
        their pace: a message may be fetched after our record of its round), manifests, states for catch-up."""
        total = self.runtime.bytes_served_total
        sent, self._served_mark = total - self._served_mark, total
        return sent

    def record_round(self, round_: int, flight: InFlight | None, eval_loss: float | None, settled: Settled) -> None:
        """Write the round's metrics line, announce its summary and hand it to the caller's callback."""
        record = round_record(
            round_, flight, eval_loss, settled,
            n_params=sum(p.numel() for ps in self.params.values() for p in ps),
            bytes_sent=self._bytes_sent_since_last_record(), fingerprints=self.fingerprints(),
            overhead_s=self.clock.overhead_s, extras=self.round_extras(),
        )  # fmt: skip
        self.metrics.write(record)
        self.announce(last_round=round_summary(record))
        if self.on_round is not None:
            self.on_round(record)
