"""A pipeline-stage peer: one stage of a virtual replica (VR), trained through the pipeline and averaged in its
shard's group together with the full replicas (the VR counts as one replica there, with its own error feedback).

What is particular to it (the round loop itself is `replica.py`, the GPipe schedule `pipeline_schedule.py`):

1. Optionally project the start point θ_s(t) into the subspace; the pseudo-gradient is measured from there, and
   the group's update applies to the unprojected θ(t) like every member's.
2. Wait for the pipeline: stage 0 until every stage of its VR holds round t, later stages for stage 0's first
   message (or its END). Meanwhile a stage whose VR lacks a stage says so once, and gives the round up when the
   round's deadline passes, or at once when a sibling stage holds a later round (it gave round t up: waiting for it
   there, a restarted stage chased its sibling one round behind for as long as the run lasted).
3. Inner steps: stage 0 drives until the round's deadline and ends the round with the step count; the others
   serve until that END. A stage that hears nothing for `stage_timeout_s`, sees a neighbour's record vanish, or
   has a message refused gives up the round (a clear log line, never a hang) and receives the round's result.
4. Upkeep after the outer step: stage 0 moves the embedding's drift into T_fixed; later stages do the same on
   their copy of E_S, updated with the entries the step changed that a peer serves (or fetch both tables whole
   when they have no current copy), checked against the fingerprints the round's peers vouch for. Then the eval
   pass.

Stage peers do not overlap rounds (`--overlap` is for full replicas): the boundary codec needs every stage of a
VR to hold the same T_fixed at every step, which an outer step landing between two steps would break.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.outer.shard_state import EMBED, FIXED
from hetero_node.client.roles.pipeline_schedule import PipelineAborted, PipelineSchedule
from hetero_node.client.roles.pipeline_stage import PipelineStage
from hetero_node.client.roles.replica import STEP_STRIDE, Replica, replica_number
from hetero_node.client.roles.round_record import Trained
from hetero_node.client.roles.schedule import RoundPlan
from hetero_node.client.roles.stage_link import Expectation, StageInbox, StageSender, microbatch_sizes, wire
from hetero_node.client.swarm import view
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, val_batches
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.subspace import apply_embedding_change, transferred_table
from hetero_node.models.trainer import InnerTrainer, resolve_device
from hetero_node.protocol.flat_exchange import slow_uplink_below
from hetero_node.protocol.keys import stage_handler_name
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_STAGE
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)

MAX_STEPS_FACTOR = 64
"""Without --max-inner-steps, a stage accepts step indices up to this many times H (anything above is garbage)."""


def table_donors(donors: Mapping[str, float], holders: Mapping[str, float], me: str) -> list[str]:
    """The order in which a later stage asks `donors` (id → advertised upload) for T_fixed's upkeep: those not on
    slow uplinks among the shard-0 `holders` (`slow_uplink_below`; later stages that already hold the table may be
    donors too, and most of them may be home nodes) first, each fetcher in its own order (a hash of both ids) so the
    fast ones share the load. Its own stage 0 first, as before, made a home stage 0 upload 47 MB of changes to each
    of its three later stages a round at 40 Mbit/s (the cost model, `1b` at rank 48): 28 s before its pipeline
    could train again."""
    below = slow_uplink_below(holders, list(holders))

    def spread(pid: str) -> bytes:
        return hashlib.blake2b(f"{me}/{pid}".encode(), digest_size=8).digest()

    return sorted(donors, key=lambda pid: (donors[pid] < below, spread(pid)))


class StagePeer(Replica):
    """See the module docstring. `run()` returns at the run's end, on a stop signal, or when the slot is lost."""

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        store: TokenStore,
        timeouts: SyncTimeouts,
        runtime: PeerRuntime,
        membership: Membership,
    ) -> None:
        super().__init__(run, node, timeouts, runtime, membership, overlap=False)
        self.vr, self.index = membership.slot
        if run.outer.admission == "loss":
            logger.warning("this run counts only messages its full replicas admit by loss (--admission loss); a "
                           "pipeline stage cannot score a step alone and casts no verdict, so a shard group decides "
                           "its rounds only while full replicas are more than half of it")  # fmt: skip
        self.stage = PipelineStage(run, self.index, resolve_device(node.device))
        cfg = get_preset(run.preset, vocab_size=run.vocab_size)
        names = shard_parameter_names(cfg, run.outer.stages)[self.index]
        self.params = {self.index: shard_tensors(self.stage.module, names)}
        sizes = microbatch_sizes(run.batch_size, run.pipeline.microbatches)
        max_steps = run.outer.max_inner_steps or MAX_STEPS_FACTOR * run.outer.inner_steps
        self.inbox = StageInbox(self.stage.fmt, max_steps, sizes, run.seq_len, run.batch_size)
        self.schedule = PipelineSchedule(
            runtime, self.stage, self.inbox, StageSender(runtime, run.run_id), self.vr, self.index,
            run.outer.stages, sizes, run.seq_len, timeouts.stage_timeout_s, self.stop.is_set,
        )  # fmt: skip
        self.train_start: list[Tensor] = []
        self._table_bytes_seen = 0
        if self.stage.first:
            self.replica_id = replica_number(node, runtime)
            self.batches = ShardBatches(
                store, self.replica_id % run.training_shards, run.data_shards, run.batch_size, run.seq_len, run.seed
            )
            self.val = val_batches(store, run.batch_size, run.seq_len, node.eval_batches)

    @property
    def fixed_table(self) -> Tensor | None:
        return self.stage.fixed_table

    @property
    def embedding(self) -> Tensor | None:
        if self.stage.basis is None:
            return None
        return self.start_embedding(self.stage.module) if self.stage.first else self.stage.embedding

    @property
    def module(self) -> torch.nn.Module:
        return self.stage.module

    @property
    def trainer(self) -> InnerTrainer:
        return self.stage.trainer

    def slot(self) -> list[int]:
        return [self.vr, self.index]

    def metrics_header(self) -> dict[str, Any]:
        return {
            "peer_id": self.me,
            "role": ROLE_STAGE,
            "stage": self.index,
            "vr": self.vr,
            "n_params": sum(p.numel() for p in self.params[self.index]),
        }

    def donors(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        return view.shard_donors(records, self.index)

    def round_extras(self) -> dict[str, Any]:
        b = self.schedule.boundary
        table_bytes, self._table_bytes_seen = self.states.table_bytes - self._table_bytes_seen, self.states.table_bytes
        return {"boundary_bytes_sent": b.sent, "boundary_bytes_received": b.received, "boundary_tokens": b.tokens,
                "table_bytes_received": table_bytes}  # fmt: skip

    # ---------------------------------------------------------------------------------------------- lifecycle

    def setup(self) -> None:
        handler = stage_handler_name(self.run_cfg.run_id)
        self.runtime.run(
            self.runtime.p2p.add_protobuf_handler(handler, self.inbox.handle, wire.StagePiece, stream_input=True)
        )
        super().setup()

    def close(self) -> None:
        super().close()
        with contextlib.suppress(Exception):  # p2pd may already be gone (a signal to the whole process group)
            handler = stage_handler_name(self.run_cfg.run_id)
            self.runtime.run(self.runtime.p2p.remove_protobuf_handler(handler, stream_input=True), timeout=5)

    def keep_serving(self) -> bool:
        if self.membership.slot != (self.vr, self.index):
            logger.warning("slot vr %d stage %d was reassigned; leaving it", self.vr, self.index)
            return False
        return super().keep_serving()

    # ----------------------------------------------------------------------------------------------- training

    def deltas(self, shard: int) -> list[Tensor]:
        """Δ from the projected start the pipeline trained from; the update applies to θ(t) itself."""
        return [s - p.detach() for s, p in zip(self.train_start, self.params[shard], strict=True)]

    def train(self, plan: RoundPlan) -> Trained | None:
        t, H = plan.round, self.run_cfg.outer.inner_steps
        if self.run_cfg.pipeline.project_start:
            self.stage.project()
        self.train_start = [p.detach().clone() for p in self.params[self.index]]
        if not self.wait_for_pipeline(plan):
            return None
        self.schedule.lr = (t * H, H)
        started = time.perf_counter()
        try:
            if self.stage.first:
                steps = self.schedule.drive(t, self._round_batches(t), self._more(plan), plan.accumulation)
                losses: list[float] = []
            else:
                steps, losses = self.schedule.serve(t)
        except PipelineAborted as e:
            logger.error("vr %d round %d: %s; this virtual replica does not contribute this round", self.vr, t, e)
            self.stage.reset()
            return None
        compute_s = time.perf_counter() - started
        if steps == 0:
            logger.warning("vr %d round %d: the virtual replica sits this round out", self.vr, t)
            return None
        loss = sum(losses) / len(losses) if losses else None
        if loss is not None:
            self.announce(train_round=t, loss=loss if math.isfinite(loss) else None)
        batches = self.schedule.batches  # stage 0's accumulation, as its forwards said
        tokens = batches * self.run_cfg.batch_size * self.run_cfg.seq_len
        # a stage's compute is the pipeline's wall time
        return Trained(steps, tokens, loss, compute_s, compute_s, accumulation=max(1, batches // steps))

    def _round_batches(self, t: int) -> Callable[[int], tuple[Tensor, Tensor]]:
        """Stage 0's k-th batch of round t (indices as a full replica's: unique however many a round has)."""
        return lambda k: self.batches.batch(t * STEP_STRIDE + k)

    def _more(self, plan: RoundPlan) -> Any:
        """Stage 0's step decision: the plan's, with the deadline refreshed between steps."""
        from hivemind.utils import get_dht_time

        current, last_check = [plan], [time.monotonic()]
        if plan.sit_out:
            return lambda steps: False

        def more(steps: int) -> bool:
            if steps and self.node.step_delay_s:
                time.sleep(self.node.step_delay_s)
            if steps:
                current[0] = self.between_steps(current[0], last_check)
            if steps == 1 and self.clock.step_s <= 0:
                self.clock.record_speed(plan.accumulation, time.perf_counter() - started[0])
            return not self.stop.is_set() and current[0].keep_training(steps, get_dht_time(), self.clock.step_s)

        started = [time.perf_counter()]
        return more

    def wait_for_pipeline(self, plan: RoundPlan) -> bool:
        """Until the VR is whole and in round t (see the module docstring); False to give the round up (the
        deadline passed, the swarm moved past it, our slot was reassigned, or we are stopping)."""
        from hivemind.utils import get_dht_time

        t = plan.round
        limit = (plan.deadline + plan.grace_s) if plan.deadline else get_dht_time() + self.timeouts.stage_timeout_s
        limit = max(limit, get_dht_time() + (0 if self.stage.first else self.timeouts.stage_timeout_s))
        told: tuple[int, ...] = ()
        while not self.stop.is_set() and self.membership.slot == (self.vr, self.index):
            records = self.records()
            if view.swarm_round(self.donors(self.runtime.voters(records)), self.me, certified=True) > t:
                logger.warning("round %d: the swarm is in a later round; catching up", t)
                return False
            holders = view.vr_stages(records, self.vr, self.run_cfg.outer.stages)
            self.schedule.neighbours = holders
            previous, next_ = holders.get(self.index - 1), holders.get(self.index + 1)
            self.inbox.expect_round(Expectation(self.vr, self.index, t, previous, next_))
            missing = tuple(s for s in range(self.run_cfg.outer.stages) if s not in holders)
            if missing and missing != told:  # said once per change, not every poll
                logger.warning(
                    "vr %d round %d: no peer serves stage %s; this virtual replica does not contribute until one "
                    "takes the slot", self.vr, t, ", ".join(map(str, missing)),
                )  # fmt: skip
            told = missing
            later = [s for s, pid in holders.items() if pid != self.me and records[pid].round > t]
            if later:  # a sibling gave round t up already: meet it in its round, not wait out ours (a restart's chase)
                logger.warning("vr %d round %d: stage %s of this virtual replica is in a later round; giving this one "
                               "up to meet it there", self.vr, t, ", ".join(map(str, later)))  # fmt: skip
                return False
            if not missing:
                # a holder whose record has fingerprints has built its stage and registered its handler (`setup`):
                # one that only claimed the slot would refuse our activations ("protocols not supported")
                ready = all(records[pid].round == t and records[pid].fingerprints for pid in holders.values())
                if self.stage.first and ready:
                    return True
                if not self.stage.first and self.inbox.take(lambda h: True, timeout=1.0, keep=True) is not None:
                    return True
            if get_dht_time() > limit:
                logger.warning("vr %d round %d: the pipeline was not ready by the round's deadline", self.vr, t)
                return False
            time.sleep(0.3)
        return False

    # ------------------------------------------------------------------------------------------ upkeep & eval

    def tables_move(self, void: frozenset[int]) -> bool:
        """A later stage's T_fixed follows shard 0's round, which it does not hold: whether or not its own shard's
        round was void, it takes the table most peers of the next round hold (`upkeep`)."""
        return not self.stage.first or 0 not in void

    def upkeep(self, new_round: int) -> bool:
        """Drift transfer after the outer step: stage 0 computes it; later stages rebuild T_fixed(t+1) from the
        entries of E_S the step changed (or, without a current copy of E_S, fetch both tables), checked against
        the fingerprints most peers of the round advertise."""
        if self.stage.basis is None or not self.run_cfg.pipeline.drift_transfer:
            return True
        if self.stage.first:
            self.transfer_drift(self.stage.module, self.stage.basis)
            return True
        deadline = time.monotonic() + self.timeouts.round_timeout_s
        failed: set[str] = set()
        while not self.stop.is_set() and time.monotonic() < deadline:
            records = self.records()
            mate = self.schedule.neighbours.get(0)
            voters = self.runtime.voters(records)
            # peers that voided the rounds since hold the tables of `new_round` still (`view.spans`)
            vouched = {kind: view.held_fingerprint(voters, new_round, kind, self.me) for kind in (FIXED, EMBED)}
            if self.holds_tables(vouched):  # shard 0's round was void: T_fixed did not move
                return True
            # anyone holding the table that most peers of its round hold, fast uplinks first (`table_donors`)
            donors = table_donors(
                {pid: r.upload_mbps for pid, r in records.items()
                 if view.spans(r, new_round) and FIXED in r.fingerprints and pid not in failed
                 and r.fingerprints[FIXED] == vouched[FIXED]},
                {pid: r.upload_mbps for pid, r in view.shard_donors(records, 0).items()},
                self.me,
            )  # fmt: skip
            there = [pid for pid in donors if records[pid].round == new_round]  # a change is served for its round
            if any(self.follow_embedding(pid, new_round, vouched) for pid in there):
                return True  # the change, from whoever serves it, before any whole table
            for pid in donors:
                if self.fetch_tables(pid, records[pid], vouched):
                    return True
                if pid != mate:  # gone, or moved on (a peer serves only its newest table); our stage 0 stays
                    failed.add(pid)
            if not donors and view.swarm_round(voters, self.me) > new_round:
                break  # catching up: peers serve only their newest table, and all have moved past this one
            time.sleep(0.3)
        logger.error("round %d: no peer served the fixed table of round %d; re-syncing", new_round - 1, new_round)
        return False

    def holds_tables(self, vouched: dict[str, str | None]) -> bool:
        """Our T_fixed (and E_S copy, if we keep one) are already the ones the round's peers vouch for."""
        if vouched[FIXED] is None or fingerprint([self.stage.fixed_table]) != vouched[FIXED]:
            return False
        return self.stage.embedding is None or fingerprint([self.stage.embedding]) == vouched[EMBED]

    def follow_embedding(self, donor: str, new_round: int, vouched: dict[str, str | None]) -> bool:
        """T_fixed(t+1) and E_S(t+1) from our E_S(t) and the entries `donor` says the outer step changed, kept
        only if both match the fingerprints the round's peers vouch for (T_fixed alone does not pin E_S: it sees
        only E_S's part outside span(U)); a wrong change costs a table fetch."""
        if self.stage.embedding is None:
            return False
        change = self.states.fetch_change(donor, new_round)
        if change is None:
            return False
        try:
            embedding = apply_embedding_change(self.stage.embedding, *change)
        except ValueError as e:
            logger.warning("round %d: %s served an unusable embedding change (%s)", new_round - 1, donor, e)
            return False
        fixed, inside = transferred_table(self.stage.fixed_table, self.stage.basis, embedding)
        if fingerprint([fixed]) != vouched[FIXED] or fingerprint([inside]) != vouched[EMBED]:
            logger.warning("round %d: %s's embedding change does not rebuild the swarm's tables; fetching them",
                           new_round - 1, donor)  # fmt: skip
            return False
        self.stage.fixed_table.copy_(fixed)
        self.stage.embedding, self.embed_change = inside, change
        return True

    def fetch_tables(self, donor: str, record: PeerRecord, vouched: dict[str, str | None]) -> bool:
        """T_fixed(t+1) whole from `donor`, and E_S(t+1) when it advertises the one the round's peers vouch for
        (else we fetch both again next round). Served under the donor's round, whose tables are those of t+1: its
        record spans t+1."""
        fixed = self.states.fetch_table(donor, record, record.round, FIXED)
        if fixed is None:
            return False
        self.stage.fixed_table.copy_(fixed)
        vouched_for = vouched[EMBED] is not None and record.fingerprints.get(EMBED) == vouched[EMBED]
        self.stage.embedding = self.states.fetch_table(donor, record, record.round, EMBED) if vouched_for else None
        self.embed_change = None
        return True

    def load_state(self, min_round: int, wait_s: float) -> int | None:
        """A donor's state brings T_fixed, not E_S: our copy is stale until the next upkeep fetches it (kept when
        nothing was loaded)."""
        copy, self.stage.embedding = self.stage.embedding, None
        size = super().load_state(min_round, wait_s)
        if size is None:
            self.stage.embedding = copy
        return size

    def checkpoint_extras(self) -> dict[str, Any]:
        """A later stage's copy of E_S, which its next upkeep builds on (the module's state holds T_fixed)."""
        return {} if self.stage.first or self.stage.embedding is None else {EMBED: self.stage.embedding}

    def restore_extras(self, state: dict[str, Any]) -> None:
        """E_S's copy as checkpointed with T_fixed, or none (the next upkeep then fetches both tables)."""
        if self.stage.first or self.stage.basis is None:
            return
        copy = state.get(EMBED)
        fits = isinstance(copy, Tensor) and copy.dtype == torch.float32 and copy.shape == self.stage.fixed_table.shape
        self.stage.embedding = copy if fits else None

    def evaluate(self, round_: int, trained: bool) -> float | None:
        """The eval pass through the pipeline: every stage of a VR that trained the round takes part (batches only
        when due); a VR that did not train it (a stage missing, the pipeline broke) skips it on every stage."""
        if not trained:
            return None
        due = (round_ + 1) % self.node.eval_every == 0 or round_ + 1 >= self.run_cfg.outer.rounds
        return self.schedule.eval_pass(round_, list(self.val) if self.stage.first and due else None)
