"""Role and slot planner: which nodes are full replicas, and which pipeline stage each weaker node holds.

Every node reads the live records from the DHT, runs `plan` on them and acts on its own entry. `plan` is a pure,
deterministic function of the records (no clock, no randomness, input order irrelevant), so nodes that see the same
records reach the same assignment. Records propagate with delay, so two nodes can still claim one slot; the next plan
settles it: the earliest claim (then the lowest peer id) keeps the slot and the others are placed again. Roles, once
taken, are sticky and a node holding a slot is never moved, so a plan only ever adds: it places nodes that are
joining or lost a contest.

Placement, in short (details on `plan`): complete the virtual replicas (VRs) that are closest to complete, pair nodes
with similar links in one VR (a pipeline runs at its slowest link), keep the stages balanced, and open a new VR only
when no incomplete one has a free stage the node can hold.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from hetero_node.protocol.flat_exchange import aggregated
from hetero_node.protocol.roles import (
    REQUEST_AUTO,
    REQUEST_FULL,
    REQUEST_STAGE,
    ROLE_FULL,
    ROLE_JOINING,
    ROLE_STAGE,
    ROLE_STANDBY,
)

# Link rates at or below this (Mbps) are treated as this, so log ratios stay finite for peers that report 0.
_MIN_LINK_MBPS = 1e-3


@dataclass(frozen=True)
class Requirements:
    """What the run asks of a node, computed by the caller from the run config."""

    stages: int
    full_memory_bytes: int  # model + optimizer + error feedback + activations, with headroom
    stage_memory_bytes: tuple[int, ...]  # same per stage (len == stages)
    replica_round_bytes: int  # SparseLoCo message bytes ONE replica produces per round (all shards)
    tokens_per_round: int  # H × batch × seq_len
    comm_fraction: float = 0.1  # a full replica's round traffic must fit in this fraction of its round compute time
    max_contributors: int = 0  # K: messages a round aggregates at most (0: all), what one member moves at most

    def __post_init__(self) -> None:
        # A list is accepted and stored as a tuple, so the object stays hashable and immutable.
        object.__setattr__(self, "stage_memory_bytes", tuple(self.stage_memory_bytes))
        if self.stages < 1:
            raise ValueError(f"stages must be ≥ 1, got {self.stages}")
        if len(self.stage_memory_bytes) != self.stages:
            raise ValueError(f"stage_memory_bytes has {len(self.stage_memory_bytes)} entries for {self.stages} stages")
        if min(self.full_memory_bytes, self.replica_round_bytes, *self.stage_memory_bytes) < 0:
            raise ValueError("byte counts must be ≥ 0")
        if self.tokens_per_round <= 0:
            raise ValueError(f"tokens_per_round must be > 0, got {self.tokens_per_round}")
        if not 0 < self.comm_fraction <= 1:
            raise ValueError(f"comm_fraction must be in (0, 1], got {self.comm_fraction}")


@dataclass(frozen=True)
class PeerInfo:
    """The planner's view of one record."""

    peer_id: str
    memory_bytes: int
    upload_mbps: float
    download_mbps: float
    tokens_per_s: float  # full-model training throughput measured on this node (0 = unknown)
    role: str = ROLE_JOINING
    vr: int = -1
    stage: int = -1
    requested_role: str = REQUEST_AUTO  # "auto" | "full" | "stage" (the node's --role)
    pinned_stage: int = -1  # --stage N: only this stage
    claimed_at: float = 0.0  # DHT time of this stage peer's claim on its slot: the earliest claim keeps a slot
    relayed: bool = False  # reachable only through a circuit relay (its link figures are then its share of the relay's)
    rtt_ms: float = 0.0  # round trip to its first initial peer (0: not measured; `cost_model.Latency`)

    @property
    def claim_order(self) -> tuple[float, str]:
        """Who keeps a contested slot: the earliest claim, then (same time) the lowest peer id."""
        return self.claimed_at, self.peer_id

    @property
    def link_mbps(self) -> float:
        """The slower direction: what bounds this node's share of a pipeline's traffic."""
        return max(min(self.upload_mbps, self.download_mbps), _MIN_LINK_MBPS)


@dataclass(frozen=True)
class RoleDecision:
    role: str | None  # ROLE_FULL, ROLE_STAGE, ROLE_STANDBY, or None if the node can hold nothing
    reason: str  # one human line, e.g. "full: 1.2 GB needed of 8.0 GB; round traffic 0.4 s ≤ 10% of 12 s compute"


