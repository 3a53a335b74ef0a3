"""Who takes part in a round, read from peer records: full replicas, and the stages of complete virtual replicas.

A shard's averaging group holds every full replica plus, from each complete virtual replica, the peer serving
that shard's stage; a virtual replica counts as one replica. An incomplete one (a stage missing) cannot train,
so the groups do not wait for it.
"""

from __future__ import annotations

from typing import Any

from hetero_node.client.swarm.planner import ROLE_FULL, ROLE_STAGE

Records = dict[str, dict[str, Any]]


def full_replicas(records: Records) -> Records:
    return {pid: r for pid, r in records.items() if r.get("role") == ROLE_FULL}


def virtual_replicas(records: Records, n_stages: int) -> dict[int, dict[int, str]]:
    """Complete virtual replicas: vr → {stage: peer id}; of two records claiming one slot the lower id wins."""
    slots: dict[int, dict[int, str]] = {}
    for pid, r in sorted(records.items()):
        if r.get("role") == ROLE_STAGE and r.get("vr", -1) >= 0 and 0 <= r.get("stage", -1) < n_stages:
            slots.setdefault(r["vr"], {}).setdefault(r["stage"], pid)
    return {vr: held for vr, held in sorted(slots.items()) if len(held) == n_stages}


def shard_members(records: Records, shard: int, n_stages: int) -> list[str]:
    """Peer ids of the shard's averaging group as the records describe it."""
    stage_peers = [held[shard] for held in virtual_replicas(records, n_stages).values()]
    return sorted([*full_replicas(records), *stage_peers])


def expected_group_size(records: Records, round_: int, shard: int, n_stages: int) -> int:
    """Members of the shard's group that are in `round_` (at least 2: a group of one is a solo step)."""
    members = shard_members(records, shard, n_stages)
    return max(2, sum(1 for pid in members if records[pid].get("round") == round_))


def replica_count(records: Records, n_stages: int) -> int:
    """Full replicas plus complete virtual replicas."""
    return len(full_replicas(records)) + len(virtual_replicas(records, n_stages))


def shard_donors(records: Records, shard: int) -> Records:
    """Peers that serve the shard's state: full replicas, and stage peers of that stage."""
    return {
        pid: r
        for pid, r in records.items()
        if r.get("role") == ROLE_FULL or (r.get("role") == ROLE_STAGE and r.get("stage") == shard)
    }
