"""The DHT records peers publish about themselves and about the run, and the validators that guard them.

Two record families, both stored as DHT dictionaries whose subkey is the writer's RSA public key
(`[owner:...]`), so hivemind's `RSASignatureValidator` lets only that key write them:

* `hetero-node_runs` — one `RunAnnouncement` per bootstrap: the run definition joiners need.
* `hetero-node_<run_id>_peers` — one `PeerRecord` per node: what it measured and what it does.

`SchemaValidator` (hivemind's, pydantic v1 API) rejects any value that does not parse *without type
conversion* into these models, so every number field is strict and bounded: negative bandwidth, 10^6 GPUs or a
NaN loss never reach the planner. Validation happens on every node that stores or reads a record.
"""

from __future__ import annotations

from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from pydantic.v1 import conbytes, confloat, conint, conlist, constr

from hetero_node.protocol.keys import KEY_PREFIX, run_prefix
from hetero_node.protocol.roles import (
    REQUEST_AUTO,
    REQUEST_FULL,
    REQUEST_STAGE,
    REQUESTED_ROLES,
    ROLE_FULL,
    ROLE_JOINING,
    ROLE_STAGE,
    ROLES,
)
from hetero_node.protocol.swarm_key import PROOF_PATTERN, open_value, seal_value

PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{32,64}$"
"""A base58 libp2p peer id."""

MAX_GPUS = 64
MAX_MEMORY_GB = 100_000.0
MAX_MBPS = 1_000_000.0
MAX_RTT_MS = 10_000.0
MAX_SHARDS = 1024
FingerprintKey = constr(strict=True, regex=r"^(\d{1,4}|fixed|embed)$")


class GpuInfo(pydantic.BaseModel):
    name: constr(strict=True, max_length=128)  # type: ignore[valid-type]
    memory_gb: confloat(strict=True, ge=0, le=4096)  # type: ignore[valid-type]


class RoundSummary(pydantic.BaseModel):
    """A peer's last finished round as it recorded it: what the dashboard plots without reading anyone's files."""

    round: conint(strict=True, ge=0, le=10**9)  # type: ignore[valid-type]
    contributed: pydantic.StrictBool
    deferred: pydantic.StrictBool = False
    """Its message was valid but not selected this round (`--max-contributors`): owed for a later one."""
    eval_loss: confloat(strict=True, ge=0, le=1e4) | None  # type: ignore[valid-type]
    bytes_sent: conint(strict=True, ge=0, le=10**15)  # type: ignore[valid-type]
    bytes_received: conint(strict=True, ge=0, le=10**15)  # type: ignore[valid-type]