# ------------------------------------------------------------------------------------------------ role decision


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _secs(x: float) -> str:
    return "∞ s" if math.isinf(x) else f"{x:.3g} s"


def _stage_list(stages: Iterable[int]) -> str:
    return ", ".join(str(s) for s in stages)


def fitting_stages(peer: PeerInfo, req: Requirements) -> tuple[int, ...]:
    """Stages this peer may hold: those whose memory need it meets, narrowed to its pin if it has one."""
    if peer.pinned_stage >= 0:
        candidates: Iterable[int] = (peer.pinned_stage,) if peer.pinned_stage < req.stages else ()
    else:
        candidates = range(req.stages)
    return tuple(s for s in candidates if req.stage_memory_bytes[s] <= peer.memory_bytes)


def round_traffic_seconds(peer: PeerInfo, req: Requirements, replicas: int) -> float:
    """Seconds a full replica on this peer spends on one round's exchange with `replicas` others.

    It downloads each aggregated message (at most K of theirs) and relays as much (up = down = message × min(replicas,
    K)), both at once, so the slower direction decides. A zero rate with traffic to move is infinitely slow.
    """
    messages = aggregated(replicas, req.max_contributors)
    nbytes = req.replica_round_bytes * messages
    if nbytes <= 0:
        return 0.0
    slowest = min(peer.upload_mbps, peer.download_mbps)
    return math.inf if slowest <= 0 else nbytes * 8 / (slowest * 1e6)


def _traffic_check(peer: PeerInfo, req: Requirements, replicas: int) -> tuple[bool, str]:
    """Whether the round's traffic fits in comm_fraction of the round's compute, and the line that says so.

    Unknown throughput (tokens_per_s = 0): the compute time, hence the budget, is unknown, so the traffic is not
    judged to fit, unless there is none to move (no other replicas yet: the first node that can hold the model
    becomes full whatever its link). Being wrong the other way would be worse: a full replica on a link too slow
    for its rounds holds up every replica's outer step, while a strong node that runs a stage still trains.
    """
    traffic = round_traffic_seconds(peer, req, replicas)
    if traffic == 0:
        return True, "no round traffic (no other replicas)"
    pct = f"{req.comm_fraction:.0%}"
    if peer.tokens_per_s <= 0:
        return False, f"round traffic {_secs(traffic)} against unknown compute time (throughput not measured)"
    compute = req.tokens_per_round / peer.tokens_per_s
    fits = traffic <= req.comm_fraction * compute
    return fits, f"round traffic {_secs(traffic)} {'≤' if fits else '>'} {pct} of {_secs(compute)} compute"


Verdict = Callable[[PeerInfo], "tuple[bool, str] | None"]
"""Whether a joiner is worth a role, with the line that says why; None: no verdict (see `decide_role`)."""


def _worth_full(peer: PeerInfo, req: Requirements, replicas: int, full_check: Verdict | None) -> tuple[bool, str]:
    verdict = full_check(peer) if full_check is not None else None
    return verdict if verdict is not None else _traffic_check(peer, req, replicas)


