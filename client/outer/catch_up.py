"""Sparse catch-up: a member that missed round t's group, but holds θ(t), rebuilds θ(t+1) from the round's messages.

Every member that completed round t serves its manifest (who contributed, with which digest and weight, the start
fingerprint and the result's fingerprint) and re-serves the messages it aggregated. The late member fetches the
manifests of up to `CORROBORATING_DONORS` such peers and keeps the result two of them state (every member of a group
states the same one; a lone liar cannot name another), then fetches the messages from one donor that states it,
checks every digest, combines them with the run's outer method exactly as the group did, and accepts the result
only if its fingerprint is that one. Donors are asked in random order (`catch_up_driver`). A round only one donor
answers for is taken on that donor's word only when it was the only donor there, or when most records at round t+1
advertise the result it states; otherwise the member loads a vouched state instead.
That costs the round's messages (min(R, K) × 0.0273·N bytes for SparseLoCo, K = `--max-contributors`) instead of the
shard's whole state (4·N bytes).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

from hetero_node.models.shards import fingerprint
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.round_wire import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    digest,
    manifest_certificate,
    message_kind,
    parse_manifest,
)

if TYPE_CHECKING:
    from hetero_node.client.outer.shard_sync import ShardSync

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaughtUp:
    """θ(t+1) of one shard rebuilt from round t's messages, and what it cost."""

    tensors: list[Tensor]
    bytes_received: int
    donor: str
    digests: dict[str, str]
    """Peer id → digest of each message the round aggregated (a member can see whether its own was used)."""
    certificate: Certificate | None
    """The certificate the round's members hold after it, as their manifests state it: the catching-up member's
    next quorum base."""


CORROBORATING_DONORS = 3
"""Manifests fetched before any message: enough for two honest ones to outvote a liar among the first donors."""


def catch_up_shard(
    sync: ShardSync,
    round_: int,
    start: list[Tensor],
    start_fp: str,
    donors: list[str],
    timeout_s: float,
    vouched: str | None = None,
    serve: bool = True,
) -> CaughtUp | None:
    """θ(t+1) of `sync`'s shard from the manifest and messages of `round_`, served by the first of `donors` (peer
    ids, best first) whose manifest states the corroborated result and whose messages rebuild it; None when none
    does. `vouched`: the θ(t+1) fingerprint most peers at round t+1 advertise, if any (what makes a lone manifest
    believable while other donors exist). `serve`: serve the rebuilt round again (`serve_again`); not for a heal
    inside round t+1, whose members read our round-t manifest as the set we applied when we stated t+1."""
    from hivemind.p2p import PeerID

    runtime, method = sync.runtime, sync.method
    manifests = _manifests(sync, round_, start_fp, donors, timeout_s)
    claim = _corroborated(manifests, alone=len(donors) == 1, vouched=vouched)
    if not manifests:
        return None
    if claim is None:
        logger.warning("round %d of shard %d: donors state different results %s", round_, sync.shard,
                       sorted({m["result_fp"] for m, _ in manifests.values()}))  # fmt: skip
        return None
    result_fp = claim[0]
    for donor, (manifest, raw) in manifests.items():
        if _claim(manifest) != claim:
            continue
        peer = PeerID.from_base58(donor)
        shared = [t.clone() for t in method.shared_state() or []]
        try:
            received, messages, blobs = len(raw), [], {}
            for _, message_digest, _ in manifest["members"]:
                _, blob = runtime.fetch(
                    peer, message_kind(message_digest), sync.shard, round_, method.max_message_bytes, timeout_s
                )
                if digest(blob) != message_digest:
                    raise PayloadError(f"message {message_digest} arrived with another digest")
                received += len(blob)
                blobs[message_digest] = blob
                messages.append(method.decode(blob))
            if not messages:  # a void round: θ(t+1) = θ(t)
                new = [s.clone() for s in start]
            else:
                names = [m[0] for m in manifest["members"]]
                combined = method.combine(messages, [float(m[2]) for m in manifest["members"]], names)
                if len(combined.used) != len(messages):
                    raise PayloadError("the manifest lists a message the rule drops")
                new = method.update(start, combined)
            if fingerprint(new) != result_fp:
                raise PayloadError("the rebuilt state does not match the manifest's result fingerprint")
        except Exception as e:  # a bad donor is skipped, never trusted
            if shared:
                method.load_shared_state(shared)  # undo a momentum update of a rejected rebuild
            logger.warning("catching up round %d of shard %d from %s failed: %r", round_, sync.shard, donor, e)
            continue
        logger.warning(
            "caught up round %d of shard %d from its %d messages (%d bytes) served by %s",
            round_, sync.shard, len(messages), received, donor,
        )  # fmt: skip
        if serve:
            serve_again(sync, round_, raw, blobs)
        digests = {name: d for name, d, _ in manifest["members"]}
        return CaughtUp(new, received, donor, digests, manifest_certificate(manifest))
    return None


