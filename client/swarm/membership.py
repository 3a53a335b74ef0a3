"""A node's place in the swarm: its signed record, its role, its pipeline slot, and its view of the plan.

Joining: publish a record with role "joining" → wait for records to propagate (not for `--role full`, which depends
on this node's memory alone: a restarted full replica loses no time there) → run the planner on every live
record → publish the decision (full, or a claimed (vr, stage) slot with the time of the claim) → wait again and
re-read: a slot that someone claimed earlier (or at the same time, with a lower peer id) is lost, and the planner
places us again. A node the planner puts on standby (its model says a pipeline of nodes like it would slow the
swarm) keeps its record as "standby" and is planned again every refresh until that changes. Afterwards a watcher
re-reads the records every refresh: it keeps `view` (the digest of the plan this node sees) current, so everyone
can check that all nodes agree, and it re-plans a stage peer that lost its slot.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from hivemind.utils import get_dht_time

from hetero_node.client.swarm import view
from hetero_node.client.swarm.planner import PeerInfo, Plan, Requirements, SwarmModel, plan
from hetero_node.client.swarm.reachability import CIRCUIT_SUFFIX
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import REQUEST_FULL, ROLE_FULL, ROLE_JOINING, ROLE_STAGE, ROLE_STANDBY

logger = logging.getLogger(__name__)

GB = 1e9


def relay_of(record: PeerRecord) -> str | None:
    """The peer id of the relay a relayed peer announces (its first circuit address), None for a direct peer."""
    circuits = [a for a in record.addrs if a.endswith(CIRCUIT_SUFFIX)]
    return circuits[0].removesuffix(CIRCUIT_SUFFIX).rpartition("/p2p/")[2] if circuits else None


def relay_shares(records: dict[str, PeerRecord]) -> dict[str, tuple[float, float]]:
    """Relayed peer → (up, down) Mbit/s it can count on: a relayed link is the relay's, shared by everyone relayed
    through it (each relayed byte crosses the relay's link twice: in and out). A relay without a record (the
    bootstrap) is not known: the peer's own figures stand."""
    relays = {pid: relay_of(r) for pid, r in records.items()}
    users = Counter(relay for relay in relays.values() if relay is not None)
    shares = {}
    for pid, relay in relays.items():
        own = records[pid]
        if relay is None:
            continue
        if relay in records:
            hub, n = records[relay], users[relay]
            link = min(hub.upload_mbps, hub.download_mbps) / n
            shares[pid] = (min(own.upload_mbps, link), min(own.download_mbps, link))
        else:
            shares[pid] = (own.upload_mbps, own.download_mbps)
    return shares


def peer_info(record: PeerRecord, share: tuple[float, float] | None = None) -> PeerInfo:
    """The planner's view of a (schema-valid) record; `share`: a relayed peer's (up, down) from `relay_shares`."""
    up, down = share or (record.upload_mbps, record.download_mbps)
    return PeerInfo(
        peer_id=record.peer_id,
        memory_bytes=int(record.memory_gb * GB),
        upload_mbps=up,
        download_mbps=down,
        tokens_per_s=record.tokens_per_s,
        role=record.role,
        vr=record.vr,
        stage=record.stage,
        requested_role=record.requested_role,
        pinned_stage=record.pinned_stage,
        claimed_at=record.claimed_at,
        relayed=share is not None,
        rtt_ms=record.rtt_ms,
    )


def plan_from_records(records: dict[str, PeerRecord], req: Requirements, model: SwarmModel | None = None) -> Plan:
    shares = relay_shares(records)
    return plan((peer_info(r, shares.get(pid)) for pid, r in records.items()), req, model)