def decide_role(
    peer: PeerInfo,
    req: Requirements,
    replicas: int,
    full_check: Verdict | None = None,
    stage_check: Verdict | None = None,
) -> RoleDecision:
    """Full, stage or standby for one node; `replicas` is the number of OTHER replicas (full + virtual) in the swarm.

    auto: full when the model fits in memory and the node is worth a full replica: by `full_check` (the live
    planner's cost model) when it gives a verdict, else when the round's traffic fits (see `_traffic_check`, which
    also says what unknown throughput means); otherwise stage if some stage fits and `stage_check` does not say a
    pipeline of such nodes would slow the swarm (then standby: it waits and is judged again at every plan);
    otherwise None. A pin (--stage N) means the node asked to run that stage, so an auto node with a pin is judged
    as a stage node.
    --role full / --role stage are honoured whenever memory allows (full: the whole model; stage: some stage, or
    the pinned one); the link is not second-guessed, the operator chose. --role full with a pin is contradictory
    and gets None.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be ≥ 0, got {replicas}")
    want, mem = peer.requested_role, peer.memory_bytes
    if want not in (REQUEST_AUTO, REQUEST_FULL, REQUEST_STAGE):
        return RoleDecision(None, f"none: unknown requested role {want!r}")
    full_need = f"{_gb(req.full_memory_bytes)} needed of {_gb(mem)}"

    if want == REQUEST_FULL:
        if peer.pinned_stage >= 0:
            return RoleDecision(None, f"none: --role full conflicts with --stage {peer.pinned_stage}")
        if mem < req.full_memory_bytes:
            return RoleDecision(None, f"none: --role full but {full_need}")
        _, traffic = _worth_full(peer, req, replicas, full_check)
        return RoleDecision(ROLE_FULL, f"full (requested): {full_need}; {traffic}")

    why_not_full = ""
    if want == REQUEST_AUTO and peer.pinned_stage < 0:
        if mem >= req.full_memory_bytes:
            fits, traffic = _worth_full(peer, req, replicas, full_check)
            if fits:
                return RoleDecision(ROLE_FULL, f"full: {full_need}; {traffic}")
            why_not_full = f"full would fit in memory ({full_need}) but {traffic}"
        else:
            why_not_full = f"full needs {_gb(req.full_memory_bytes)}, node has {_gb(mem)}"

    stages = fitting_stages(peer, req)
    if stages:
        label = "stage (requested)" if want == REQUEST_STAGE else "stage"
        largest = max(req.stage_memory_bytes[s] for s in stages)
        detail = f"stage {stages[0]} pinned" if peer.pinned_stage >= 0 else f"stages {_stage_list(stages)} fit"
        line = f"{label}: {detail} ({_gb(largest)} needed of {_gb(mem)})"
        verdict = stage_check(peer) if stage_check is not None and want == REQUEST_AUTO else None
        if verdict is not None and not verdict[0]:
            return RoleDecision(ROLE_STANDBY, f"standby: {detail}, but {verdict[1]}")
        reasons = [line, *([why_not_full] if why_not_full else []), *([verdict[1]] if verdict else [])]
        return RoleDecision(ROLE_STAGE, "; ".join(reasons))
    return RoleDecision(None, f"none: {_no_stage_reason(peer, req)}")


def _no_stage_reason(peer: PeerInfo, req: Requirements) -> str:
    mem = _gb(peer.memory_bytes)
    if peer.pinned_stage >= req.stages:
        return f"pinned stage {peer.pinned_stage} does not exist (stages 0..{req.stages - 1})"
    if peer.pinned_stage >= 0:
        need = _gb(req.stage_memory_bytes[peer.pinned_stage])
        return f"pinned stage {peer.pinned_stage} needs {need}, node has {mem}"
    return f"smallest stage needs {_gb(min(req.stage_memory_bytes))}, node has {mem}"


# ------------------------------------------------------------------------------------------------ the plan


Replicas = tuple[tuple[str, ...], ...]
"""Virtual replicas as their holders' peer ids in stage order."""


@dataclass(frozen=True)
class Plan:
    """The assignment every node derives from the same records."""

    roles: dict[str, str | None]  # every input peer id → its role (None: cannot take part; standby: waits)
    slots: dict[str, tuple[int, int]]  # stage peers → (vr, stage)
    reasons: dict[str, str]  # peer id → why (role decision / placement)

    def virtual_replicas(self, stages: int) -> dict[int, dict[int, str]]:
        """vr → {stage: holder}, VRs with at least one holder only, sorted by vr then stage."""
        out: dict[int, dict[int, str]] = {}
        for peer_id, (vr, stage) in sorted(self.slots.items(), key=lambda item: item[1]):
            if not 0 <= stage < stages:
                raise ValueError(f"{peer_id} holds stage {stage}, outside 0..{stages - 1}")
            out.setdefault(vr, {})[stage] = peer_id
        return out

    def complete_virtual_replicas(self, stages: int) -> Replicas:
        """The VRs every stage of which is held, as holders in stage order (by vr id)."""
        return _complete_vrs(self.slots, stages)

    def missing(self, stages: int) -> dict[int, list[int]]:
        """vr → stages nobody holds, for incomplete VRs only (at least one holder, at least one gap)."""
        out = {}
        for vr, held in self.virtual_replicas(stages).items():
            gaps = [s for s in range(stages) if s not in held]
            if gaps:
                out[vr] = gaps
        return out

    def digest(self) -> str:
        """Short stable hash of (roles, slots): nodes compare it to see that they agree; reasons are not covered."""
        canonical = json.dumps(
            {"roles": sorted(self.roles.items()), "slots": sorted((p, vr, s) for p, (vr, s) in self.slots.items())},
            separators=(",", ":"),
        )
        return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()

    def describe(self) -> str:
        """One line per peer, sorted by id, for logs and the CLI (each reason starts with the role, names the slot)."""
        return "\n".join(f"{peer_id} → {self.reasons[peer_id]}" for peer_id in sorted(self.roles))


