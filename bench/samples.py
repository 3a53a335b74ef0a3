"""Valid inputs that benches and tests start from and change field by field (a peer record as the DHT holds it)."""

from __future__ import annotations

from typing import Any


def record_fields(peer_id: str, /, **changes: Any) -> dict[str, Any]:
    """A schema-valid peer record of a joining peer, with `changes`."""
    record = {
        "peer_id": peer_id, "addrs": [], "version": "0.1.0", "gpus": [], "devices": 1, "cpu_cores": 2, "ram_gb": 8.0,
        "memory_gb": 4.0, "upload_mbps": 50.0, "download_mbps": 50.0, "bandwidth_source": "override",
        "tokens_per_s": 100.0, "role": "joining", "requested_role": "auto", "pinned_stage": -1, "stage": -1, "vr": -1,
        "claimed_at": 0.0, "round": 0, "certified": 0, "train_round": -1, "deadline": 0.0, "step_s": 0.0,
        "overhead_s": 0.0, "loss": None, "fingerprints": {}, "view": "", "last_round": None, "refresh_s": 2.0,
        "written_at": 0.0, "member_proof": "",
    }  # fmt: skip
    return {**record, **changes}
