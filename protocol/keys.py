"""Names peers must agree on to find each other: DHT keys, averaging prefixes and RPC handler names.

All are namespaced by the run id (see `run_config.RunConfig.run_id`), so peers of different runs share a DHT
without ever matching into the same averaging group or reading each other's records.
"""

from __future__ import annotations

KEY_PREFIX = "hetero-node"


def progress_key(run_id: str) -> str:
    """DHT key under which every peer stores its progress record (subkey: its peer id)."""
    return f"{KEY_PREFIX}.{run_id}.progress"


def shard_group_prefix(run_id: str, shard: int) -> str:
    """hivemind averager prefix of one parameter shard's averaging group."""
    return f"{KEY_PREFIX}_{run_id}_shard{shard}"


def blob_handler_name(run_id: str) -> str:
    """P2P stream handler that serves a peer's round payloads and shard states."""
    return f"{KEY_PREFIX}.{run_id}.blob"
