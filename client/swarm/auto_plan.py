"""The optimising planner: full replicas, virtual-replica groupings, subspace rank and H, chosen by the cost model.

UniAP-style: an optimisation over a time and memory model (`cost_model`), not a rule list. The search space is
structured so that it stays small for a thousand peers:
* full replicas are the f fastest nodes that hold the whole model;
* the other nodes that hold a stage are taken in link order (a pipeline runs at its slowest link, so similar
  links go together) into groups of S, each node on the most demanding free stage it fits; within a group the
  fastest node takes the stage with the most compute when memory allows. The v groups with the fastest
  predicted steps become virtual replicas (a slow one may cost the swarm more exchange time than its tokens are
  worth, and is left idle);
* the boundary rank is one of d/8, d/16, d/32 or the run's own, and H one of `h_choices`.
f and v are searched on a grid (every count up to 8, then steps of a quarter), first at the run's H and every
rank (a pipeline on slow links is worth more at a lower rank), then rank and H at the best (f, v), then (f, v)
again. The score is the predicted tokens/s. The quality cost is
bounded, not traded: ranks below d/32 are not offered (the algorithm lab's finding 3: compress-all diverges at
d/64), and among plans within `TOLERANCE` of the best tokens/s the one with the smallest H (more frequent outer
steps), then the largest rank (less compression), wins. The live planner's plan (`live_assignment`) is a candidate
whenever the run's H is one of `h_choices`, so the result is then never worse than the live planner by the model;
every candidate fits in memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hetero_node.client.swarm.cost_model import (
    Assignment,
    Latency,
    LinkModel,
    RoundPrediction,
    RunShape,
    predict_round,
    run_variant,
    virtual_step_s,
)
from hetero_node.client.swarm.planner import PeerInfo, Replicas, Requirements, plan
from hetero_node.protocol.roles import REQUEST_STAGE, ROLE_FULL, ROLE_JOINING, ROLE_STAGE
from hetero_node.protocol.run_config import RunConfig

RANK_DIVISORS = (8, 16, 32)
"""Boundary ranks the planner may choose, as d_model / N (d/64 failed in the lab)."""
H_CHOICES = (10, 20, 30, 50, 100)
TOLERANCE = 0.02
"""Plans within 2% of the best predicted tokens/s count as equally fast; quality then decides."""


@dataclass(frozen=True)
class Choice:
    """A candidate plan and what the model predicts for it."""

    assignment: Assignment
    inner_steps: int
    rank: int | None
    prediction: RoundPrediction

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s


@dataclass(frozen=True)
class AutoPlan:
    best: Choice
    live: Choice  # what the live planner (`plan` with `MarginalGain`) makes of the nodes, at the run's rank and H
    idle: tuple[str, ...]  # nodes the best plan leaves out
    links: LinkModel = field(default_factory=LinkModel)  # what the plan was made with
    live_tuned: Choice | None = None
    """The live planner at the best plan's H and rank (an operator who sets them before volunteers join), among the
    best plan's candidates: the best is at most `TOLERANCE` slower (it may prefer a smaller H, a larger rank, fewer
    replicas). None: the best plan is at the run's H and rank, so this is `live`."""

    def boundary_round_trips_ms(self, peers: Mapping[str, PeerInfo]) -> list[float]:
        """Each of the best plan's virtual replicas' round trips across its boundaries, as the model priced them."""
        latency = Latency.of(peers.values(), self.links, [peers[p] for p in self.best.assignment.nodes])
        return [1e3 * latency.boundaries_s([peers[p] for p in vr]) for vr in self.best.assignment.virtual]

    def weak_scaling(self, peers: Mapping[str, PeerInfo]) -> float:
        """Swarm tokens/s over the sum of every node's solo full-model tokens/s."""
        solo = sum(p.tokens_per_s for p in peers.values())
        return self.best.tokens_per_s / solo if solo else 0.0


