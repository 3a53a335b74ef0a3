"""θ(t), the weights a replica holds for its round, and what the swarm learns of them: the start point and its
fingerprints, taken from the live parameters (`adopt_start`), our record advertising them (`announce`) beside
everyone's (`records`), θ(t) served to peers (`publish_state`) and loaded from one (`load_state`), and our checkpoint
of it (`checkpoint`, `restore`).

`HeldState` is a part of `Replica` (`roles/replica.py`), written apart: the role supplies the tensors (`params`,
`module`, `trainer`, T_fixed and E_S), which part of the model it holds (`slot`) and who may serve it (`donors`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.outer.catch_up import agreed_certificate
from hetero_node.client.outer.roster_round import round_certificates
from hetero_node.client.outer.shard_state import EMBED, FIXED, state_fingerprint
from hetero_node.client.roles.checkpoint import CheckpointWriter, load_checkpoint
from hetero_node.client.swarm import view
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.errors import CheckpointError, PayloadError
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.records import PeerRecord

logger = logging.getLogger(__name__)

CERTIFICATE_WAIT_S = 3.0
"""How long a member that loaded a state waits for the round's certificate to show in the DHT (its deciders stored
it before serving the state, but a DHT store takes a moment to reach every reader)."""
MANIFEST_S = 5.0
"""One manifest fetch while adopting a loaded state's certificate: a few kilobytes from a peer that holds it."""


