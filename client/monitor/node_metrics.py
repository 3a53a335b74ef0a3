"""A training node's Prometheus metrics, fed by its round records.

Counters are totals since the process started (Prometheus computes rates); gauges describe the last finished
round. The registry is the node's own, not prometheus_client's global one, so two nodes in one process (tests)
never share series. Process metrics (`hetero_node_process_resident_memory_bytes`, CPU seconds, open fds) come
from prometheus_client's process collector.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector

from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.protocol.roles import ROLE_JOINING

NAMESPACE = "hetero_node"
TRAFFIC = ("outer", "boundary")
"""`traffic` label values: SparseLoCo messages, state and catch-up (outer); pipeline activations (boundary)."""


class NodeMetrics:
    """See the module docstring; `observe_round` is the round loop's callback."""

    def __init__(self, run_id: str, version: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(namespace=NAMESPACE, registry=self.registry)
        metric = {"namespace": NAMESPACE, "registry": self.registry}
        self.info = Info("node", "The run this node trains and its role.", **metric)
        self.identity = {"run_id": run_id, "version": version}
        self.role = ROLE_JOINING
        self.last_round: int | None = None
        """The last round this node finished or caught up to (None: none yet): what `/readyz` waits for."""
        self.set_role(ROLE_JOINING)
        self.round = Gauge("round", "Last finished outer round.", **metric)
        self.inner_steps = Counter("inner_steps", "Inner optimizer steps trained.", **metric)
        self.tokens = Counter("tokens", "Tokens trained.", **metric)
        self.train_loss = Gauge("train_loss", "Mean training loss of the last round (NaN: none here).", **metric)
        self.eval_loss = Gauge("eval_loss", "Held-out loss after the last evaluated round (NaN: none yet).", **metric)
        self.tokens_per_second = Gauge(
            "tokens_per_second", "Tokens of the last round over its compute and communication time.", **metric
        )
        self.sent = Counter("sent_bytes", "Bytes sent to peers.", ["traffic"], **metric)
        self.received = Counter("received_bytes", "Bytes received from peers.", ["traffic"], **metric)
        self.compute = Counter("compute_seconds", "Seconds spent training.", **metric)
        self.communication = Counter("communication_seconds", "Seconds spent in the outer exchange.", **metric)
        self.group_size = Gauge("group_size", "Members of the last round's averaging group.", **metric)
        self.contributors = Gauge("round_contributors", "Messages in the last round's aggregate.", **metric)
        self.contributed = Counter("contributed_rounds", "Rounds whose aggregate holds this node's message.", **metric)
        self.resyncs = Counter("resyncs", "Rounds trained but left out of the aggregate (missed the group).", **metric)
        self.deferred = Counter(
            "deferred_rounds", "Rounds whose selection left this node's message out (its Δ stays owed).", **metric
        )
        self.dropped = Counter(
            "dropped_contributions", "Peers' messages dropped from this node's groups (late, invalid).", **metric
        )
        self.peers_seen = Gauge("peers_seen", "Peers with a live record in the DHT, this node included.", **metric)
        for gauge in (self.train_loss, self.eval_loss):
            gauge.set(math.nan)
        for traffic in TRAFFIC:  # both series exist from the start, so rate() works from the first scrape
            self.sent.labels(traffic)
            self.received.labels(traffic)

    def watch_peers(self, count: Callable[[], int]) -> None:
        """Read `peers_seen` from `count` at every scrape."""
        self.peers_seen.set_function(count)

    def set_role(self, role: str) -> None:
        self.role = role
        self.info.info({**self.identity, "role": role})

    def readiness(self) -> tuple[bool, str]:
        """`/readyz`: ready once this node holds a role and has a round behind it (see `health.py`)."""
        if self.role == ROLE_JOINING:
            return False, "joining: measuring this node and choosing a role"
        if self.last_round is None:
            return False, f"{self.role}: no round finished yet"
        return True, f"{self.role}: round {self.last_round} finished"

    def observe_round(self, record: RoundRecord) -> None:
        self.last_round = record.round
        self.round.set(record.round)
        self.inner_steps.inc(record.inner_steps)
        self.tokens.inc(record.tokens)
        if record.train_loss is not None:
            self.train_loss.set(record.train_loss)
        if record.eval_loss is not None:
            self.eval_loss.set(record.eval_loss)
        self.tokens_per_second.set(record.tokens / max(record.compute_s + record.comm_s, 1e-9))
        self.sent.labels("outer").inc(record.bytes_sent)
        self.received.labels("outer").inc(record.bytes_received)
        self.sent.labels("boundary").inc(record.boundary_bytes_sent)
        self.received.labels("boundary").inc(record.boundary_bytes_received)
        self.compute.inc(record.compute_s)
        self.communication.inc(record.comm_s)
        self.group_size.set(record.group_size)
        self.contributors.set(record.contributors)
        self.contributed.inc(int(record.contributed))
        self.resyncs.inc(int(record.resynced))
        self.deferred.inc(int(record.deferred))
        self.dropped.inc(len(record.dropped))
