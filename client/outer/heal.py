"""Healing a round its members applied with different contributor sets: the wider set wins, sets only grow.

Round t's members can apply different sets: one that gave up waiting for a slow member's seal leaves out what only
that seal listed (seen on a GPU, where a peer still busy with its first steps sealed seconds late). Round t+1's
statements show it: their start fingerprints differ. Then a member fetches the round-t manifest behind each other
fingerprint (the set its holders applied, served for KEPT_ROUNDS rounds) and, when one set contains all the others
(`protocol/roster.py: widest`) and every message in it has a signed round-t statement, takes that set as round t's:
a member holding a smaller set rebuilds θ(t+1) from the θ(t) it kept and that set's messages (`catch_up_shard`,
which checks the result's fingerprint), and every member seals round t+1 on the wider set's fingerprint, counting
the statements of members still healing to it. No tie, no state download, no round lost: the old rule (the most
common fingerprint wins, a tie includes nobody) voided a 1–1 split forever.

Only for methods whose messages are re-served (SparseLoCo); DiLoCo's dense messages are not, and a member that
disagrees there loads a state as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import Tensor

from hetero_node.client.outer.catch_up import catch_up_shard, fetch_manifest
from hetero_node.protocol.roster import widest
from hetero_node.protocol.round_wire import GroupMeta
from hetero_node.protocol.round_wire import digest as digest_of

if TYPE_CHECKING:
    from hetero_node.client.outer.shard_sync import PendingRound, ShardSync

logger = logging.getLogger(__name__)

MANIFEST_TIMEOUT_S = 5.0
"""A manifest is a few kilobytes: a holder that cannot serve one in this long (frozen, gone) is asked no longer, so a
stale member's fingerprint cannot hold a round up for the whole fetch deadline."""

Contribution = tuple[str, str, int]
"""(author, digest, tokens): one message a round aggregated, as its manifest lists it."""


@dataclass(frozen=True)
class Applied:
    """What this member applied in round `round` of a shard: the evidence a heal starts from."""

    round: int
    start: list[Tensor]
    """θ(t), kept for one round so a smaller set can be rebuilt into the wider one."""
    start_fp: str
    members: frozenset[Contribution]
    deferred: bytes | None
    """Our own message, when our set did not aggregate it (`defer` kept its Δ owed)."""


@dataclass(frozen=True)
class Agreed:
    """Round t+1's start as the heal settled it: its fingerprint, and the start fingerprints whose statements count
    (every one whose round-t set is inside the winner's: their holders heal to it)."""

    start_fp: str
    counted: frozenset[str]


def heal(sync: ShardSync, pending: PendingRound, statements: dict[str, GroupMeta]) -> Agreed | None:
    """Settle round t+1's start when `statements` disagree on it (see the module docstring); rebuilds our θ(t+1)
    into `pending` if ours is the smaller set. None when there is nothing to heal or no heal is possible (then the
    most common fingerprint decides, as for DiLoCo)."""
    applied = sync.applied
    fps = {meta.start_fp for meta in statements.values()}
    if len(fps) < 2 or applied is None or applied.round != pending.round - 1 or not sync.heals:
        return None
    mine = pending.meta.start_fp
    holders = {fp: sorted(a for a, m in statements.items() if m.start_fp == fp and a != sync.me) for fp in fps}
    sets = {mine: applied.members}
    for fp in sorted(fps - {mine}):
        members = _applied_by(sync, holders[fp], applied)
        if members is not None:
            sets[fp] = members
    target = widest(sets)
    if target is None:
        logger.warning("shard %d round %d: start fingerprints differ and no applied set of round %d holds the "
                       "others", sync.shard, pending.round, applied.round)  # fmt: skip
        return None
    if target != mine and not _rebuild(sync, pending, applied, sets[target], holders[target], target):
        return None
    return Agreed(target, frozenset(sets))


def _applied_by(sync: ShardSync, holders: list[str], applied: Applied) -> frozenset[Contribution] | None:
    """The set the first of `holders` that serves round t's manifest applied, if it started where we did."""
    for holder in holders:
        got = fetch_manifest(sync, applied.round, holder, min(MANIFEST_TIMEOUT_S, sync.timeouts.fetch_timeout_s))
        manifest = None if got is None else got[0]
        if manifest is not None and manifest["start_fp"] == applied.start_fp:
            return frozenset((name, digest, tokens) for name, digest, tokens in manifest["members"])
    return None


def _rebuild(
    sync: ShardSync,
    pending: PendingRound,
    applied: Applied,
    wider: frozenset[Contribution],
    donors: list[str],
    target: str,
) -> bool:
    """Rebuild our θ(t+1) from the wider set, if every message in it was stated in round t's roster (a member
    cannot widen a round with a message nobody stated); on success `pending` starts from it."""
    stated = sync.roster(applied.round).statements() or {}
    unstated = [name for name, digest, tokens in wider
                if name not in stated or (stated[name].digest, stated[name].tokens) != (digest, tokens)]  # fmt: skip
    if unstated:
        logger.warning("shard %d round %d: a wider set lists messages without a round-%d statement (%s); not healing",
                       sync.shard, pending.round, applied.round, ", ".join(sorted(unstated)))  # fmt: skip
        return False
    rebuilt = catch_up_shard(sync, applied.round, applied.start, applied.start_fp, donors,
                             sync.timeouts.fetch_timeout_s, serve=False)  # fmt: skip
    if rebuilt is None or set(rebuilt.digests.items()) != {(name, digest) for name, digest, _ in wider}:
        return False
    if applied.deferred is not None and rebuilt.digests.get(sync.me) == digest_of(applied.deferred):
        sync.method.count_deferred(applied.deferred, pending.snapshot)
    logger.warning("shard %d round %d: healed round %d to the wider set of %d messages (we applied %d)",
                   sync.shard, pending.round, applied.round, len(wider), len(applied.members))  # fmt: skip
    pending.start = rebuilt.tensors
    pending.meta = replace(pending.meta, start_fp=target)
    sync.adopt(rebuilt.certificate)
    return True
