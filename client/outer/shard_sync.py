"""One parameter shard's outer round: agree on a group, exchange pseudo-gradients, compute the same outer step.

How SparseLoCo travels (the design choice the README explains):

1. Each replica compresses its pseudo-gradient Δ = θ(t) − θ_local with error feedback and serves the encoded
   message (0.219 bits/param) from memory.
2. hivemind's matchmaking forms the shard's group for round t and gathers each member's metadata (round, start
   fingerprint, payload size and digest), which every member receives identically from the group leader; the
   all-reduce hivemind would run next is skipped (`ShardAverager`).
3. Every member fetches every other member's message over a P2P stream, checks size and digest, decodes it
   strictly, and runs the reference aggregation on the same messages in peer-id order: every member gets the
   same bits without trusting any peer's arithmetic.

Each replica uploads its message to R−1 peers and downloads R−1 messages, i.e. (R−1)·0.0273·N bytes each way. A
butterfly all-reduce of the same sparse vectors would return the union of all selections (denser with each peer)
and lose the 2-bit value codes; for the swarm sizes this targets (tens of replicas per shard) the exchange moves
fewer bytes, and none of hivemind's partial-average failure modes can silently change the result: a message is
either received whole and verified, or dropped by that peer, and the next round's fingerprint check catches the
disagreement.

DiLoCo (the baseline) travels the same way with a dense fp32 or fp16 message and a plain mean, then outer Nesterov
momentum. (hivemind's own butterfly all-reduce of dense tensors was tried first: each peer ends with
own + (mean − own), which differs from the mean in the last bit from peer to peer, so replicas never agreed.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.averager import ShardAverager
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol import dense_codec, sparse_codec
from hetero_node.protocol.aggregation import aggregate
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.keys import shard_group_prefix
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.sparseloco import ErrorFeedbackCompressor

logger = logging.getLogger(__name__)


class Member(NamedTuple):
    """A group member as every member sees it: sorted by `name` (its peer id), the canonical order."""

    name: str
    peer_id: Any
    meta: dict[str, Any]


@dataclass
class ShardOutcome:
    """What one shard's round produced and cost."""

    new_tensors: list[Tensor] | None
    """θ(t+1) of the shard, or None when this peer must fetch the swarm's state instead."""
    group_size: int = 0
    contributors: int = 0
    dropped: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def mean_in_order(contributions: list[list[Tensor]]) -> list[Tensor]:
    """Plain mean, summed in the given (canonical) order so every member gets the same bits."""
    totals = [t.clone() for t in contributions[0]]
    for contribution in contributions[1:]:
        for total, t in zip(totals, contribution, strict=True):
            total.add_(t)
    return [total / len(contributions) for total in totals]


def majority_fingerprint(fingerprints: list[str]) -> str:
    """The most common start fingerprint; ties go to the smallest string so every member picks the same one."""
    counts = Counter(fingerprints)
    best = max(counts.values())
    return min(fp for fp, n in counts.items() if n == best)


