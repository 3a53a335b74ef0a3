"""The dashboard's data: the latest swarm snapshot, polled in a thread, and the rounds seen so far.

Peer records only describe the present, so the history (eval loss, bytes and contributors per round) is built
here from each peer's `last_round` summary as the polls see it: a dashboard started late shows the rounds since
it started. The same state feeds the swarm gauges on `/metrics` (a Prometheus collector).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hetero_node.protocol.roles import ROLE_FULL, ROLE_JOINING, ROLE_STAGE, ROLE_STANDBY

logger = logging.getLogger(__name__)

Snapshot = dict[str, Any]


def round_rows(seen: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per round, oldest first: mean eval loss of the peers that evaluated it, total bytes sent and received,
    and which peers contributed (peer id → bool) and which were left out by the selection, among those that recorded
    the round."""
    rows = []
    for round_, summaries in sorted(seen.items()):
        losses = [s["eval_loss"] for s in summaries.values() if s["eval_loss"] is not None]
        rows.append(
            {
                "round": round_,
                "eval_loss": statistics.fmean(losses) if losses else None,
                "bytes_sent": sum(s["bytes_sent"] for s in summaries.values()),
                "bytes_received": sum(s["bytes_received"] for s in summaries.values()),
                "contributed": {pid: s["contributed"] for pid, s in sorted(summaries.items())},
                "deferred": sorted(pid for pid, s in summaries.items() if s.get("deferred")),
            }
        )
    return rows


class SwarmWatcher(Collector):
    """Polls `read_snapshot` every `interval_s` (None from it: the DHT did not answer; the last snapshot stays)."""

    def __init__(
        self, read_snapshot: Callable[[], Snapshot | None], interval_s: float = 2.0, max_rounds: int = 500
    ) -> None:
        self.read_snapshot, self.interval_s, self.max_rounds = read_snapshot, interval_s, max_rounds
        self.snapshot: Snapshot | None = None
        self.updated = 0.0
        self.seen: dict[int, dict[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_forever, name="swarm-watch", daemon=True)

    def start(self) -> SwarmWatcher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # a bad poll must not end the dashboard: the next one may work
                logger.exception("reading the swarm for the dashboard failed")
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        snapshot = self.read_snapshot()
        if snapshot is None:
            return
        with self._lock:
            self.snapshot, self.updated = snapshot, time.time()
            for peer in snapshot["peers"]:
                summary = peer.get("last_round")
                if summary is not None:
                    self.seen.setdefault(summary["round"], {})[peer["peer_id"]] = summary
            for old in sorted(self.seen)[: max(0, len(self.seen) - self.max_rounds)]:
                del self.seen[old]

    def state(self) -> dict[str, Any]:
        """What `/api/swarm` returns: the snapshot, the per-round rows, and when it was last read."""
        with self._lock:
            return {"snapshot": self.snapshot, "rounds": round_rows(self.seen), "updated": self.updated}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            snapshot = self.snapshot
        if snapshot is None:
            return
        peers = GaugeMetricFamily("hetero_node_swarm_peers", "Peers with a live record, by role.", labels=["role"])
        for role in (ROLE_FULL, ROLE_STAGE, ROLE_JOINING, ROLE_STANDBY):
            peers.add_metric([role], sum(p["role"] == role for p in snapshot["peers"]))
        yield peers
        yield GaugeMetricFamily("hetero_node_swarm_round", "Highest round a full replica holds.", snapshot["round"])
        yield GaugeMetricFamily(
            "hetero_node_swarm_tokens_per_second",
            "Sum of the peers' advertised training throughput (a stage peer's: its node's, at the whole model).",
            sum(p["tokens_per_s"] for p in snapshot["peers"]),
        )
        replicas = GaugeMetricFamily(
            "hetero_node_swarm_virtual_replicas", "Virtual replicas, by completeness.", labels=["complete"]
        )
        complete = sum(not vr["missing"] for vr in snapshot["virtual_replicas"].values())
        replicas.add_metric(["true"], complete)
        replicas.add_metric(["false"], len(snapshot["virtual_replicas"]) - complete)
        yield replicas
