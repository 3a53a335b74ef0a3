"""A second node started with a live node's key, caught from the swarm's records.

hivemind's own check (`check_if_identity_free`: dial our peer id through the bootstrap) reads any failure to
connect as "free", a slow lookup on a loaded machine included: in one of four local suite runs the second node
joined, and the two wrote over each other's record. A live node rewrites its record every `refresh_s`
(`PeerRuntime.announce`), so a record of our peer id rewritten while this node starts is another live process; a
record that is not is the last word of a node that has stopped (our own previous run, restarted on the same key).
"""

from __future__ import annotations

import logging
import threading

from hivemind.utils import get_dht_time

from hetero_node.client.swarm.record_reader import REWRITE_PERIODS
from hetero_node.client.swarm.runtime import PeerRuntime

logger = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
"""At most this long (a node refreshing its record less often than every 40 s may then go unnoticed)."""


def live_twin(runtime: PeerRuntime, stop: threading.Event) -> bool:
    """Whether another live process writes records under our peer id. Call it before this node's first record:
    when our peer id has a record, it waits until `REWRITE_PERIODS` refresh periods after that record was written;
    none when it has none (or the DHT does not answer: hivemind's check stands then)."""
    me = str(runtime.peer_id)
    first = (runtime.read_records() or {}).get(me)
    if first is None:
        return False
    # its writer rewrites it `refresh_s` after it wrote it: wait that long from then, not from now (a node killed
    # and restarted at once, as in the kill soak, waits half a period less on average)
    wait_s = min(MAX_WAIT_S, first.written_at + REWRITE_PERIODS * first.refresh_s - get_dht_time())
    if wait_s <= 0:
        return False  # its writer missed a rewrite already: it has stopped
    logger.info("a record of this node's key is in the swarm: checking for %.1f s that its node has stopped", wait_s)
    if stop.wait(wait_s):
        return False
    again = (runtime.read_records() or {}).get(me)
    return again is not None and again.written_at > first.written_at