def requirements(shape: RunShape) -> Requirements:
    """The rule planner's inputs, from the same shape the model uses."""
    return Requirements(
        stages=shape.stages,
        full_memory_bytes=shape.full_memory_bytes,
        stage_memory_bytes=shape.stage_memory_bytes,
        replica_round_bytes=shape.message_bytes,
        tokens_per_round=shape.inner_steps * shape.tokens_per_step,
        max_contributors=shape.max_contributors,
    )


@dataclass
class VerdictMemo:
    """Verdicts for one set of records (`peers`, by identity): a plan judges a batch against the same records."""

    peers: object = None
    verdicts: dict[object, tuple[bool, str] | None] = field(default_factory=dict)

    def verdict(
        self, peers: object, key: object, judge: Callable[[], tuple[bool, str] | None]
    ) -> tuple[bool, str] | None:
        if peers is not self.peers:
            self.peers, self.verdicts = peers, {}
        if key not in self.verdicts:
            self.verdicts[key] = judge()
        return self.verdicts[key]


@dataclass(frozen=True)
class MarginalGain:
    """The live planner's judge of a joiner (`planner.SwarmModel`), by the cost model: a joiner that holds the whole
    model becomes a full replica, and one that holds a stage a pipeline stage, iff the swarm's predicted tokens/s
    grow with one more such replica beside the full replicas and complete virtual replicas already settled (a full
    replica judged with the joiners after it that could be full replicas too, `full_gain`; a pipeline as S nodes
    like the joiner: the planner groups similar links). The model prices what the rule of thumb (`_traffic_check`:
    round traffic within 10% of its compute) cannot: a slow link's exchange lengthens every member's round, and a
    node far slower than the others trains few of the window's steps. Sticky and deterministic like the rest of the
    plan: it judges joiners only, from the records alone. Unknown throughput: no verdict (the rule decides; a stage
    joiner is then placed)."""

    shape: RunShape
    links: LinkModel = field(default_factory=LinkModel)
    _memo: VerdictMemo = field(default_factory=VerdictMemo, compare=False, repr=False)

    def full_gain(
        self, peers: Mapping[str, PeerInfo], full: tuple[str, ...], virtual: Replicas, joiner: PeerInfo
    ) -> tuple[bool, str] | None:
        """With the joiners still to be judged after it that could be full replicas too (`full_cohort`): one A100
        beside 50 H100s lengthens every round with its slower exchange for a few tokens, while 50 of them stretch
        the round and pay; judged alone, each would be refused."""
        cohort = full_cohort(peers, self.shape.full_memory_bytes)
        at = cohort.index(joiner.peer_id) + 1 if joiner.peer_id in cohort else len(cohort)
        ends = [at, *(e for e in reversed(count_grid(len(cohort))) if e > at)]  # alone, then the whole cohort first
        options = [Assignment((*full, joiner.peer_id, *cohort[at:end]), virtual) for end in ends]
        return self._gain(peers, Assignment(full, virtual), options, joiner)

    def pipeline_gain(
        self, peers: Mapping[str, PeerInfo], full: tuple[str, ...], virtual: Replicas, joiner: PeerInfo
    ) -> tuple[bool, str] | None:
        """As many pipelines of nodes like it as the unsettled stage joiners on links like its (itself included,
        `stage_cohort`) form, one at least: every one of them gets the same verdict, so they are taken, or left on
        standby, together. One pipeline of home nodes beside 100 datacenter replicas can cost the swarm (its holder
        per shard adds a slow author the others wait for) while 75 pay: judged alone, as before, each waited on
        standby. A batch of joiners holds a few kinds of node: one verdict per kind (`_memo`)."""
        cohort = stage_cohort(peers, self.shape, joiner)
        kind = dataclasses.replace(joiner, peer_id="", claimed_at=0.0)
        return self._memo.verdict(peers, (full, virtual, cohort, kind),
                                  lambda: self._pipelines_gain(peers, full, virtual, joiner, cohort))  # fmt: skip

    def _pipelines_gain(
        self, peers: Mapping[str, PeerInfo], full: tuple[str, ...], virtual: Replicas, joiner: PeerInfo, cohort: int
    ) -> tuple[bool, str] | None:
        stages = self.shape.stages
        like = {f"{joiner.peer_id}#{k}": dataclasses.replace(joiner, peer_id=f"{joiner.peer_id}#{k}")
                for k in range(max(1, cohort // stages) * stages)}  # fmt: skip
        ids = list(like)
        pipelines = [tuple(ids[k : k + stages]) for k in range(0, len(ids), stages)]
        nodes = ChainMap(like, peers)  # type: ignore[arg-type]  # read only
        more = Assignment(full, (*virtual, *pipelines))
        return self._gain(nodes, Assignment(full, virtual), [more], joiner, "a pipeline of nodes like it", "like it")

    def _gain(
        self, peers: Mapping[str, PeerInfo], now: Assignment, options: Sequence[Assignment], joiner: PeerInfo,
        what: str = "it", others_are: str = "joining after it",
    ) -> tuple[bool, str] | None:  # fmt: skip
        """Whether one of `options` (each `now` with the joiner, and perhaps others like it) predicts more tokens/s
        than `now`: the first that does, else the best."""
        if joiner.tokens_per_s <= 0:
            return None
        before = predict_round(peers, now, self.shape, self.links).tokens_per_s
        after, best = None, now
        for option in options:
            prediction = predict_round(peers, option, self.shape, self.links)
            if after is None or prediction.tokens_per_s > after.tokens_per_s:
                after, best = prediction, option
            if after.tokens_per_s > before:
                break
        assert after is not None, "no option to judge"
        others = best.replicas - now.replicas - 1
        company = f" and {others} more {others_are}" if others else ""
        replicas = f"{others + 1} more replicas" if others else "one more replica"
        return after.tokens_per_s > before, (
            f"with {what}{company} as {replicas} the swarm's predicted tokens/s go {before:,.0f} → "
            f"{after.tokens_per_s:,.0f} (round {after.round_s:.3g} s)"
        )


def full_cohort(peers: Mapping[str, PeerInfo], full_memory_bytes: int) -> list[str]:
    """The unsettled peers that could be full replicas (they hold the model, know their speed and did not ask for a
    stage), in the order `plan` judges them: fastest first, then by id. A joiner counts on a prefix of the ones after
    it that ends where the grid of this whole list ends (`count_grid`), so each of them, judged next, can count on
    the rest of that prefix: a joiner taken for a group is never left alone by a grid that skips its group's end."""
    cohort = [
        p for p in peers.values()
        if p.role not in (ROLE_FULL, ROLE_STAGE) and p.tokens_per_s > 0 and p.memory_bytes >= full_memory_bytes
        and p.requested_role != REQUEST_STAGE and p.pinned_stage < 0
    ]  # fmt: skip
    return [p.peer_id for p in sorted(cohort, key=lambda p: (-p.tokens_per_s, p.peer_id))]


LIKE_LINK = 2.0
"""Stage joiners count on each other's pipelines when their uploads are within this factor (exclusive): the
planner groups pipelines by link, so a 40 Mbit/s node's pipeline is not made of 20 Mbit/s ones."""


def stage_cohort(peers: Mapping[str, PeerInfo], shape: RunShape, joiner: PeerInfo) -> int:
    """How many unsettled peers of known speed on links like the joiner's could hold a stage but not the whole
    model: the pipelines a stage joiner may count on forming beside it (a batch of joiners is judged before any of
    them is placed), the joiner included."""
    smallest, up = min(shape.stage_memory_bytes), max(joiner.upload_mbps, 1e-9)
    return sum(
        1 for p in peers.values()
        if p.role not in (ROLE_FULL, ROLE_STAGE) and p.tokens_per_s > 0
        and smallest <= p.memory_bytes < shape.full_memory_bytes and 1 / LIKE_LINK < p.upload_mbps / up < LIKE_LINK
    )  # fmt: skip


LIVE_REFRESHES = 4
"""Plans `live_assignment` runs at most: the joiners' first, then one per refresh while it still settles nodes."""


def live_assignment(peers: Iterable[PeerInfo], shape: RunShape, links: LinkModel = LinkModel()) -> Assignment:
    """What the live planner makes of these nodes all joining at once, and then of those it left waiting, planned
    again beside the ones it settled as every refresh plans them (`client/swarm/membership.py`): RTX 3090 pipelines
    that cost the swarm beside 100 datacenter replicas pay once 75 RTX 4090 pipelines have joined it. Incomplete
    virtual replicas train nothing."""
    nodes = [PeerInfo(**{**p.__dict__, "role": ROLE_JOINING, "vr": -1, "stage": -1}) for p in peers]
    for _ in range(LIVE_REFRESHES):
        result = plan(nodes, requirements(shape), MarginalGain(shape, links))
        settled = [_settled(p, result.roles[p.peer_id], result.slots.get(p.peer_id)) for p in nodes]
        if settled == nodes:
            break
        nodes = settled
    full = tuple(p for p, role in result.roles.items() if role == ROLE_FULL)
    return Assignment(full, result.complete_virtual_replicas(shape.stages))


def _settled(peer: PeerInfo, role: str | None, slot: tuple[int, int] | None) -> PeerInfo:
    """`peer` as its record reads once it holds the role it was planned (a joiner still, if it waits)."""
    if role == ROLE_FULL:
        return dataclasses.replace(peer, role=ROLE_FULL)
    if role == ROLE_STAGE and slot is not None:
        return dataclasses.replace(peer, role=ROLE_STAGE, vr=slot[0], stage=slot[1])
    return peer


def count_grid(n: int) -> list[int]:
    """0..8, then about a quarter more each step, and n."""
    counts, c = set(range(min(n, 8) + 1)), 8.0
    while c < n:
        c *= 1.25
        counts.add(min(n, math.ceil(c)))
    return sorted(counts | {n})


def _stage_order(group: Sequence[PeerInfo], shape: RunShape) -> tuple[str, ...]:
    """Holders of stages 0..S-1 for a group that fits in the order given: the fastest node on the heaviest stage
    when memory allows that, else the order given."""
    by_speed = sorted(group, key=lambda p: (-p.tokens_per_s, p.peer_id))
    heaviest = sorted(range(shape.stages), key=lambda s: -shape.stage_compute_share[s])
    order = dict(zip(heaviest, by_speed, strict=True))
    if all(shape.stage_memory_bytes[s] <= p.memory_bytes for s, p in order.items()):
        return tuple(order[s].peer_id for s in range(shape.stages))
    return tuple(p.peer_id for p in group)


def _fullable(peers: Mapping[str, PeerInfo], shape: RunShape) -> list[str]:
    """Nodes that may be full replicas, fastest first."""
    fit = [p for p in peers.values() if p.memory_bytes >= shape.full_memory_bytes and p.tokens_per_s > 0]
    return [p.peer_id for p in sorted(fit, key=lambda p: (-p.tokens_per_s, p.peer_id))]


def _groups(pool: list[PeerInfo], shape: RunShape, latency: Latency) -> list[tuple[str, ...]]:
    """Complete stage groups, fastest predicted step first. Nodes are taken in link order (similar links together)
    and each joins the oldest open group with a free stage it fits, the most demanding such stage first (so nodes
    with memory to spare take the stages that need it); incomplete groups at the end are dropped."""
    usable = sorted((p for p in pool if p.tokens_per_s > 0), key=lambda p: (-p.link_mbps, p.peer_id))
    need = shape.stage_memory_bytes
    open_groups: list[list[PeerInfo]] = []
    groups = []
    for peer in usable:
        fits = sorted((s for s in range(shape.stages) if need[s] <= peer.memory_bytes), key=lambda s: -need[s])
        free = next(((g, s) for g in open_groups for s in fits if g[s] is None), None)
        if free is None:
            if not fits:
                continue
            free = ([None] * shape.stages, fits[0])
            open_groups.append(free[0])
        group, stage = free
        group[stage] = peer
        if all(group):
            open_groups.remove(group)
            groups.append(_stage_order([p for p in group if p], shape))
    by_id = {p.peer_id: p for p in pool}
    return sorted(groups, key=lambda g: virtual_step_s([by_id[p] for p in g], shape, latency))


def _assignments(peers: Mapping[str, PeerInfo], shape: RunShape, links: LinkModel) -> Iterable[Assignment]:
    fullable = _fullable(peers, shape)
    latency = Latency.of(peers.values(), links)  # the model's own estimate, whichever nodes a group has
    for f in count_grid(len(fullable)):
        full = fullable[:f]
        taken = set(full)
        groups = _groups([p for p in peers.values() if p.peer_id not in taken], shape, latency)
        for v in count_grid(len(groups)):
            if f or v:
                yield Assignment(tuple(full), tuple(groups[:v]))


def _rank(divisor: int, d_model: int) -> int:
    return max(1, d_model // divisor)


def _choose(options: list[Choice]) -> Choice:
    """Fastest, then, within TOLERANCE of it, the smallest H, the largest rank, the fewest replicas."""
    top = max(c.tokens_per_s for c in options)
    near = [c for c in options if c.tokens_per_s >= (1 - TOLERANCE) * top]
    return min(near, key=lambda c: (c.inner_steps, -(c.rank or 0), c.assignment.replicas, -c.tokens_per_s))


def auto_plan(
    peers: Iterable[PeerInfo], run: RunConfig, links: LinkModel = LinkModel(), h_choices: Sequence[int] = H_CHOICES
) -> AutoPlan:
    """The best plan for these nodes by the cost model (see the module docstring), with H from `h_choices` and
    the rank from d/8, d/16, d/32 or the run's own. ValueError if nothing fits."""
    by_id = {p.peer_id: p for p in peers}
    base = RunShape.from_run(run)
    today = live_assignment(by_id.values(), base, links)
    live = Choice(today, base.inner_steps, base.rank, predict_round(by_id, today, base, links))

    def evaluate(assignment: Assignment, shape: RunShape) -> Choice | None:
        prediction = predict_round(by_id, assignment, shape, links)
        return Choice(assignment, shape.inner_steps, shape.rank, prediction) if prediction.feasible else None

    def shape_for(inner_steps: int, rank: int | None) -> RunShape:
        return RunShape.from_run(run_variant(run, inner_steps, rank or None))

    def best_layout(inner_steps: int, rank: int | None) -> list[Choice]:
        shape = shape_for(inner_steps, rank)
        return [c for c in (evaluate(a, shape) for a in _assignments(by_id, shape, links)) if c is not None]

    first_h = base.inner_steps if base.inner_steps in h_choices else h_choices[0]
    ranks = sorted({base.rank, *(_rank(d, base.d_model) for d in RANK_DIVISORS)}) if base.rank else [None]
    pool = [c for rank in ranks for c in best_layout(first_h, rank)]  # a pipeline's worth depends on its rank
    if first_h == base.inner_steps and live.prediction.feasible and live.assignment.replicas:
        pool.append(live)
    if not pool:
        raise ValueError("no node can hold the model or complete a virtual replica: nothing to plan")
    layout = _choose(pool).assignment
    settings = [evaluate(layout, shape_for(h, r)) for h in h_choices for r in ranks]
    chosen = _choose([c for c in settings if c is not None] + pool)
    final = [*best_layout(chosen.inner_steps, chosen.rank), chosen]
    tuned = None
    if (chosen.inner_steps, chosen.rank) != (base.inner_steps, base.rank):
        shape = shape_for(chosen.inner_steps, chosen.rank)
        tuned = evaluate(live_assignment(by_id.values(), shape, links), shape)
        final += [tuned] if tuned is not None and tuned.assignment.replicas else []
    best = _choose(final)
    used = set(best.assignment.nodes)
    return AutoPlan(best, live, tuple(sorted(set(by_id) - used)), links, tuned)
