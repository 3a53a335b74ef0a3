"""What the members of a shard's group exchange around the messages of one outer round: the statement each stores
in the round's roster (`protocol/roster.py`), the round's manifest, and the blob kinds and digests that name a
round's messages.

Every member parses what the others send with these rules, so they live in `protocol/`: a field added or a bound
changed here changes what two peers accept from each other (bump `PROTOCOL_VERSION`). The transport that sends
them (groups, streams, relays) is `client/outer/shard_sync.py`; a late member reads manifests in
`client/outer/catch_up.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.swarm_key import PROOF_PATTERN

PAYLOAD, MANIFEST = "payload", "manifest"
"""Blob kinds: a member's own message of a round, and the round's manifest."""
MESSAGE_PREFIX = "msg:"
"""Blob kinds that start so are copies of a round's message, named by its digest (`message_kind`)."""
MAX_MANIFEST_BYTES = 1 << 20
MAX_MANIFEST_MEMBERS = 4096
MAX_NAME_CHARS = 128
"""Longest peer id a manifest may list."""
MAX_TOKENS = 1 << 40
MAX_ROUND = 10**9
HEX = re.compile(r"^[0-9a-f]{8,64}$")
PROOF = re.compile(PROOF_PATTERN)
META_FIELDS = frozenset({"round", "start_fp", "size", "digest", "tokens", "proof"})
MANIFEST_FIELDS = frozenset({"round", "start_fp", "result_fp", "members", "certificate"})
CERTIFICATE_FIELDS = frozenset({"round", "members", "start_fp"})


def message_kind(digest: str) -> str:
    """Blob kind under which every member re-serves a round's message with this digest (for relays and catch-up)."""
    return f"{MESSAGE_PREFIX}{digest}"


def reveals_a_message(kind: str) -> bool:
    """Whether blobs of `kind` carry a member's message of a round (its own, or a copy): commit, then reveal."""
    return kind == PAYLOAD or kind.startswith(MESSAGE_PREFIX)


def digest(data: bytes) -> str:
    """A message's digest as members announce and check it."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class GroupMeta:
    """What each member states about its contribution in the round's roster (checked before anything uses it)."""

    round: int
    start_fp: str
    size: int
    """Bytes of its message (0: it receives only)."""
    digest: str
    tokens: int
    """Tokens it trained this round: the weight of its message."""
    proof: str
    """Its member proof in a private swarm ("" in a public one): the group leaves out members without one."""

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def parse(cls, raw: Any, max_size: int) -> GroupMeta | None:
        """A peer's gathered metadata, or None when any field is missing, mistyped or out of range (a malformed
        member is left out of the round; it must never crash the others)."""
        if not isinstance(raw, dict) or set(raw) != META_FIELDS:
            return None
        if not (isinstance(raw["proof"], str) and PROOF.match(raw["proof"])):
            return None
        ints = [raw["round"], raw["size"], raw["tokens"]]
        if any(type(v) is not int for v in ints) or not (0 <= raw["round"] <= MAX_ROUND):
            return None
        if not (0 <= raw["size"] <= max_size and 0 <= raw["tokens"] <= MAX_TOKENS):
            return None
        if not (isinstance(raw["start_fp"], str) and HEX.match(raw["start_fp"])):
            return None
        if not (isinstance(raw["digest"], str) and (raw["digest"] == "" or HEX.match(raw["digest"]))):
            return None
        if (raw["size"] == 0) != (raw["tokens"] == 0) or (raw["size"] == 0) != (raw["digest"] == ""):
            return None
        return cls(**raw)


def encode_manifest(
    round_: int,
    start_fp: str,
    result_fp: str,
    members: Sequence[tuple[str, str, int]],
    certificate: Certificate | None = None,
) -> bytes:
    """The round's manifest: who contributed (name, digest, tokens) in canonical order, start and result, and the
    certificate its server holds after the round (the next round's quorum base: a member that takes θ(t+1) from
    this manifest, or a state of round t+1, takes that base too, so it decides round t+1 against the same base as
    the members that decided round t). No members: the round was void (nobody completed it), θ(t+1) = θ(t)."""
    body = {
        "round": round_, "start_fp": start_fp, "result_fp": result_fp, "members": [list(m) for m in members],
        "certificate": None if certificate is None else certificate.to_dict(),
    }  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


def parse_manifest(data: bytes, round_: int) -> dict[str, Any]:
    """A peer's manifest of `round_`, strictly checked; PayloadError otherwise."""
    try:
        body = json.loads(data)
        members = body["members"]
        ok = (
            set(body) == MANIFEST_FIELDS
            and body["round"] == round_
            and all(isinstance(body[k], str) and HEX.match(body[k]) for k in ("start_fp", "result_fp"))
            and isinstance(members, list)
            and len(members) <= MAX_MANIFEST_MEMBERS
            and all(_is_manifest_member(m) for m in members)
            and _is_certificate(body["certificate"], round_)
        )
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise PayloadError(f"malformed manifest of round {round_}")
    return body


def manifest_certificate(manifest: dict[str, Any]) -> Certificate | None:
    """The certificate a parsed manifest states (None: its server held none)."""
    return Certificate.from_dict(manifest["certificate"])


def parse_certificate(raw: Any, round_: int) -> Certificate | None:
    """A certificate of round `round_` or earlier as a peer sent it (in a manifest, or in the DHT), strictly checked:
    at most MAX_MANIFEST_MEMBERS peer ids; None if it is not one."""
    certificate = Certificate.from_dict(raw)
    if certificate is None or set(raw) != CERTIFICATE_FIELDS or not 0 <= certificate.round <= round_:
        return None
    if not HEX.match(certificate.start_fp) or len(raw["members"]) > MAX_MANIFEST_MEMBERS:
        return None
    return certificate if all(0 < len(m) <= MAX_NAME_CHARS for m in certificate.members) else None


def _is_certificate(raw: Any, round_: int) -> bool:
    return raw is None or parse_certificate(raw, round_) is not None


def _is_manifest_member(m: Any) -> bool:
    """[peer id, digest, tokens] with a positive weight: a manifest lists only messages the round aggregated."""
    return (
        isinstance(m, list)
        and len(m) == 3
        and isinstance(m[0], str)
        and len(m[0]) <= MAX_NAME_CHARS
        and isinstance(m[1], str)
        and bool(HEX.match(m[1]))
        and type(m[2]) is int
        and 0 < m[2] <= MAX_TOKENS
    )
