"""Shard states as peers serve and verify them: how a late joiner, a re-syncing replica or a replacement stage
gets the swarm's current weights without trusting whoever sends them.

A peer serves, per shard it holds, the blob `state` (its round, the shard's tensors, the shared outer state of
the run's method, e.g. DiLoCo's momentum, and, in a subspace run, the fixed token table T_fixed) and advertises
the state's fingerprint in its record. In a subspace run T_fixed belongs to every shard's state and fingerprint:
it changes every round (drift transfer) and every peer must hold the same bits, so a group's start-fingerprint
check also proves T_fixed agrees. Stages without the embedding need only T_fixed each round. They keep a copy of
E_S (the learned embedding) and rebuild T_fixed(t+1) themselves from the entries of E_S the round's outer step
changed, served as the blob `embed-change` (a few percent of the table under SparseLoCo), checking the result
against the fingerprints the swarm vouches for. A stage without a current copy (a joiner, a re-sync, a change that
did not reproduce the fingerprints) fetches the whole tables once: the blobs `fixed` and `embed`, advertised under
the fingerprint keys "fixed" and "embed".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.swarm import view
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.shards import fingerprint
from hetero_node.protocol import tensor_file
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.records import PeerRecord

logger = logging.getLogger(__name__)

FIXED = "fixed"
"""Blob kind and fingerprint key of the fixed token table."""
EMBED = "embed"
"""Blob kind and fingerprint key of the learned embedding E_S (after the round's drift transfer)."""
EMBED_CHANGE = "embed-change"
"""Blob kind of the entries of E_S a round's outer step changed (`models.subspace.embedding_change`)."""


def to_bytes(state: dict[str, Any]) -> bytes:
    """Serialize a state for the wire (tensors and plain Python values only; `protocol/tensor_file.py`)."""
    return tensor_file.dumps(state)


def from_bytes(data: bytes) -> dict[str, Any]:
    """Deserialize a peer's state without unpickling anything; `PayloadError` if it is not one."""
    state = tensor_file.loads(data)
    if not isinstance(state, dict):
        raise PayloadError("peer state is not a dictionary")
    return state


def state_fingerprint(tensors: Sequence[Tensor], fixed: Tensor | None) -> str:
    """What a peer advertises for a shard: its tensors, then T_fixed in a subspace run."""
    return fingerprint([*tensors, *([] if fixed is None else [fixed])])


def _finite_fp32(t: Any) -> bool:
    return isinstance(t, Tensor) and t.dtype == torch.float32 and bool(t.isfinite().all())


def _max_size(shapes: Sequence[tuple[int, ...]]) -> int:
    """Generous bound on a serialized state (fp32 tensors, optional shared outer state of the same size, table,
    overhead)."""
    return 2 * sum(4 * torch.Size(s).numel() for s in shapes) + (1 << 22)


def transfer_timeout(nbytes: int, download_mbps: float, floor_s: float) -> float:
    """How long to allow a download of `nbytes`: twice what this node's download bandwidth needs, never less than
    `floor_s` (a fixed deadline would make a large model's state unreachable on a modest link)."""
    if download_mbps <= 0:
        return floor_s
    return max(floor_s, 2 * 8 * nbytes / (download_mbps * 1e6))


class ShardStates:
    """Publishes this peer's shard states and loads verified ones from donors (see the module docstring)."""

    def __init__(
        self,
        runtime: PeerRuntime,
        shapes: dict[int, list[tuple[int, ...]]],
        fixed_shape: tuple[int, ...] | None,
        fetch_timeout_s: float,
        download_mbps: float = 0.0,
    ) -> None:
        self.runtime, self.shapes, self.fixed_shape = runtime, shapes, fixed_shape
        self.fetch_timeout_s, self.download_mbps = fetch_timeout_s, download_mbps
        self.table_bytes = 0
        """Bytes of tables and embedding changes downloaded so far (a stage's per-round upkeep)."""

    def publish(
        self,
        round_: int,
        tensors: dict[int, list[Tensor]],
        fixed: Tensor | None,
        shared: dict[int, list[Tensor] | None] | None = None,
        embedding: Tensor | None = None,
        change: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """Serve round `round_`'s state of every shard in `tensors` (`shared`: the method's shared outer state),
        and in a subspace run the tables: T_fixed, E_S (`embedding`) and the change that made E_S(round_).

        Serialized only when a peer asks: `tensors`, `embedding` and `change` must not change afterwards (the
        caller replaces them each round rather than writing into them); T_fixed and the shared state, which do
        change in place, are copied here."""
        fixed = None if fixed is None else fixed.detach().cpu().clone()
        if embedding is not None:
            table = {"round": round_, EMBED: embedding.detach().cpu()}
            self.runtime.publish(EMBED, 0, round_, functools.partial(to_bytes, table))
        if change is not None:
            positions, values = change
            change = {"positions": positions, "values": values}
            self.runtime.publish(EMBED_CHANGE, 0, round_, functools.partial(to_bytes, change))
        for shard, shard_tensors in tensors.items():
            state: dict[str, Any] = {"round": round_, "tensors": [t.detach().cpu() for t in shard_tensors]}
            if fixed is not None:
                state[FIXED] = fixed
            if shared is not None and shared.get(shard) is not None:
                state["shared"] = [t.detach().cpu().clone() for t in shared[shard]]
            self.runtime.publish("state", shard, round_, functools.partial(to_bytes, state))
        if fixed is not None:
            self.runtime.publish(FIXED, 0, round_, functools.partial(to_bytes, {"round": round_, FIXED: fixed}))

    # ---------------------------------------------------------------------------------------------- loading

    def load(
        self,
        donor_records: Callable[[], dict[str, PeerRecord]],
        min_round: int,
        wait_s: float,
        stop: threading.Event,
    ) -> tuple[int, dict[int, dict[str, Any]], int] | None:
        """(round, {shard: state}, bytes downloaded) from the newest donor at round ≥ min_round whose fingerprints
        it matches, where those fingerprints are the ones most peers at that round advertise and that round is not
        above what most donors hold (`view.swarm_round`): one peer claiming a later round or other weights is not
        followed.

        `donor_records` lists who may serve (the caller's choice: full replicas, or peers holding the shard).
        A donor that fails for a round is not asked again for it; None when no donor succeeded within wait_s.
        """
        deadline = time.monotonic() + wait_s
        failed: set[tuple[str, int]] = set()
        me = str(self.runtime.peer_id)
        while True:
            records = donor_records()
            ceiling = view.swarm_round(records, me)
            donors = sorted(
                (
                    (rec.round, pid)
                    for pid, rec in records.items()
                    if pid != me and min_round <= rec.round <= ceiling and (pid, rec.round) not in failed
                    and self._vouched(records, rec, me)
                ),
                reverse=True,
            )  # fmt: skip
            for donor_round, donor in donors:
                downloaded = self._download(donor, records[donor], donor_round)
                if downloaded is not None:
                    logger.warning("loaded the swarm's state of round %d from %s", donor_round, donor)
                    return donor_round, *downloaded
                failed.add((donor, donor_round))
            if time.monotonic() >= deadline or stop.is_set():
                return None
            time.sleep(0.5)

    def _vouched(self, records: dict[str, PeerRecord], record: PeerRecord, me: str) -> bool:
        """Whether every shard fingerprint the donor advertises is the one most peers at its round advertise."""
        return all(
            view.vouched_fingerprint(records, record.round, str(shard), me) == record.fingerprints.get(str(shard))
            for shard in self.shapes
        )

    def _download(
        self, donor: str, record: PeerRecord, donor_round: int
    ) -> tuple[dict[int, dict[str, Any]], int] | None:
        from hivemind.p2p import PeerID

        peer = PeerID.from_base58(donor)
        states, size = {}, 0
        try:
            for shard, shapes in self.shapes.items():
                limit = _max_size([*shapes, *([self.fixed_shape] if self.fixed_shape else [])])
                timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
                round_, data = self.runtime.fetch(peer, "state", shard, donor_round, limit, timeout)
                size += len(data)
                state = from_bytes(data)
                tensors, fixed = state["tensors"], state.get(FIXED)
                if [tuple(t.shape) for t in tensors] != shapes or round_ != donor_round:
                    raise PayloadError(f"state of shard {shard} has the wrong shapes or round")
                if (fixed is None) != (self.fixed_shape is None) or (
                    fixed is not None and tuple(fixed.shape) != self.fixed_shape
                ):
                    raise PayloadError(f"state of shard {shard} has no fixed table of shape {self.fixed_shape}")
                if not all(_finite_fp32(t) for t in [*tensors, *([] if fixed is None else [fixed])]):
                    raise PayloadError(f"state of shard {shard} holds non-fp32 or non-finite values")
                if state_fingerprint(tensors, fixed) != record.fingerprints.get(str(shard)):
                    raise PayloadError(f"state of shard {shard} does not match the fingerprint {donor} advertised")
                states[shard] = state
        except Exception as e:  # a bad donor is skipped, never trusted
            logger.warning("could not load state from %s: %r", donor, e)
            return None
        return states, size

    def fetch_table(self, donor: str, record: PeerRecord, round_: int, kind: str = FIXED) -> Tensor | None:
        """T_fixed (`kind` FIXED) or E_S (EMBED) of `round_` from `donor`, checked against the fingerprint it
        advertises under `kind`; None on any failure."""
        from hivemind.p2p import PeerID

        limit = _max_size([self.fixed_shape])
        timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
        try:
            served, data = self.runtime.fetch(PeerID.from_base58(donor), kind, 0, round_, limit, timeout)
            self.table_bytes += len(data)
            table = from_bytes(data)[kind]
            if served != round_ or tuple(table.shape) != self.fixed_shape or table.dtype != torch.float32:
                raise PayloadError(f"{kind} table of round {served} with shape {tuple(table.shape)}")
            if fingerprint([table]) != record.fingerprints.get(kind):
                raise PayloadError(f"{kind} table does not match the fingerprint {donor} advertised")
        except Exception as e:  # a bad donor is skipped, never trusted
            logger.warning("could not load the %s table of round %d from %s: %r", kind, round_, donor, e)
            return None
        return table

    def fetch_change(self, donor: str, round_: int) -> tuple[Tensor, Tensor] | None:
        """The entries of E_S that round `round_ - 1`'s outer step changed, as `donor` serves them; None on any
        failure. Only shapes and types are checked here: the caller checks what they rebuild."""
        from hivemind.p2p import PeerID

        limit = 4 * torch.Size(self.fixed_shape).numel() + (1 << 20)  # at most half the entries, or all values
        timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
        try:
            _, data = self.runtime.fetch(PeerID.from_base58(donor), EMBED_CHANGE, 0, round_, limit, timeout)
            self.table_bytes += len(data)
            change = from_bytes(data)
            positions, values = change.get("positions"), change.get("values")
            if not (isinstance(positions, Tensor) and _finite_fp32(values)):
                raise PayloadError("an embedding change is int32 positions and finite fp32 values")
        except Exception as e:  # a bad donor is skipped, never trusted
            logger.warning("could not load round %d's embedding change from %s: %r", round_, donor, e)
            return None
        return positions, values
