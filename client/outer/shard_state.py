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
the fingerprint keys "fixed" and "embed". The blobs' byte layouts are `protocol/state_wire.py`; this module decides
what to serve, whom to ask and whose fingerprints to believe.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from hetero_node.client.swarm import view
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL
from hetero_node.protocol.state_wire import (
    EMBED,
    EMBED_CHANGE,
    FIXED,
    STATE,
    encode_change,
    encode_state,
    encode_table,
    max_change_bytes,
    max_state_bytes,
    parse_change,
    parse_state,
    parse_table,
)

logger = logging.getLogger(__name__)


def state_fingerprint(tensors: Sequence[Tensor], fixed: Tensor | None) -> str:
    """What a peer advertises for a shard: its tensors, then T_fixed in a subspace run."""
    return fingerprint([*tensors, *([] if fixed is None else [fixed])])


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
            table = functools.partial(encode_table, round_, EMBED, embedding.detach().cpu())
            self.runtime.publish(EMBED, 0, round_, table)
        if change is not None:
            self.runtime.publish(EMBED_CHANGE, 0, round_, functools.partial(encode_change, *change))
        for shard, shard_tensors in tensors.items():
            own = shared.get(shard) if shared is not None else None
            state = functools.partial(
                encode_state,
                round_,
                [t.detach().cpu() for t in shard_tensors],
                fixed,
                None if own is None else [t.detach().cpu().clone() for t in own],
            )
            self.runtime.publish(STATE, shard, round_, state)
        if fixed is not None:
            self.runtime.publish(FIXED, 0, round_, functools.partial(encode_table, round_, FIXED, fixed))

    # ---------------------------------------------------------------------------------------------- loading

    def load(
        self,
        donor_records: Callable[[], dict[str, PeerRecord]],
        min_round: int,
        wait_s: float,
        stop: threading.Event,
    ) -> tuple[int, dict[int, dict[str, Any]], int] | None:
        """(round, {shard: state}, bytes downloaded): every shard this peer holds, of one round ≥ min_round, the
        newest such round whose states we get. Each shard comes from any peer holding it at that round (a full
        replica, or a stage peer of that stage: a full replica restarting where only virtual replicas hold the
        current round loads it from them) whose fingerprint for it is the one most of the shard's holders at that
        round advertise, and no round above what most donors hold (`view.swarm_round`) is followed: one peer
        claiming a later round or other weights is not. "Most" counts voters (`PeerRuntime.voters`): peers seen
        working, or answering, never records alone.

        `donor_records` lists who may serve (the caller's choice). A donor that fails for a shard and round is not
        asked again for it; None when no round could be loaded whole within wait_s.
        """
        deadline = time.monotonic() + wait_s
        failed: set[tuple[str, int, int]] = set()
        me = str(self.runtime.peer_id)
        while True:
            records = donor_records()
            voters = self.runtime.voters(records)
            ceiling = view.swarm_round(voters, me)
            rounds = sorted({r.round for pid, r in records.items() if pid != me and min_round <= r.round <= ceiling})
            for round_ in reversed(rounds):
                loaded = self._load_round(records, voters, round_, failed, me)
                if loaded is not None:
                    return round_, *loaded
            if time.monotonic() >= deadline or stop.is_set():
                return None
            time.sleep(0.5)

    def _load_round(
        self,
        records: dict[str, PeerRecord],
        voters: dict[str, PeerRecord],
        round_: int,
        failed: set[tuple[str, int, int]],
        me: str,
    ) -> tuple[dict[int, dict[str, Any]], int] | None:
        """Every held shard's state of `round_` from vouched holders (full replicas first: one donor for all; then
        by peer id, highest first), or None when a shard has none left that serves it. Nothing is downloaded for
        a round some shard has no candidate at (retried every half second, it would fetch the others again)."""
        candidates = {shard: self._donors(records, voters, round_, shard, failed, me) for shard in self.shapes}
        if not all(candidates.values()):
            return None
        states, size = {}, 0
        for shard, donors in candidates.items():
            for donor in donors:
                downloaded = self._download(donor, records[donor], round_, shard)
                if downloaded is not None:
                    states[shard] = downloaded[0]
                    size += downloaded[1]
                    logger.warning("loaded the swarm's state of shard %d, round %d, from %s", shard, round_, donor)
                    break
                failed.add((donor, round_, shard))
            else:
                return None
        return states, size

    @staticmethod
    def _donors(
        records: dict[str, PeerRecord],
        voters: dict[str, PeerRecord],
        round_: int,
        shard: int,
        failed: set[tuple[str, int, int]],
        me: str,
    ) -> list[str]:
        """The holders of `shard` at `round_` whose fingerprint for it most of its holders there that count as
        voters advertise, best first, leaving out those that failed it."""
        holders = view.shard_donors(records, shard)
        vouched = view.vouched_fingerprint(view.shard_donors(voters, shard), round_, str(shard), me)
        ranked = sorted(
            (
                (r.role == ROLE_FULL, pid)
                for pid, r in holders.items()
                if pid != me and r.round == round_ and (pid, round_, shard) not in failed
                and vouched is not None and r.fingerprints.get(str(shard)) == vouched
            ),
            reverse=True,
        )  # fmt: skip
        return [pid for _, pid in ranked]

    def _download(self, donor: str, record: PeerRecord, round_: int, shard: int) -> tuple[dict[str, Any], int] | None:
        """`donor`'s state of `shard` at `round_`, checked against the fingerprint it advertises; None on any
        failure."""
        from hivemind.p2p import PeerID
        from hivemind.utils import get_dht_time

        shapes = self.shapes[shard]
        limit = max_state_bytes([*shapes, *([self.fixed_shape] if self.fixed_shape else [])])
        timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
        try:
            served, data = self.runtime.fetch(PeerID.from_base58(donor), STATE, shard, round_, limit, timeout)
            if served != round_:
                raise PayloadError(f"state of shard {shard} is of round {served}, not {round_}")
            state = parse_state(data, shapes, self.fixed_shape)
            if state_fingerprint(state["tensors"], state.get(FIXED)) != record.fingerprints.get(str(shard)):
                raise PayloadError(f"state of shard {shard} does not match the fingerprint {donor} advertised")
        except Exception as e:  # a bad donor is skipped, never trusted
            logger.warning("could not load shard %d's state from %s: %r", shard, donor, e)
            return None
        self.runtime.work.note_work([donor], get_dht_time())  # it served the state the round's voters vouch for
        return state, len(data)

    def fetch_table(self, donor: str, record: PeerRecord, round_: int, kind: str = FIXED) -> Tensor | None:
        """T_fixed (`kind` FIXED) or E_S (EMBED) of `round_` from `donor`, checked against the fingerprint it
        advertises under `kind`; None on any failure."""
        from hivemind.p2p import PeerID

        limit = max_state_bytes([self.fixed_shape])
        timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
        try:
            served, data = self.runtime.fetch(PeerID.from_base58(donor), kind, 0, round_, limit, timeout)
            self.table_bytes += len(data)
            if served != round_:
                raise PayloadError(f"{kind} table of round {served}, not {round_}")
            table = parse_table(data, kind, self.fixed_shape)
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

        limit = max_change_bytes(self.fixed_shape)
        timeout = transfer_timeout(limit, self.download_mbps, self.fetch_timeout_s)
        try:
            _, data = self.runtime.fetch(PeerID.from_base58(donor), EMBED_CHANGE, 0, round_, limit, timeout)
            self.table_bytes += len(data)
            positions, values = parse_change(data)
        except Exception as e:  # a bad donor is skipped, never trusted
            logger.warning("could not load round %d's embedding change from %s: %r", round_, donor, e)
            return None
        return positions, values
