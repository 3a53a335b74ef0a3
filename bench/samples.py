"""Valid inputs that benches and tests start from and change field by field (a peer record as the DHT holds it)."""

from __future__ import annotations

from typing import Any


def record_fields(peer_id: str, /, **changes: Any) -> dict[str, Any]:
    """A schema-valid peer record of a joining peer, with `changes`."""
    record = {
        "peer_id": peer_id, "addrs": [], "version": "0.1.0", "gpus": [], "devices": 1, "cpu_cores": 2, "ram_gb": 8.0,
        "memory_gb": 4.0, "upload_mbps": 50.0, "download_mbps": 50.0, "bandwidth_source": "override", "rtt_ms": 0.0,
        "tokens_per_s": 100.0, "role": "joining", "requested_role": "auto", "pinned_stage": -1, "stage": -1, "vr": -1,
        "claimed_at": 0.0, "round": 0, "certified": 0, "train_round": -1, "deadline": 0.0, "step_s": 0.0,
        "overhead_s": 0.0, "loss": None, "fingerprints": {}, "view": "", "last_round": None, "refresh_s": 2.0,
        "written_at": 0.0, "member_proof": "",
    }  # fmt: skip
    return {**record, **changes}


RECORD_EDGES: dict[str, list[Any]] = {
    "upload_mbps": [0.0, 1e-9, 1.0, 1e6],
    "download_mbps": [0.0, 1e-9, 1e6],
    "rtt_ms": [0.0, 1e-3, 1e4],
    "tokens_per_s": [0.0, 1e-6, 1e9],
    "memory_gb": [0.0, 0.001, 1e5],
    "role": ["joining", "full", "stage", "standby"],
    "requested_role": ["auto", "full", "stage"],
    "pinned_stage": [-1, 0, 1, 1023],
    "stage": [-1, 0, 1, 1023],
    "vr": [-1, 0, 1, 10**6],
    "claimed_at": [0.0, 1.0, 1e11],
    "round": [0, 1, 10**9],
    "certified": [0, 10**9],
    "train_round": [-1, 0, 10**9],
    "deadline": [0.0, 1e11],
    "step_s": [0.0, 1e-9, 1e5],
    "overhead_s": [0.0, 1e5],
    "devices": [1, 64],
    "addrs": [[], ["/ip4/10.0.0.1/tcp/1/p2p/QmRelayNotInTheSwarmxxxxxxxxxxxxxxxxxxxxxxx/p2p-circuit"]],
    "fingerprints": [{}, {"0": "ab" * 8, "1": "cd" * 8, "fixed": "ef" * 8}],
}
"""Values at the edges of what the record schema accepts (0 and 10⁶ Mbit/s, 10⁹ tokens/s, stage 1023, vr 10⁶,
deadlines at 10¹¹, relays that are not there): schema-valid records no planner or view may crash on."""
