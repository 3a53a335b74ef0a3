"""Names peers must agree on to find each other: DHT keys, averaging prefixes and RPC handler names.

Everything a run's peers write is namespaced by the run id (see `run_config.RunConfig.run_id`), so peers of
different runs share a DHT without ever matching into the same averaging group or reading each other's
records. Only the run announcements live under a fixed key: a joiner reads them before it knows the run id.
Keys read through hivemind's `SchemaValidator` are spelled `<prefix>_<field>`, as it derives them.
"""

from __future__ import annotations

KEY_PREFIX = "hetero-node"
RUNS_FIELD = "runs"
PEERS_FIELD = "peers"
RUN_KEY_HANDLER = f"{KEY_PREFIX}.run-key"
"""Unary RPC a bootstrap answers with the public key that signs its run announcement."""


def runs_key() -> str:
    """DHT key every bootstrap announces its run under (subkey: its public key)."""
    return f"{KEY_PREFIX}_{RUNS_FIELD}"


def run_prefix(run_id: str) -> str:
    return f"{KEY_PREFIX}_{run_id}"


def peers_key(run_id: str) -> str:
    """DHT key of a run's peer records (subkey: each peer's public key)."""
    return f"{run_prefix(run_id)}_{PEERS_FIELD}"


def roster_key(run_id: str, shard: int, round_: int) -> str:
    """DHT key of the statements of one shard's round (subkey: each member's public key; `protocol/roster.py`)."""
    return f"{run_prefix(run_id)}_roster{shard}_{round_}"


def seals_key(run_id: str, shard: int, round_: int) -> str:
    """DHT key of the seals of one shard's round (subkey: each member's public key; `protocol/roster.py`)."""
    return f"{run_prefix(run_id)}_seals{shard}_{round_}"


def verdicts_key(run_id: str, shard: int, round_: int) -> str:
    """DHT key of the loss verdicts of one shard's round (subkey: each judge's public key; `protocol/admission.py`)."""
    return f"{run_prefix(run_id)}_verdicts{shard}_{round_}"


def certificates_key(run_id: str, shard: int, round_: int) -> str:
    """DHT key of the certificate of one shard's round as the members that decided it hold it (subkey: each of
    them; `protocol/quorum.py`)."""
    return f"{run_prefix(run_id)}_certs{shard}_{round_}"


def blob_handler_name(run_id: str) -> str:
    """P2P stream handler that serves a peer's round payloads and shard states."""
    return f"{KEY_PREFIX}.{run_id}.blob"


def stage_handler_name(run_id: str) -> str:
    """P2P stream handler a stage peer receives its virtual replica's pipeline messages on."""
    return f"{KEY_PREFIX}.{run_id}.stage"
