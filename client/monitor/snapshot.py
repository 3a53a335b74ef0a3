"""The swarm as plain JSON-able data, from the run's live peer records: what `status` prints and the dashboard
shows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hetero_node.client.swarm import view
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE


def swarm_snapshot(
    timed: dict[str, tuple[PeerRecord, float]], now: float, run_id: str, run: dict[str, Any] | None
) -> dict[str, Any]:
    """`timed`: the records with their DHT expiration times (a record was written 3 refreshes before it
    expires, which gives each peer's last-seen age at DHT time `now`); `run`: the announced run config, if any."""
    records = {pid: record for pid, (record, _) in timed.items()}
    peers = []
    for _, (record, expiration) in sorted(timed.items()):
        last_seen = max(0.0, now - (expiration - 3 * record.refresh_s))
        peers.append({**record.dict(), "last_seen_s": round(last_seen, 1)})
    stage_records = [r for r in records.values() if r.role == ROLE_STAGE]
    stages = run["outer"]["stages"] if run else max((r.stage + 1 for r in stage_records), default=0)
    replicas = view.virtual_replicas(records, stages, complete=False)
    views = Counter(r.view for r in records.values() if r.view)
    return {
        "run_id": run_id,
        "run": run,
        "round": max((r.round for r in records.values() if r.role == ROLE_FULL), default=0),
        "peers": peers,
        "virtual_replicas": {
            str(vr): {
                "stages": {str(s): pid for s, pid in sorted(held.items())},
                "missing": [s for s in range(stages) if s not in held],
            }
            for vr, held in sorted(replicas.items())
        },
        "views_agree": len(views) == 1 and sum(views.values()) == len(peers),
    }


def read_snapshot(
    read_timed: Callable[[], dict[str, tuple[PeerRecord, float]] | None], run_id: str, run: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The snapshot from a fresh read of the records (`read_timed`: a peer's or the bootstrap's DHT); None when
    the DHT did not answer."""
    from hivemind.utils import get_dht_time

    timed = read_timed()
    return None if timed is None else swarm_snapshot(timed, get_dht_time(), run_id, run)
