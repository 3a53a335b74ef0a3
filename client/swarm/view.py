"""Who takes part in a round, read from peer records: full replicas, and the stages of complete virtual replicas.

A shard's averaging group holds every full replica plus, from each complete virtual replica, the peer serving
that shard's stage; a virtual replica counts as one replica. An incomplete one (a stage missing) cannot train,
so the groups do not wait for it. `slot_holders` is the one answer to "who holds (vr, stage)": the status view,
the stage peers and the groups all use it, so they never disagree during a contested slot.
"""

from __future__ import annotations

from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE

Records = dict[str, PeerRecord]


def full_replicas(records: Records) -> Records:
    return {pid: r for pid, r in records.items() if r.role == ROLE_FULL}


def slot_holders(records: Records, n_stages: int) -> dict[tuple[int, int], str]:
    """(vr, stage) → the peer holding it; of two records claiming one slot the earlier claim wins (then the lower
    peer id: the planner's rule), so the other is about to move."""
    holders: dict[tuple[int, int], str] = {}
    for pid, r in sorted(records.items(), key=lambda item: (item[1].claimed_at, item[0])):
        if r.role == ROLE_STAGE and r.vr >= 0 and 0 <= r.stage < n_stages:
            holders.setdefault((r.vr, r.stage), pid)
    return holders


def vr_stages(records: Records, vr: int, n_stages: int) -> dict[int, str]:
    """stage → holder of one virtual replica, complete or not."""
    return {s: pid for (v, s), pid in sorted(slot_holders(records, n_stages).items()) if v == vr}


def virtual_replicas(records: Records, n_stages: int, complete: bool = True) -> dict[int, dict[int, str]]:
    """vr → {stage: peer id}: the complete virtual replicas (all of them with `complete=False`)."""
    slots: dict[int, dict[int, str]] = {}
    for (vr, stage), pid in sorted(slot_holders(records, n_stages).items()):
        slots.setdefault(vr, {})[stage] = pid
    return {vr: held for vr, held in slots.items() if len(held) == n_stages or not complete}


def shard_members(records: Records, shard: int, n_stages: int) -> list[str]:
    """Peer ids of the shard's averaging group as the records describe it."""
    stage_peers = [held[shard] for held in virtual_replicas(records, n_stages).values()]
    return sorted([*full_replicas(records), *stage_peers])


def in_round(record: PeerRecord, round_: int) -> bool:
    """The peer trains `round_`, or contributes to it: it holds θ of `round_` or earlier and trains `round_` or
    later (under overlap it already trains the next round while `round_`'s exchange runs). A peer that only
    receives (train_round −1) is not in it."""
    return record.round <= round_ <= record.train_round


def coming(record: PeerRecord, round_: int) -> bool:
    """The group of `round_` should wait for this peer: it is in the round; or it is still finishing the round
    before (a slow replica catching up, which then trains what fits before the deadline and joins), or has just
    finished it and not yet started this one. A peer that only receives (train_round −1) is never waited for."""
    if record.train_round < 0:
        return False
    return in_round(record, round_) or (record.train_round == round_ - 1 and record.round in (round_ - 1, round_))


def coming_members(records: Records, round_: int, shard: int, n_stages: int) -> list[str]:
    """Members of the shard's group the round `round_` waits for."""
    return [pid for pid in shard_members(records, shard, n_stages) if coming(records[pid], round_)]


def replica_count(records: Records, n_stages: int) -> int:
    """Full replicas plus complete virtual replicas."""
    return len(full_replicas(records)) + len(virtual_replicas(records, n_stages))


def shard_donors(records: Records, shard: int) -> Records:
    """Peers that serve the shard's state: full replicas, and stage peers of that stage."""
    return {pid: r for pid, r in records.items() if r.role == ROLE_FULL or (r.role == ROLE_STAGE and r.stage == shard)}


def swarm_round(records: Records, me: str, certified: bool = False) -> int:
    """The round the others hold, as most of them tell it: the upper median of their rounds (0 when alone); with
    `certified`, of the rounds whose θ they hold from a certified round (`protocol/quorum.py`): what "the swarm is
    ahead" means, since a round a minority or a lone peer voided or applied alone is no progress.

    Not the maximum: one record claiming a far-ahead round must not send everyone to fetch it (a liar, or a clock
    gone wrong); one honest peer ahead of one behind still counts (the upper median of two is the larger).
    """
    rounds = sorted(r.certified if certified else r.round for pid, r in records.items() if pid != me)
    return rounds[len(rounds) // 2] if rounds else 0


def vouched_fingerprint(records: Records, round_: int, shard: str, me: str) -> str | None:
    """The fingerprint of `shard` ("0", "1", ..., or "fixed") that strictly more than half of the other peers at
    `round_` advertise; None without such a majority (a tie, or nobody there).

    A donor's blob matching the donor's own advertised fingerprint proves only that the donor is consistent; a state
    is believable when most peers that hold that round hold the same bits.
    """
    fps = [
        r.fingerprints[shard]
        for pid, r in records.items()
        if pid != me and r.round == round_ and shard in r.fingerprints
    ]
    return _strict_majority(fps)


def spans(record: PeerRecord, round_: int) -> bool:
    """Whether what `record` advertises now is what its peer held at `round_`: every round from its certified one
    to its current one was void for it (`PeerRecord.certified`), and a void round moves neither θ nor the tables."""
    return record.certified <= round_ <= record.round


def held_fingerprint(records: Records, round_: int, kind: str, me: str) -> str | None:
    """`vouched_fingerprint` counting every other peer whose record `spans` `round_`, not only those still there: a
    later stage whose sibling voided rounds alone learns from it that the table of `round_` did not move (waiting
    for a peer at exactly `round_`, it re-synced the same round forever while stage 0 voided on)."""
    fps = [r.fingerprints.get(kind) for pid, r in records.items() if pid != me and spans(r, round_)]
    return _strict_majority([fp for fp in fps if fp is not None])


def certified_fingerprint(records: Records, round_: int, shard: str) -> str | None:
    """The fingerprint of `shard` that more than half of the peers holding a certified θ(`round_`) advertise
    (`PeerRecord.certified` at `round_`): of two starts of a round, the one a certified round t−1 led to, not the one
    a member that voided t−1 kept. Certified rounds have one set each, so honest holders of one all agree."""
    held = [r for r in records.values() if r.round == r.certified == round_]
    return _strict_majority([r.fingerprints[shard] for r in held if shard in r.fingerprints])


def _strict_majority(fps: list[str]) -> str | None:
    if not fps:
        return None
    best = max(set(fps), key=fps.count)
    return best if 2 * fps.count(best) > len(fps) else None