def _complete_vrs(slots: Mapping[str, tuple[int, int]], stages: int) -> Replicas:
    held: dict[int, dict[int, str]] = {}
    for peer_id, (vr, stage) in slots.items():
        held.setdefault(vr, {})[stage] = peer_id
    return tuple(tuple(h[s] for s in range(stages)) for _, h in sorted(held.items()) if len(h) == stages)


def _valid_slot(peer: PeerInfo, req: Requirements) -> bool:
    pin_ok = peer.pinned_stage < 0 or peer.stage == peer.pinned_stage
    return peer.vr >= 0 and 0 <= peer.stage < req.stages and pin_ok


def _placement_order(peer: PeerInfo, req: Requirements) -> tuple[int, bool, float, str]:
    """Most constrained first (fewest fitting stages: pins and small memories take what they can before flexible
    peers fill it), then directly reachable peers before relayed ones (direct peers fill VRs together, so their
    pipeline neighbours are direct too and relay hops stay inside the VRs of relayed peers), then fastest link first
    (fast peers fill VRs together, slow ones end up together), then id."""
    return (len(fitting_stages(peer, req)), peer.relayed, -peer.link_mbps, peer.peer_id)


class SwarmModel(Protocol):
    """The live planner's judge of a joiner against the swarm as settled so far (every peer, the full replicas, the
    complete virtual replicas): is it worth a full replica, and would a pipeline of nodes like it help? Each answers
    a `Verdict`. `auto_plan.MarginalGain` answers with the cost model."""

    def full_gain(
        self, peers: Mapping[str, PeerInfo], full: tuple[str, ...], virtual: Replicas, joiner: PeerInfo
    ) -> tuple[bool, str] | None: ...

    def pipeline_gain(
        self, peers: Mapping[str, PeerInfo], full: tuple[str, ...], virtual: Replicas, joiner: PeerInfo
    ) -> tuple[bool, str] | None: ...