class HeldState:
    """The held-state part of `Replica` (see the module docstring)."""

    def records(self, timeout: float = 5.0) -> dict[str, PeerRecord]:
        return self.runtime.read_records(timeout) or {}

    def adopt_start(self) -> None:
        """θ(t) := the live parameters (after an outer step, a state load or a checkpoint), and its fingerprints,
        computed once here (hashing the model is not free on a slow machine)."""
        self.start = {s: [p.detach().clone() for p in tensors] for s, tensors in self.params.items()}
        fixed, embedding = self.fixed_table, self.embedding
        fps = {str(s): state_fingerprint(tensors, fixed) for s, tensors in self.start.items()}
        tables = {} if fixed is None else {FIXED: fingerprint([fixed])}
        self._fingerprints = {**fps, **tables, **({} if embedding is None else {EMBED: fingerprint([embedding])})}

    def fingerprints(self) -> dict[str, str]:
        """What our record advertises: every held shard's θ(t) (with T_fixed in a subspace run), T_fixed and E_S."""
        return self._fingerprints

    def announce(self, **fields: Any) -> None:
        """Our record's progress part: the round whose θ(t) we hold, its fingerprints, and anything given."""
        self.membership.update(round=self.round, certified=self.certified, fingerprints=self.fingerprints(), **fields)

    def publish_state(self) -> None:
        """Serve θ(t) of every held shard (and the method's shared state) to joiners and re-syncing peers."""
        shared = {s: sync.method.shared_state() for s, sync in self.syncs.items()}
        self.states.publish(self.round, self.start, self.fixed_table, shared, self.embedding, self.embed_change)

    @torch.no_grad()
    def set_params(self, shard: int, tensors: list[Tensor]) -> None:
        for param, value in zip(self.params[shard], tensors, strict=True):
            param.copy_(value)

    def load_state(self, min_round: int, wait_s: float) -> int | None:
        """θ of every held shard at one round ≥ min_round, each shard from a holder whose advertised fingerprint it
        matches; returns the bytes downloaded, None when no round could be loaded in time."""
        loaded = self.states.load(lambda: self.holders(self.records()), min_round, wait_s, self.stop)
        if loaded is None:
            return None
        new_round, states, size = loaded
        for shard, state in states.items():
            self.set_params(shard, state["tensors"])
            self.syncs[shard].applied = None  # θ is the donor's now: no set of ours to heal
            try:
                self.syncs[shard].method.load_shared_state(state.get("shared") or [])
            except PayloadError as e:  # the fingerprint covers the weights, not the shared state: keep ours
                logger.warning("shard %d: the donor's outer state is unusable (%s); keeping ours", shard, e)
        if self.fixed_table is not None:
            self.fixed_table.copy_(next(iter(states.values()))[FIXED])
        self.embed_change = None  # ours was of another round
        self.adopt_start()
        self.round = self.certified = new_round  # the state most holders of its round vouch for
        self.adopt_certificates(new_round - 1)
        self.publish_state()
        self.announce()
        return size

    def adopt_certificates(self, round_: int) -> None:
        """After loading θ(t+1) (t = `round_`): each shard's next quorum base, round t's certificate as its deciders
        stored it in the DHT, else as round t's manifests state it (a void round's state the older one their servers
        hold); a shard whose certificate neither tells follows the deciders until a manifest does."""
        records = self.records()
        size = max(sync.method.max_message_bytes for sync in self.syncs.values())
        certificates = round_certificates(self.runtime, self.run_cfg.run_id, list(self.syncs), round_, size, self.stop,
                                          CERTIFICATE_WAIT_S)  # fmt: skip
        for shard, sync in self.syncs.items():
            stored = certificates[shard]
            if stored is not None:
                sync.adopt(stored)
                continue
            holders = [pid for pid, r in view.shard_donors(records, shard).items() if r.certified > round_]
            random.shuffle(holders)  # never an order a peer can choose
            known, certificate = agreed_certificate(sync, round_, [p for p in holders if p != self.me], MANIFEST_S)
            sync.adopt(certificate, known)
            if not known:
                logger.info("shard %d: no record nor manifest of round %d states its certificate; following the "
                            "members that decide rounds until one does", shard, round_)  # fmt: skip

    def holders(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """The peers holding any shard we hold: who may serve us a shard's state (each shard from its holders,
        `ShardStates.load`), stage peers for a full replica too."""
        return {pid: r for shard in self.syncs for pid, r in view.shard_donors(records, shard).items()}

    def checkpoint(self) -> None:
        """θ(t+1), the optimizer and the outer method's state (error feedback), written atomically each round."""
        if self.node.checkpoint_dir is None:
            return
        state = {
            "run_id": self.run_cfg.run_id,
            "round": self.round,
            "certified": self.certified,
            "slot": self.slot(),
            "model": self.module.state_dict(),
            "trainer": self.trainer.state_dict(),
            "syncs": [self.syncs[s].method.state_dict() for s in sorted(self.syncs)],
            "certificates": {str(s): sync.certificate.to_dict() for s, sync in self.syncs.items() if sync.certificate},
            "run_config": self.run_cfg.to_dict(),  # what `hetero-node export` rebuilds the model's shape from
            **self.checkpoint_extras(),
        }
        if self.checkpoints is None:
            self.checkpoints = CheckpointWriter(self.node.checkpoint_dir)
        self.checkpoints.save(state)  # a CPU snapshot now, written in the background

    def restore(self) -> None:
        """Resume from our checkpoint; a corrupt one is an error unless a peer can provide the current state, and
        one of another part of the model (a stage peer placed elsewhere) is left alone."""
        if self.node.checkpoint_dir is None:
            return
        try:
            state = load_checkpoint(self.node.checkpoint_dir, self.run_cfg.run_id)
        except CheckpointError as e:
            logger.error("%s; loading the current state from peers instead", e)
            if self.load_state(min_round=0, wait_s=self.timeouts.round_timeout_s) is None:
                raise CheckpointError(f"{e}, and no peer could provide the current state") from None
            return
        if state is None:
            return
        if state.get("slot", self.slot()) != self.slot():
            logger.warning("the checkpoint is of %s, this node holds %s; not resuming it", state["slot"], self.slot())
            return
        self.module.load_state_dict(state["model"])
        self.trainer.load_state_dict(state["trainer"])
        self.restore_extras(state)
        for shard, sync_state in zip(sorted(self.syncs), state["syncs"], strict=True):
            self.syncs[shard].method.load_state_dict(sync_state)
        certificates = state.get("certificates") or {}
        for shard, sync in self.syncs.items():  # restarted, a member alone must not certify the rounds it missed
            sync.certificate = Certificate.from_dict(certificates.get(str(shard)))
            sync.resumed_at = int(state["round"])
        self.adopt_start()
        self.round = int(state["round"])
        self.certified = int(state.get("certified", self.round))
        self.publish_state()  # served at once: a swarm restarted from checkpoints must not wait for a round to end
        outer_state = fingerprint([t for s in sorted(self.syncs) for t in self.syncs[s].method.private_tensors()])
        logger.info("resumed from checkpoint at round %d (error feedback %s)", self.round, outer_state)
