"""Per-peer budgets for requests that cost the server far more than the asker (H5 of the security review).

A 10-byte request can make a node send a 32 MB bandwidth probe or serialize and stream a whole shard state. Each
peer therefore draws from a budget that refills over a window (bytes for probes, requests for states), sized so
an honest node never meets it: measuring a link takes at most 52 MB each way, and loading state asks each donor
once per shard, with retries. The budget remembers a bounded number of peers (the least recently seen are
forgotten), so the limiter cannot itself be grown without bound. Many identities can still share out a node's
link: `MAX_CONCURRENT_PROBES` bounds that for probes; for states the per-peer stream cap does.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

MAX_REMEMBERED_PEERS = 4096


class PeerBudget:
    """At most `limit` units per `window_s` seconds from each peer."""

    def __init__(self, limit: float, window_s: float, max_peers: int = MAX_REMEMBERED_PEERS) -> None:
        self.limit, self.window_s, self.max_peers = limit, window_s, max_peers
        self._spent: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()

    def take(self, peer: str, amount: float, now: float | None = None) -> bool:
        """Charge `amount` to `peer` and return True, or return False (charging nothing) if it would exceed the
        budget of the last `window_s` seconds."""
        now = time.monotonic() if now is None else now
        spent = self._spent.pop(peer, deque())
        while spent and spent[0][0] <= now - self.window_s:
            spent.popleft()
        allowed = sum(a for _, a in spent) + amount <= self.limit
        if allowed:
            spent.append((now, amount))
        self._spent[peer] = spent  # most recently seen last
        while len(self._spent) > self.max_peers:
            self._spent.popitem(last=False)
        return allowed