class PeerRecord(pydantic.BaseModel):
    """What one node tells the swarm, refreshed by its heartbeat; every field is required."""

    peer_id: constr(strict=True, regex=PEER_ID_PATTERN)  # type: ignore[valid-type]
    addrs: conlist(constr(strict=True, max_length=256), max_items=16)  # type: ignore[valid-type]
    version: constr(strict=True, max_length=32)  # type: ignore[valid-type]
    gpus: conlist(GpuInfo, max_items=MAX_GPUS)  # type: ignore[valid-type]
    devices: conint(strict=True, ge=1, le=MAX_GPUS)  # type: ignore[valid-type]
    """Devices this node trains its one replica on (`--devices`: local ranks, data parallel); `memory_gb` is one
    device's budget (each holds the whole model), `tokens_per_s` the whole node's."""
    cpu_cores: conint(strict=True, ge=1, le=4096)  # type: ignore[valid-type]
    ram_gb: confloat(strict=True, ge=0, le=MAX_MEMORY_GB)  # type: ignore[valid-type]
    memory_gb: confloat(strict=True, ge=0, le=MAX_MEMORY_GB)  # type: ignore[valid-type]
    upload_mbps: confloat(strict=True, ge=0, le=MAX_MBPS)  # type: ignore[valid-type]
    download_mbps: confloat(strict=True, ge=0, le=MAX_MBPS)  # type: ignore[valid-type]
    bandwidth_source: constr(strict=True, regex=r"^(measured|override|unknown)$")  # type: ignore[valid-type]
    rtt_ms: confloat(strict=True, ge=0, le=MAX_RTT_MS)  # type: ignore[valid-type]
    """Round trip to its first initial peer that answers pings (the bootstrap, usually), in ms (0: not measured). The
    planner prices each pipeline boundary and exchange hop with it."""
    tokens_per_s: confloat(strict=True, ge=0, le=1e9)  # type: ignore[valid-type]
    role: constr(strict=True, regex=f"^({'|'.join(ROLES)})$")  # type: ignore[valid-type]
    requested_role: constr(strict=True, regex=f"^({'|'.join(REQUESTED_ROLES)})$")  # type: ignore[valid-type]
    pinned_stage: conint(strict=True, ge=-1, lt=MAX_SHARDS)  # type: ignore[valid-type]
    stage: conint(strict=True, ge=-1, lt=MAX_SHARDS)  # type: ignore[valid-type]
    vr: conint(strict=True, ge=-1, le=1_000_000)  # type: ignore[valid-type]
    round: conint(strict=True, ge=0, le=10**9)  # type: ignore[valid-type]
    """The round whose start weights θ(t) this peer holds."""
    certified: conint(strict=True, ge=0, le=10**9)  # type: ignore[valid-type]
    """The latest round whose θ this peer holds from a certified round (`protocol/quorum.py`), or from a peer that
    did: what "the swarm is ahead" reads. At most `round`: a round voided keeps θ and moves `round` alone."""
    train_round: conint(strict=True, ge=-1, le=10**9)  # type: ignore[valid-type]
    """The round this peer is training or contributing to (-1: none yet); one above `round` while an overlapped
    exchange is in flight."""
    claimed_at: confloat(strict=True, ge=0, le=1e11)  # type: ignore[valid-type]
    """DHT time at which this stage peer claimed its (vr, stage) slot (0: no slot). Of two claims on one slot the
    earlier keeps it, so an incumbent is never displaced by a late claimant acting on a stale view."""
    deadline: confloat(strict=True, ge=0, le=1e11)  # type: ignore[valid-type]
    """DHT time at which `train_round`'s training ends (0: not time-boxed yet); peers of a round adopt the
    earliest."""
    step_s: confloat(strict=True, ge=0, le=1e5)  # type: ignore[valid-type]
    """Seconds this replica takes per inner step, as last measured (0: unknown); sets the round length."""
    overhead_s: confloat(strict=True, ge=0, le=1e5)  # type: ignore[valid-type]
    """Seconds a round costs this replica outside its training (exchange, outer step, catch-up), as last measured
    (0: unknown); with `step_s` it sets the round length (`roles/schedule.py`)."""
    loss: confloat(strict=True, ge=0, le=1e4) | None  # type: ignore[valid-type]
    fingerprints: dict[FingerprintKey, constr(strict=True, regex=r"^[0-9a-f]{8,64}$")]  # type: ignore[valid-type]
    """Per held shard (its number), and in a subspace run the tables T_fixed ("fixed") and E_S ("embed")."""
    view: constr(strict=True, max_length=32)  # type: ignore[valid-type]
    last_round: RoundSummary | None
    """None until this peer has finished a round."""
    member_proof: constr(strict=True, regex=PROOF_PATTERN)  # type: ignore[valid-type]
    """A private swarm's proof that this peer holds the swarm key (`protocol/swarm_key.py`); "" in a public one."""
    refresh_s: confloat(strict=True, gt=0, le=3600)  # type: ignore[valid-type]
    written_at: confloat(strict=True, ge=0, le=1e11)  # type: ignore[valid-type]
    """DHT time its writer stored it, set at every refresh and signed with the rest: a reader counts the record live
    for 3 × `refresh_s` after it (at most 10 minutes), whatever expiration the writer asked the DHT for."""

    @pydantic.validator("fingerprints")
    def _few_shards(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_SHARDS:
            raise ValueError(f"more than {MAX_SHARDS} shard fingerprints")
        return value


class RunAnnouncement(pydantic.BaseModel):
    """A bootstrap's run definition; joiners rebuild `RunConfig` from `config` and check it hashes to `run_id`."""

    peer_id: constr(strict=True, regex=PEER_ID_PATTERN)  # type: ignore[valid-type]
    run_id: constr(strict=True, regex=r"^[0-9a-f]{16}$")  # type: ignore[valid-type]
    software_version: constr(strict=True, max_length=32)  # type: ignore[valid-type]
    protocol_version: conint(strict=True, ge=0)  # type: ignore[valid-type]
    data_source: constr(strict=True, max_length=256)  # type: ignore[valid-type]
    config: dict[constr(strict=True, max_length=64), Any]  # type: ignore[valid-type]
    private: pydantic.StrictBool
    """Only peers holding the swarm key take part (a joiner without one is told so, not left waiting)."""


MAX_SEALED_BYTES = 64 * 1024
"""A sealed record or announcement (a record is well under 1 KB; a run config a few KB)."""


class SealedRecord(pydantic.BaseModel):
    """A private swarm's `PeerRecord`: its author and member proof in the clear (what `MemberProofValidator` checks
    on every DHT node), the record itself sealed with the swarm key (`swarm_key.seal_value`)."""

    peer_id: constr(strict=True, regex=PEER_ID_PATTERN)  # type: ignore[valid-type]
    member_proof: constr(strict=True, regex=PROOF_PATTERN)  # type: ignore[valid-type]
    sealed: conbytes(strict=True, max_length=MAX_SEALED_BYTES)  # type: ignore[valid-type]


class SealedAnnouncement(pydantic.BaseModel):
    """A private swarm's `RunAnnouncement`: sealed, with only "private" in the clear, so a joiner without the key is
    told what it lacks."""

    peer_id: constr(strict=True, regex=PEER_ID_PATTERN)  # type: ignore[valid-type]
    private: pydantic.StrictBool
    sealed: conbytes(strict=True, max_length=MAX_SEALED_BYTES)  # type: ignore[valid-type]


class _PeersKey(pydantic.BaseModel):
    """Field name = keys.PEERS_FIELD: SchemaValidator derives the DHT key from it."""

    peers: dict[BytesWithPublicKey, PeerRecord | SealedRecord]  # type: ignore[valid-type]


class _RunsKey(pydantic.BaseModel):
    """Field name = keys.RUNS_FIELD."""

    runs: dict[BytesWithPublicKey, RunAnnouncement | SealedAnnouncement]  # type: ignore[valid-type]


def base_validators(signer: RSASignatureValidator) -> list[Any]:
    """Validators every hetero-node DHT starts with: signatures, and the run announcements' schema."""
    return [signer, SchemaValidator(_RunsKey, prefix=KEY_PREFIX)]


def run_validators(run_id: str) -> list[Any]:
    """Added once the run is known: the schema of that run's peer records."""
    return [SchemaValidator(_PeersKey, prefix=run_prefix(run_id))]


def _strict_parse(model: type[pydantic.BaseModel], value: Any) -> Any:
    """`value` as `model` without any type conversion, or None (pydantic raises TypeError, not a validation error,
    on a dict whose keys are not strings: msgpack allows them)."""
    if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        return None
    try:
        parsed = model.parse_obj(value)
    except (pydantic.ValidationError, TypeError, ValueError):
        return None
    return parsed if parsed.dict() == value else None


def parse_peer_record(value: Any, swarm_key: bytes | None = None) -> PeerRecord | None:
    """A record read from the DHT, re-checked here (a stock node on the path may not validate); None if invalid.
    With `swarm_key` (a private swarm) only a record sealed with it by the peer it names counts."""
    if swarm_key is None:
        return _strict_parse(PeerRecord, value)
    outer = _strict_parse(SealedRecord, value)
    return None if outer is None else _opened(PeerRecord, outer, swarm_key, _record_context(outer.peer_id))


def sealed_record(value: dict[str, Any], swarm_key: bytes | None) -> dict[str, Any]:
    """What a peer stores for its record `value`: the record itself, or in a private swarm a `SealedRecord`."""
    if swarm_key is None:
        return value
    peer_id = value["peer_id"]
    sealed = seal_value(swarm_key, value, _record_context(peer_id))
    return SealedRecord(peer_id=peer_id, member_proof=value["member_proof"], sealed=sealed).dict()


def parse_run_announcement(value: Any, swarm_key: bytes | None = None) -> RunAnnouncement | None:
    """A bootstrap's run announcement read from the DHT, strictly checked (opened with `swarm_key` if sealed); None
    if invalid or sealed with another key."""
    outer = _strict_parse(SealedAnnouncement, value)
    if outer is None:
        return _strict_parse(RunAnnouncement, value)
    return None if swarm_key is None else _opened(RunAnnouncement, outer, swarm_key, _run_context(outer.peer_id))


def is_sealed_announcement(value: Any) -> bool:
    """Whether a run announcement is a private swarm's (readable with its key only)."""
    return _strict_parse(SealedAnnouncement, value) is not None


def sealed_announcement(value: dict[str, Any], swarm_key: bytes | None) -> dict[str, Any]:
    """What a bootstrap stores for its announcement `value`: itself, or in a private swarm a `SealedAnnouncement`."""
    if swarm_key is None:
        return value
    peer_id = value["peer_id"]
    sealed = seal_value(swarm_key, value, _run_context(peer_id))
    return SealedAnnouncement(peer_id=peer_id, private=True, sealed=sealed).dict()


def _opened(model: type[pydantic.BaseModel], outer: Any, swarm_key: bytes, context: str) -> Any:
    """The `model` sealed in `outer` under `swarm_key` and `context` if it names the author `outer` names, else None."""
    inner = _strict_parse(model, open_value(swarm_key, outer.sealed, context))
    return inner if inner is not None and inner.peer_id == outer.peer_id else None


def _record_context(peer_id: str) -> str:
    return f"hetero-node record of {peer_id}"


def _run_context(peer_id: str) -> str:
    return f"hetero-node run announced by {peer_id}"


__all__ = [
    "REQUESTED_ROLES",
    "REQUEST_AUTO",
    "REQUEST_FULL",
    "REQUEST_STAGE",
    "ROLES",
    "ROLE_FULL",
    "ROLE_JOINING",
    "ROLE_STAGE",
    "GpuInfo",
    "PeerRecord",
    "RunAnnouncement",
    "SealedAnnouncement",
    "SealedRecord",
    "base_validators",
    "is_sealed_announcement",
    "parse_peer_record",
    "parse_run_announcement",
    "run_validators",
    "sealed_announcement",
    "sealed_record",
]