def plan(peers: Iterable[PeerInfo], req: Requirements, model: SwarmModel | None = None) -> Plan:
    """Roles for joining peers and slots for stage peers that need one; everything already settled stays.

    1. A stage peer with a valid slot keeps it; a slot claimed by several goes to the earliest claim (`claimed_at`,
       then the lowest peer id), the others stay stage peers and are placed again. A stage peer whose slot is
       invalid for this run (vr < 0, stage out of range, or not its pin) is placed again too.
    2. Full replicas stay full.
    3. Joining peers (any role other than full or stage: standby peers are judged again) get a role from
       `decide_role`, fastest measured throughput first, then in peer-id order (so a batch of joiners settles its
       full replicas before judging who would only slow them down). `replicas`
       starts as full replicas + VRs with at least one holder after step 1, and grows by one each time a joiner
       becomes full. Stage joiners do not count: how many VRs they form is known only after placement, so a batch
       of joiners may be judged against fewer replicas than it ends up with; later joiners see those VRs. With
       `model`, a joiner is judged against the full replicas so far and the complete VRs (and may count on the
       joiners judged after it: `auto_plan.MarginalGain.full_gain`).
    4. Stage peers needing a slot are placed greedily, one at a time, ordered by `_placement_order` (direct before
       relayed peers; not plain peer-id order: with id order, 2 fast + 2 slow joiners with ids fast, slow, fast,
       slow would pair fast with slow, because finishing the open VR comes first). Each goes to the best free
       slot it fits (memory and pin):
         a. an incomplete VR, the one with most holders first;
         b. among equally complete ones, the one whose slowest holder link is closest to the peer's (log ratio);
         c. then lowest vr; within the VR, the missing stage fewest peers hold swarm-wide, then lowest stage;
         d. no incomplete VR has a fitting free slot: open the lowest unused vr id, stage by the rule in c.
       A peer that fits no stage gets role None.
    Raises ValueError on two records with one peer id (the DHT keys records by peer id, so that is a caller bug).
    """
    by_id: dict[str, PeerInfo] = {}
    for peer in peers:
        if peer.peer_id in by_id:
            raise ValueError(f"two records for peer {peer.peer_id!r}")
        by_id[peer.peer_id] = peer
    ordered = [by_id[peer_id] for peer_id in sorted(by_id)]

    roles: dict[str, str | None] = {}
    slots: dict[str, tuple[int, int]] = {}
    reasons: dict[str, str] = {}
    to_place: list[PeerInfo] = []

    # 1 + 2: settled peers; each claim list is sorted by claim order below, and its first id wins.
    claims: dict[tuple[int, int], list[str]] = {}
    for peer in ordered:
        if peer.role == ROLE_FULL:
            roles[peer.peer_id], reasons[peer.peer_id] = ROLE_FULL, "full: already a full replica"
        elif peer.role == ROLE_STAGE:
            roles[peer.peer_id] = ROLE_STAGE
            if _valid_slot(peer, req):
                claims.setdefault((peer.vr, peer.stage), []).append(peer.peer_id)
            else:
                reasons[peer.peer_id] = f"stage: published slot (vr {peer.vr}, stage {peer.stage}) is not valid here"
                to_place.append(peer)
    for (vr, stage), claimants in claims.items():
        winner, *losers = sorted(claimants, key=lambda pid: by_id[pid].claim_order)
        slots[winner] = (vr, stage)
        reasons[winner] = f"stage: holds (vr {vr}, stage {stage})"
        if losers:
            reasons[winner] += f"; kept it over {', '.join(losers)} (the earliest claim wins)"
        for loser in losers:
            reasons[loser] = f"stage: lost (vr {vr}, stage {stage}) to {winner} (the earliest claim wins)"
            to_place.append(by_id[loser])

    # 3: joiners.
    full = [pid for pid, role in roles.items() if role == ROLE_FULL]
    replicas = len(full) + len({vr for vr, _ in slots.values()})
    complete = _complete_vrs(slots, req.stages)
    for peer in sorted(ordered, key=lambda p: (-p.tokens_per_s, p.peer_id)):
        if peer.role in (ROLE_FULL, ROLE_STAGE):
            continue
        checks: tuple[Verdict | None, Verdict | None] = (None, None)
        if model is not None:
            settled = (by_id, tuple(full), complete)
            checks = functools.partial(model.full_gain, *settled), functools.partial(model.pipeline_gain, *settled)
        decision = decide_role(peer, req, replicas, *checks)
        roles[peer.peer_id], reasons[peer.peer_id] = decision.role, decision.reason
        if decision.role == ROLE_FULL:
            replicas += 1
            full.append(peer.peer_id)
        elif decision.role == ROLE_STAGE:
            to_place.append(peer)

    # 4: placement.
    held: dict[int, dict[int, str]] = {}
    stage_count = [0] * req.stages
    for peer_id, (vr, stage) in slots.items():
        held.setdefault(vr, {})[stage] = peer_id
        stage_count[stage] += 1

    def by_balance(stage: int) -> tuple[int, int]:
        return (stage_count[stage], stage)

    for peer in sorted(to_place, key=lambda p: _placement_order(p, req)):
        fits = fitting_stages(peer, req)
        if not fits:
            roles[peer.peer_id] = None
            reasons[peer.peer_id] += f"; cannot be placed: {_no_stage_reason(peer, req)}"
            continue
        best: tuple[tuple[int, float, int], int, list[int]] | None = None
        for vr, holders in held.items():
            free = [s for s in fits if s not in holders]
            if not free:  # a complete VR has no free stage
                continue
            vr_link = min(by_id[h].link_mbps for h in holders.values())
            key = (-len(holders), abs(math.log(peer.link_mbps / vr_link)), vr)
            if best is None or key < best[0]:
                best = (key, vr, free)
        if best is not None:
            _, vr, free = best
            stage = min(free, key=by_balance)
            n = len(held[vr])
            where = f"completes VR {vr}" if n + 1 == req.stages else f"joins incomplete VR {vr} ({n}/{req.stages} held)"
        else:
            vr = next(i for i in range(len(held) + 1) if i not in held)
            stage = min(fits, key=by_balance)
            where = f"opens VR {vr} (no incomplete VR has a free stage it fits)"
        held.setdefault(vr, {})[stage] = peer.peer_id
        stage_count[stage] += 1
        slots[peer.peer_id] = (vr, stage)
        reasons[peer.peer_id] += f"; placed at (vr {vr}, stage {stage}): {where}"

    # Sorted by peer id, so that even the dicts' iteration order is the same on every node.
    return Plan(
        roles={k: roles[k] for k in sorted(roles)},
        slots={k: slots[k] for k in sorted(slots)},
        reasons={k: reasons[k] for k in sorted(reasons)},
    )