class Membership:
    """See the module docstring. `update` changes fields of our record and re-publishes it at once."""

    def __init__(
        self,
        runtime: PeerRuntime,
        req: Requirements,
        record: PeerRecord,
        refresh_s: float,
        settle_s: float,
        stop: threading.Event,
        model: SwarmModel | None = None,
    ) -> None:
        self.runtime, self.req, self.refresh_s, self.settle_s = runtime, req, refresh_s, settle_s
        self.model = model
        """The planner's judge of joiners (the node passes the cost model's `MarginalGain`)."""
        self.record = record
        self.me = record.peer_id
        self.stop = stop  # the node's "leaving" flag: ends the watcher, and training
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def role(self) -> str:
        return self.record.role

    def update(self, **fields: Any) -> None:
        """Change fields of our record (validated: a wrong type is a bug, caught here) and publish it at once."""
        with self._lock:
            self.record = PeerRecord(**{**self.record.dict(), **fields})
            self.runtime.announce(self.record, self.refresh_s)

    def _records(self) -> dict[str, PeerRecord]:
        """Live records of peers not known to have no node behind them (`PeerRuntime.running`: one record-only
        "full replica" claiming 10⁹ tokens/s sent honest joiners to standby), ours as we last wrote it (the DHT may
        not show our newest write yet)."""
        records = self.runtime.running(self.runtime.read_records() or {})
        records[self.me] = self.record
        return records

    def _apply(self, current: Plan) -> None:
        role = current.roles.get(self.me)
        if role is None:
            raise ConfigError(f"this node cannot take part in the run: {current.reasons.get(self.me, 'no reason')}")
        vr, stage = current.slots.get(self.me, (-1, -1))
        if vr < 0:
            claimed_at = 0.0  # no slot
        elif self.record.claimed_at > 0 and (vr, stage) == self.slot:
            claimed_at = self.record.claimed_at  # the slot we hold: keep the time we claimed it
        else:
            claimed_at = get_dht_time()
        self.update(role=role, vr=vr, stage=stage, claimed_at=claimed_at)

    def _contested(self, records: dict[str, PeerRecord]) -> bool:
        """Someone else holds our slot by the planner's rule (an earlier claim, or the same time and a lower peer
        id): they keep it, we move."""
        if self.role != ROLE_STAGE:
            return False
        return view.slot_holders(records, self.req.stages).get(self.slot, self.me) != self.me

    def settle(self, max_attempts: int = 20) -> Plan | None:
        """Decide our role and claim our slot (see the module docstring); returns the plan we acted on, or None
        when `stop` was set meanwhile."""
        self.update(role=ROLE_JOINING, vr=-1, stage=-1)
        if self.record.requested_role != REQUEST_FULL:  # --role full: decided by our memory, no one else's record
            self.stop.wait(self.settle_s)
        contests, standby_reason = 0, ""
        while contests < max_attempts:
            if self.stop.is_set():
                return None
            current = plan_from_records(self._records(), self.req, self.model)
            self._apply(current)
            if self.role == ROLE_STANDBY:  # re-published and judged again every refresh, until the swarm changes
                if current.reasons[self.me] != standby_reason:
                    standby_reason = current.reasons[self.me]
                    logger.info("%s; judged again every %.0f s", standby_reason, self.refresh_s)
                self.stop.wait(self.refresh_s)
                continue
            if self.role == ROLE_FULL:
                break
            self.stop.wait(self.settle_s)
            if not self._contested(self._records()):
                break
            contests += 1
            logger.info("slot vr %d stage %d was claimed earlier by another peer; planning again", *self.slot)
        else:
            raise ConfigError(f"could not claim a pipeline slot after {max_attempts} attempts")
        logger.info("role %s%s: %s", self.role, self._slot_text(), current.reasons.get(self.me, ""))
        self._refresh_view()
        return current

    @property
    def slot(self) -> tuple[int, int]:
        return self.record.vr, self.record.stage

    def _slot_text(self) -> str:
        return f" (vr {self.record.vr}, stage {self.record.stage})" if self.role == ROLE_STAGE else ""

    def _refresh_view(self) -> None:
        """Re-plan from the current records; publish the digest if it changed; move off a contested slot."""
        records = self._records()
        current = plan_from_records(records, self.req, self.model)
        if self._contested(records):
            logger.warning("lost slot vr %d stage %d to an earlier claim; planning again", *self.slot)
            self._apply(current)
            return
        if current.digest() != self.record.view:
            self.update(view=current.digest())

    def watch(self) -> None:
        """Keep the view current in a background thread until `stop` is set."""

        def loop() -> None:
            while not self.stop.wait(self.refresh_s):
                try:
                    self._refresh_view()
                except ConfigError as e:
                    logger.error("%s", e)
                except Exception as e:  # a DHT hiccup must not kill the watcher (or training)
                    logger.warning("refreshing the swarm view failed: %r", e)

        self._watcher = threading.Thread(target=loop, name="hetero-node-membership", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self.stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