def serve_again(sync: ShardSync, round_: int, manifest: bytes, messages: dict[str, bytes]) -> None:
    """Serve a round we rebuilt as its members do (its manifest and messages, verified): the next member to catch up
    finds two donors whose manifests agree, not a lone one it may not believe and a state to load instead."""
    for message_digest, blob in messages.items():
        sync.runtime.publish(message_kind(message_digest), sync.shard, round_, blob)
    sync.runtime.publish(MANIFEST, sync.shard, round_, manifest)


def agreed_certificate(
    sync: ShardSync, round_: int, donors: list[str], timeout_s: float
) -> tuple[bool, Certificate | None]:
    """The certificate the members of `round_` hold after it, as the manifests of the first `CORROBORATING_DONORS`
    of `donors` that serve one state it (two alike, or the only donor's): (whether one was agreed, which). What a
    member that loaded a state of round `round_` + 1 takes as its base; without it, it follows the deciders."""
    manifests = _manifests(sync, round_, None, donors, timeout_s)
    stated = Counter(manifest_certificate(manifest) for manifest, _ in manifests.values())
    return _most_stated(stated, believe_lone=lambda _: len(donors) == 1)


def _manifests(
    sync: ShardSync, round_: int, start_fp: str | None, donors: list[str], timeout_s: float
) -> dict[str, tuple[dict, bytes]]:
    """The first `CORROBORATING_DONORS` donors' manifests of `round_` that start where we are (`start_fp`; None: from
    anywhere), with their bytes."""
    found: dict[str, tuple[dict, bytes]] = {}
    for donor in donors:
        if len(found) == CORROBORATING_DONORS:
            break
        got = fetch_manifest(sync, round_, donor, timeout_s)
        if got is None:
            continue
        manifest, _ = got
        if start_fp is not None and manifest["start_fp"] != start_fp:
            logger.info("round %d manifest of %s starts from %s, not ours", round_, donor, manifest["start_fp"])
            continue
        found[donor] = got
    return found


def fetch_manifest(sync: ShardSync, round_: int, donor: str, timeout_s: float) -> tuple[dict[str, Any], bytes] | None:
    """`donor`'s manifest of `round_` for the shard, strictly parsed, and its bytes; None if it serves none usable
    (it was not in the round's set) or does not answer."""
    from hivemind.p2p import PeerID

    try:
        _, data = sync.runtime.fetch(PeerID.from_base58(donor), MANIFEST, sync.shard, round_, MAX_MANIFEST_BYTES,
                                     timeout_s)  # fmt: skip
        return parse_manifest(data, round_), data
    except Exception as e:  # no manifest, a bad one, or a peer gone: the caller asks the next donor
        logger.info("no usable round %d manifest of shard %d from %s: %r", round_, sync.shard, donor, e)
        return None


def _claim(manifest: dict[str, Any]) -> tuple[str, Certificate | None]:
    """What a manifest states of its round's outcome: the result, and the certificate its members hold after it."""
    return manifest["result_fp"], manifest_certificate(manifest)


def _corroborated(
    manifests: dict[str, tuple[dict, bytes]], alone: bool, vouched: str | None
) -> tuple[str, Certificate | None] | None:
    """The claim (`_claim`) two manifests state (the most stated one); a lone manifest's own only when its donor
    was the only one (`alone`) or the records vouch for its result; else None (the caller loads a vouched state
    instead: a lone manifest among silent donors was the review's poisoned catch-up)."""
    agreed, claim = _most_stated(Counter(_claim(m) for m, _ in manifests.values()), lambda c: alone or c[0] == vouched)
    if not agreed and len(manifests) == 1:
        ((lone, _),) = manifests.values()
        logger.warning("only one of the donors asked serves a manifest; its result %s is not what most records at "
                       "the next round vouch for (%s): not believed", lone["result_fp"], vouched or "-")  # fmt: skip
    return claim


K = TypeVar("K")


def _most_stated(stated: Counter[K], believe_lone: Callable[[K], bool]) -> tuple[bool, K | None]:
    """(whether a value is agreed, which): the one two or more sources state, with no other stated as often; a lone
    source's only if `believe_lone` says so."""
    if sum(stated.values()) == 1:
        (lone,) = stated
        return (True, lone) if believe_lone(lone) else (False, None)
    best = stated.most_common(2)
    if not best or best[0][1] < 2 or (len(best) == 2 and best[1][1] == best[0][1]):
        return False, None
    return True, best[0][0]