class ShardSync:
    """A replica's membership in one shard's averaging group, and its outer-optimizer state for that shard."""

    def __init__(
        self, runtime: PeerRuntime, run: RunConfig, shard: int, shapes: list[tuple[int, ...]], timeouts: SyncTimeouts
    ) -> None:
        self.runtime, self.run, self.shard, self.shapes, self.timeouts = runtime, run, shard, shapes, timeouts
        self.sparse = run.outer.outer == "sparseloco"
        if self.sparse:
            self.compressor = ErrorFeedbackCompressor(shapes, run.sparseloco)
            self.max_payload = sparse_codec.message_size_bytes(shapes, run.sparseloco)
        else:
            self.momentum = [torch.zeros(s) for s in shapes]
            self.max_payload = dense_codec.message_size_bytes(shapes, run.outer.diloco_wire)
        self.averager = ShardAverager(
            [torch.zeros(1)],  # hivemind's averager must hold a tensor; ShardAverager never all-reduces it
            runtime.dht,
            prefix=shard_group_prefix(run.run_id, shard),
            start=True,
            min_group_size=2,
            min_matchmaking_time=timeouts.matchmaking_s,
            request_timeout=min(1.0, timeouts.matchmaking_s / 2),  # below min_matchmaking_time (hivemind-notes)
            allreduce_timeout=timeouts.round_timeout_s,
            next_chunk_timeout=min(5.0, timeouts.round_timeout_s),
            allow_state_sharing=False,  # state travels through our verified blob handler instead
        )
        self._payload: bytes | None = None
        self._ef_before: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}

    # -------------------------------------------------------------------------------------------------- begin

    def begin(
        self, round_: int, start: list[Tensor], current: list[Tensor], start_fp: str, expected: int, wait_s: float
    ) -> Any:
        """Compute and publish this round's contribution, then start matchmaking in the background.

        The group forms as soon as `expected` members are in, or after `wait_s` with at least two.
        """
        from hivemind.utils import get_dht_time

        self._payload = self._encode([s - c for s, c in zip(start, current, strict=True)])  # PayloadError on NaN
        self._meta = {
            "round": round_,
            "start_fp": start_fp,
            "size": len(self._payload),
            "digest": digest(self._payload),
        }
        self.runtime.publish("payload", self.shard, round_, self._payload)
        self.averager.prepare_round(round_, max(2, expected))
        # a group that has not formed a while after its window will not form: give up and re-sync instead
        return self.averager.step(
            gather=self._meta,
            scheduled_time=get_dht_time() + wait_s,
            wait=False,
            timeout=wait_s + 2 * self.timeouts.matchmaking_s,
        )

    def _encode(self, deltas: list[Tensor]) -> bytes:
        """This round's message: SparseLoCo (through error feedback) or the dense pseudo-gradient."""
        if not self.sparse:
            return dense_codec.encode(deltas, self.run.outer.diloco_wire)
        ef_before = self.compressor.state_dict()
        payload = sparse_codec.encode(self.compressor.compress(deltas))
        self._ef_before = ef_before  # only once compress succeeded: a failed call left the buffers untouched
        return payload

    def _decode(self, payload: bytes) -> Any:
        if self.sparse:
            return sparse_codec.decode(payload, self.shapes, self.run.sparseloco)
        return dense_codec.decode(payload, self.shapes, self.run.outer.diloco_wire)

    def drop_contribution(self) -> None:
        """The round failed: forget this round's Δ and restore the error feedback to what it was before it."""
        if self.sparse and self._payload is not None:
            self.compressor.load_state_dict(self._ef_before)
        self._payload = None

    # ------------------------------------------------------------------------------------------------- finish

    def finish(self, control: Any, start: list[Tensor], swarm_moved_on: Callable[[], bool]) -> ShardOutcome:
        """Wait for the group, then compute θ(t+1) exactly as every other member does.

        While still looking for a group, `swarm_moved_on` is polled: once others have finished this round without
        us (we joined or arrived late), waiting longer cannot help, so matchmaking is cancelled at once.
        """
        from hivemind.averaging.control import AveragingStage

        deadline = time.monotonic() + self.timeouts.round_timeout_s + self.timeouts.matchmaking_s
        while not control.done() and time.monotonic() < deadline:
            if control.stage == AveragingStage.LOOKING_FOR_GROUP and swarm_moved_on():
                control.cancel()
                break
            time.sleep(0.5)
        try:
            gathered = control.result(0.1)
        except Exception as e:  # hivemind raises several types for "no group" / "peer vanished"
            logger.warning("shard %d round %d: no averaging group (%r)", self.shard, self._meta["round"], e)
            self.drop_contribution()
            return ShardOutcome(new_tensors=None)
        members = sorted(
            Member(str(pid), pid, meta if isinstance(meta, dict) else {}) for pid, meta in gathered.items()
        )
        same_round = [m for m in members if m.meta.get("round") == self._meta["round"]]
        majority = majority_fingerprint([m.meta.get("start_fp", "") for m in same_round])
        included = [m for m in same_round if m.meta.get("start_fp") == majority]
        if not any(m.name == str(self.runtime.peer_id) for m in included):
            logger.error(
                "shard %d round %d: my start fingerprint %s differs from the group's %s; re-syncing from a peer",
                self.shard, self._meta["round"], self._meta["start_fp"], majority,
            )  # fmt: skip
            self.drop_contribution()
            return ShardOutcome(new_tensors=None, group_size=len(members))
        return self._exchange(included, start, len(members))

    def _exchange(self, included: list[Member], start: list[Tensor], group_size: int) -> ShardOutcome:
        """Fetch the members' messages, aggregate them in canonical order, and take the outer step."""
        round_ = self._meta["round"]
        messages, names, dropped, received = self._collect_messages(included, round_)
        if self.sparse:
            result = aggregate(messages, self.shapes, peer_ids=names)
            dropped += [f"{names[i]}: {reason}" for i, reason in result.dropped]
            new, contributors = self._sparse_update(start, result.tensors), len(result.used)
        else:
            new, contributors = self._dense_update(start, mean_in_order(messages)), len(messages)
        # stay until the others have our payload: quitting early would truncate their round (hivemind-notes, D)
        self.runtime.wait_until_fetched("payload", self.shard, round_, len(included) - 1, self.timeouts.fetch_timeout_s)
        sent = self.runtime.bytes_served[("payload", self.shard, round_)]
        return ShardOutcome(new, group_size, contributors, dropped, sent, received)

    def _collect_messages(self, included: list[Member], round_: int) -> tuple[list[Any], list[str], list[str], int]:
        """Every member's decoded message (ours decoded from our own bytes, exactly as the others see it), fetched
        concurrently and verified; bad ones are dropped."""
        me = str(self.runtime.peer_id)
        others = [m for m in included if m.name != me]

        async def fetch_all() -> list[Any]:
            jobs = [
                self.runtime.fetch_with_retries(m.peer_id, "payload", self.shard, round_, self.max_payload)
                for m in others
            ]
            return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), self.timeouts.fetch_timeout_s)

        try:
            fetched = dict(zip([m.name for m in others], self.runtime.run(fetch_all()), strict=True))
        except TimeoutError:
            fetched = {}
        messages, names, dropped, received = [], [], [], 0
        fetched[me] = (self._meta["round"], self._payload)
        for name, _, meta in included:
            got = fetched.get(name, TimeoutError("fetch deadline passed"))
            if isinstance(got, BaseException):
                dropped.append(f"{name}: {got!r}")
                continue
            data = got[1]
            received += len(data) if name != me else 0
            if len(data) != meta.get("size") or digest(data) != meta.get("digest"):
                dropped.append(f"{name}: payload does not match the size/digest it announced")
                continue
            try:
                messages.append(self._decode(data))
                names.append(name)
            except PayloadError as e:
                dropped.append(f"{name}: {e}")
        for reason in dropped:
            logger.warning("shard %d round %d: dropped contribution %s", self.shard, round_, reason)
        return messages, names, dropped, received

    # ----------------------------------------------------------------------------------------- outer updates

    def solo(self, start: list[Tensor], current: list[Tensor], update_from: list[Tensor] | None = None) -> ShardOutcome:
        """No one else is in this round: apply our own contribution with the same rule (a group of one).

        Δ = start − current; the update applies to `update_from` (default `start`; a virtual replica measures Δ
        from its projected start but updates θ(t) itself, as every member of a group does)."""
        base = start if update_from is None else update_from
        message = self._decode(self._encode([s - c for s, c in zip(start, current, strict=True)]))
        if not self.sparse:
            return ShardOutcome(self._dense_update(base, message), 1, 1)
        return ShardOutcome(self._sparse_update(base, aggregate([message], self.shapes).tensors), 1, 1)

    def _sparse_update(self, start: list[Tensor], aggregate_: list[Tensor]) -> list[Tensor]:
        """θ(t+1) = θ(t) − α·aggregate: plain SGD, the error feedback already plays the role of momentum."""
        alpha = self.run.outer.outer_lr
        return [s - alpha * a.to(s.dtype) for s, a in zip(start, aggregate_, strict=True)]

    def _dense_update(self, start: list[Tensor], mean_delta: list[Tensor]) -> list[Tensor]:
        """DiLoCo's outer Nesterov SGD: m ← μ·m + Δ̄; θ(t+1) = θ(t) − lr·(Δ̄ + μ·m)."""
        lr, mu = self.run.outer.diloco_lr, self.run.outer.diloco_momentum
        new = []
        for s, d, m in zip(start, mean_delta, self.momentum, strict=True):
            m.mul_(mu).add_(d)
            new.append(s - lr * (d + mu * m))
        return new

    # ------------------------------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        if self.sparse:
            return {"error_feedback": self.compressor.state_dict()}
        return {"momentum": [m.clone() for m in self.momentum]}

    def outer_state_tensors(self) -> list[Tensor]:
        """The replica's own outer state: error-feedback buffers (sparseloco) or outer momentum (diloco)."""
        return self.compressor.state_dict()["buffers"] if self.sparse else self.momentum

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sparse:
            self.compressor.load_state_dict(state["error_feedback"])
        else:
            for m, saved in zip(self.momentum, state["momentum"], strict=True):
                m.copy_(saved)

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
