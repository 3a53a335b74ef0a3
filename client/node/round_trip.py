"""Measure this node's round trip to the swarm: the time an empty request takes to its first initial peer and back.

The planner prices every pipeline boundary and relay hop with it (`client/swarm/cost_model.py: Latency`): a
pipeline whose stages sit 140 ms apart waits that long per microbatch trip, which no bandwidth figure shows. The
far end is the node's first initial peer that answers pings (the bootstrap, usually), so every record's figure is
taken to the same place. The smallest of a few samples after a warm-up call is the path's own delay, not a
scheduler's hiccup; the first call also opens the stream, which later calls reuse. Cheap (a few round trips), so it
is measured at every start, never cached: a laptop that moved networks reports where it is now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.probe import PROBE_PING, wire
from hetero_node.protocol.records import MAX_RTT_MS

logger = logging.getLogger(__name__)

PING_SAMPLES = 10
PING_TIMEOUT_S = 5.0
"""Per call: a peer that does not answer an empty request in 5 s is not the one to measure against."""


async def _ping_ms(p2p: Any, peer: Any) -> float:
    start = time.perf_counter()
    await asyncio.wait_for(p2p.call_protobuf_handler(peer, PROBE_PING, wire.ProbeRequest(), wire.ProbeReply),
                           PING_TIMEOUT_S)  # fmt: skip
    return (time.perf_counter() - start) * 1e3


async def round_trip_ms(p2p: Any, peer: Any, samples: int = PING_SAMPLES) -> float:
    """The smallest of `samples` timed pings to `peer` (a hivemind PeerID) after one untimed; raises if it does not
    answer."""
    await _ping_ms(p2p, peer)
    return min([await _ping_ms(p2p, peer) for _ in range(samples)])


def node_round_trip_ms(runtime: PeerRuntime) -> float:
    """This node's round trip in ms to its first initial peer that answers pings (capped at `MAX_RTT_MS`);
    0 (unknown) when none does, e.g. a stock hivemind-dht bootstrap."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in runtime.initial_peers:
        target = Multiaddr(maddr).value_for_protocol("p2p")
        try:
            rtt = runtime.run(round_trip_ms(runtime.p2p, PeerID.from_base58(target)))
        except Exception as e:  # no ping handler (an older peer, a stock DHT node) or a broken link
            logger.info("round-trip probe to %s failed: %r", target, e)
            continue
        logger.info("round trip to %s: %.1f ms", target, rtt)
        return round(min(rtt, MAX_RTT_MS), 1)
    logger.warning("could not measure the round trip (no initial peer answers pings); the planner assumes none")
    return 0.0
