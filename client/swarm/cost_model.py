"""How long one outer round takes, what it trains and what it moves, for a given assignment of nodes to replicas.

The optimising planner (`auto_plan`) searches assignments with this model and `hetero-node plan` prints its
predictions; the netlab's measured rounds check it (README, *The cost model*). Pure arithmetic: the run's sizes
come from `RunShape.from_run` (the codecs the nodes run), speeds and links from peer records or a swarm file.

One round, as the protocol runs it:
* a full replica's inner step takes tokens_per_step / tokens_per_s (its measured full-model throughput); a virtual
  replica's is a GPipe step: M + S − 1 microbatch slots of its slowest stage (its share of the model's FLOPs at
  its node's speed, or its boundary traffic at its link where that takes longer: it is sent while the stage
  computes), plus a round trip per boundary (`Latency`: from the records' measured round trips);
* the training window is H steps of the fastest replica (`--round-s 0`), stretched as the protocol stretches it
  (`client/roles/schedule.py`) until training fills `--target-utilisation` of a round next to the full replicas'
  upper-median exchange (at most 30 times); a stretched round's steps accumulate A = ⌊window / H steps⌋
  batches, and a virtual replica streams them, two batches in flight, paying its GPipe fill and round trips once a
  step (`accumulated_pace`); a replica that would fit fewer than a quarter of H such steps takes smaller ones
  (`own_batches_per_step`). Each replica trains the whole steps that fit and sits the round out below
  `min_inner_steps`;
* the exchange: per shard a member holds, relay-tree (today) moves the K = `--max-contributors` selected messages
  (all C when K is 0 or ≥ C; DiLoCo: all, from their authors) to every member through per-author relay trees,
  K(C−1)/C messages each way on average (an average: a member inside most of the K trees uploads up to 2K), plus per
  tree level (⌊log2 C⌋) a round trip and, below the first, one message's store-and-forward at a relay's link (a
  relay re-serves a message once it has all of it; members whose upload is below a quarter of the upper quartile
  (`slow_uplinks`) are leaves that upload their own message once, never relay, and wait at the median relay's
  link; the others carry the rest at their own; the hop a slow author's message takes through a fast member is
  not priced: a round trip and a fast
  store-and-forward, against a slow copy saved);
  all-to-all (the protocol before) downloads every other member's
  message and serves its own to each of them; butterfly (a sparse reduce-scatter and all-gather) moves about two
  messages each way whatever C is. Stages without the embedding also keep T_fixed current every round: today by
  downloading the entries of E_S the aggregate changed, 8 bytes each, never more than the table ("changes"; the
  union of the aggregated messages' selections, about 1 − (1 − ρ)^C of the table for C messages selecting a fraction
  ρ each), or the whole fp32 table as before ("dense"). Every member also moves a fixed protocol overhead (DHT
  records, matchmaking, manifests). A node's exchange takes its slower direction at its link, plus a matchmaking
  overhead and a round trip;
* tokens count at their value: a replica's at what the algorithm lab measured for its share of the fastest
  replica's batches (`SLOW_TOKEN_VALUE`), a window's at its staleness's (`STALE_TOKEN_VALUE`, below);
* T_fixed's changes are served by the shard-0 holders that are not on slow uplinks (`table_donors`), the load
  shared among them;
* the round is the window plus the longest exchange the others wait on: a relay's whole exchange, a slow leaf's
  own message upload (`_exchanges`). A replica still busy with its own exchange after that (a slow leaf's downloads,
  a later stage's T_fixed upkeep) starts its next window late and trains that much less, as the protocol's
  earliest deadline makes it (`_late_s`; on the netlab a home volunteer at 5 Mbit/s trained 12% fewer steps and
  lengthened the others' rounds by 0.9%, bench/README, *A home volunteer on a slow link*). With overlap, full
  replicas hide their exchange behind the next window, so the round is the longer of the two (stage peers still
  wait theirs out).

With `cadence` (modelled; the protocol does not run it yet) a replica that starts late may instead contribute
once per w rounds (w from `STALE_TOKEN_VALUE`), training from the θ it loaded for w rounds less its own exchange
and its catching up (each skipped round's download, taken in turn with training, not overlapped). Such a
contribution is w − 1 outer steps stale, so its tokens count at the value the algorithm lab measured for w
(`hetero-node-lab sim --slow-windows`); each replica takes the w with the most tokens of value per round. The lab
found stale tokens worth little (0.30 at best), so w = 1, today's rule, wins wherever it fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from hetero_node.client.swarm.planner import PeerInfo
from hetero_node.protocol.flat_exchange import aggregated, contributor_limit, slow_uplinks
from hetero_node.protocol.outer_specs import outer_spec
from hetero_node.protocol.round_stretch import batches_per_step, own_batches_per_step, stretched_window
from hetero_node.protocol.run_config import RunConfig

EXCHANGES = ("relay-tree", "all-to-all", "butterfly")
"""relay-tree: what the swarm runs today (at most K messages per round, spread through relay trees); all-to-all: the
protocol before it (O(R) messages per peer); butterfly: another flat alternative, modelled only."""
TABLE_UPKEEPS = ("changes", "dense")
"""changes: later stages download the entries of E_S the outer step changed (today); dense: the whole T_fixed."""


STALE_TOKEN_VALUE = {1: 1.0, 2: 0.3, 4: 0.0}
"""w → what a slow replica's token trained in a window of w rounds (w − 1 outer steps stale) is worth against a fast
replica's under the best rule the algorithm lab measured, only the windows it measured (`make sim-slow` and
bench/README, *Slow replicas*): fresh every round 1.08, capped at 1; one round stale 0.30 (rebased: its Δ taken
from the θ it is applied to; discounted 0.03, plain −0.13); three rounds stale ≤ 0 under every rule tried. So the
model's windowed replicas contribute every round (w = 1) wherever they can."""


@dataclass(frozen=True)
class RunShape:
    """The sizes of one run that the round's time and bytes depend on."""

    tokens_per_step: int
    inner_steps: int
    stages: int
    microbatches: int
    min_inner_steps: int
    overlap: bool
    shard_message_bytes: tuple[int, ...]  # one replica's outer message per shard
    max_contributors: int  # K: messages a round aggregates at most (0: all; DiLoCo: always all)
    stage_compute_share: tuple[float, ...]  # each stage's fraction of the model's training FLOPs
    boundary_forward_bytes: int  # what one boundary carries forward per inner step (all microbatches)
    boundary_backward_bytes: int
    fixed_table_bytes: int  # T_fixed, fetched each round by stages without the embedding (0: no subspace)
    embedding_density: float  # the fraction of the embedding's entries one replica's message selects (DiLoCo: 1)
    full_memory_bytes: int
    stage_memory_bytes: tuple[int, ...]
    rank: int | None  # the boundary's subspace rank (None: dense boundaries)
    d_model: int
    target_utilisation: float = 0.0  # rounds are stretched so that training fills this share (0: H steps)
    batches_in_flight: int = 2  # a pipeline's batches in flight when its steps accumulate (`models/stages.py`)
    relayed: bool = True  # messages travel through relay trees (SparseLoCo); DiLoCo's come from their authors

    @property
    def message_bytes(self) -> int:
        return sum(self.shard_message_bytes)

    @classmethod
    def from_run(cls, run: RunConfig) -> RunShape:
        return _shape(run)


@cache
def _shape(run: RunConfig) -> RunShape:
    """Cached: the planner asks for the same few (rank, H) variants of one run many times. Imports here: the
    CLI loads this module to build `plan`'s options, and must not load torch for `--help`."""
    from hetero_node.models.config import get_preset
    from hetero_node.models.memory import full_and_stage_memory, parameter_count
    from hetero_node.models.meta import on_meta
    from hetero_node.models.shards import shard_parameter_names
    from hetero_node.models.stages import BATCHES_IN_FLIGHT, stage_layer_ranges
    from hetero_node.models.transformer import Transformer
    from hetero_node.protocol.boundary_codec import BACKWARD, FORWARD, BoundaryFormat

    method = outer_spec(run.outer.outer)
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    stages, micro = run.outer.stages, min(run.pipeline.microbatches, run.batch_size)
    judge = run.outer.admission == "loss"
    full, per_stage = full_and_stage_memory(cfg, run.batch_size, run.seq_len, stages, run.uses_subspace, judge)
    with on_meta():
        model = Transformer(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    messages = tuple(
        method.message_bytes(run, [shapes[n] for n in names]) for names in shard_parameter_names(cfg, stages)
    )
    ranges = stage_layer_ranges(cfg.n_layers, stages)
    flops = [parameter_count(cfg, layers, False, s == stages - 1) for s, layers in enumerate(ranges)]
    rank = run.pipeline.rank(cfg.d_model) if run.pipeline.compressed else None
    fmt = BoundaryFormat(cfg.d_model, cfg.vocab_size, cfg.max_seq_len, rank, run.pipeline.boundary_wire)
    per_micro = run.batch_size // micro
    return RunShape(
        tokens_per_step=run.batch_size * run.seq_len,
        inner_steps=run.outer.inner_steps,
        stages=stages,
        microbatches=micro,
        min_inner_steps=run.outer.min_inner_steps,
        overlap=run.outer.overlap,
        shard_message_bytes=messages,
        max_contributors=contributor_limit(run.outer),
        relayed=method.relayed,
        stage_compute_share=tuple(f / sum(flops) for f in flops),
        boundary_forward_bytes=micro * fmt.message_bytes(FORWARD, per_micro, run.seq_len),
        boundary_backward_bytes=micro * fmt.message_bytes(BACKWARD, per_micro, run.seq_len),
        fixed_table_bytes=cfg.vocab_size * cfg.d_model * 4 if run.uses_subspace else 0,
        embedding_density=method.selected_fraction(run, shapes["embed.weight"]),
        full_memory_bytes=full,
        stage_memory_bytes=tuple(per_stage),
        rank=rank,
        d_model=cfg.d_model,
        target_utilisation=run.outer.target_utilisation if run.outer.round_s <= 0 else 0.0,
        batches_in_flight=BATCHES_IN_FLIGHT,
    )


def run_variant(run: RunConfig, inner_steps: int | None = None, rank: int | None = None) -> RunConfig:
    """The run with another H and/or boundary rank: what the planner compares."""
    outer = run.outer if inner_steps is None else dataclasses.replace(run.outer, inner_steps=inner_steps)
    pipeline = run.pipeline if rank is None else dataclasses.replace(run.pipeline, subspace_rank=rank)
    return dataclasses.replace(run, outer=outer, pipeline=pipeline)


@dataclass(frozen=True)
class LinkModel:
    """What the records do not say: the fixed cost of forming a group, how the exchange runs, and the round trip of
    a node whose record gives none."""

    rtt_ms: float = 0.0
    """A node's round trip when its record says nothing (`Latency`): between two such nodes, this."""
    matchmaking_s: float = 1.0
    exchange: str = "relay-tree"
    table_upkeep: str = "changes"
    cadence: bool = False
    """Slow replicas contribute once per window of several rounds, off the round's critical path (modelled only)."""
    overhead_bytes: float = 0.53e6
    """What a member sends (and receives) per round besides messages: DHT records, matchmaking, manifests,
    verification. 0.53 MB is the 4-node lab's figure (the sparseloco run of `make bench-long`)."""

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if self.table_upkeep not in TABLE_UPKEEPS:
            raise ValueError(f"table_upkeep must be one of {', '.join(TABLE_UPKEEPS)}, got {self.table_upkeep!r}")
        if min(self.rtt_ms, self.matchmaking_s, self.overhead_bytes) < 0:
            raise ValueError("rtt_ms, matchmaking_s and overhead_bytes must be ≥ 0")


@dataclass(frozen=True)
class Assignment:
    """Who does what: full replicas, and virtual replicas as their stage holders in stage order."""

    full: tuple[str, ...] = ()
    virtual: tuple[tuple[str, ...], ...] = ()

    @property
    def replicas(self) -> int:
        return len(self.full) + len(self.virtual)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node it uses: full replicas, then stage holders."""
        return (*self.full, *(p for vr in self.virtual for p in vr))


@dataclass(frozen=True)
class NodeRound:
    """One node's part of a predicted round."""

    role: str  # "full" or "stage"
    replica: int  # index into full replicas, then virtual ones
    steps: int  # inner steps it trains (0: it sits the round out)
    compute_s: float
    exchange_s: float
    bytes_up: float  # per contribution: outer exchange + T_fixed + pipeline boundaries
    bytes_down: float
    memory_ok: bool
    every: int = 1
    """Rounds per contribution (`cadence`): steps, compute, exchange and bytes are per contribution."""
    batches: int = 0
    """Batches it trains per contribution (steps × its batches per step; a window's may exceed H steps' worth)."""
    boundary_up: float = 0.0
    """Of `bytes_up` / `bytes_down`, what its pipeline's boundaries move (the rest is the exchange)."""
    boundary_down: float = 0.0
    token_value: float = 1.0
    """What a token of its replica is worth against the fastest replica's (`SLOW_TOKEN_VALUE`)."""


@dataclass(frozen=True)
class RoundPrediction:
    window_s: float
    round_s: float
    tokens_per_round: float
    """Tokens the replicas train per round (a windowed replica's spread over its window; with K < contributors,
    only K messages a round carry them into θ at once; the others' wait in their error feedback: the lab measures
    what that costs, the model does not)."""
    contributors: int
    nodes: dict[str, NodeRound]
    aggregated: int = 0
    """Messages each shard's round aggregates: min(K, contributors) under relay-tree, else every contributor's."""
    effective_tokens_per_round: float | None = None
    """`tokens_per_round` with slow replicas' and stale windows' tokens at their value (`SLOW_TOKEN_VALUE`,
    `STALE_TOKEN_VALUE`); None (a prediction built by hand): all at face value."""
    accumulation: int = 1
    """Batches per inner step: the window stretched past H steps of the fastest replica (`_stretched`)."""

    @property
    def tokens_per_s(self) -> float:
        """What the planner maximises: tokens per second that reach θ, slow and stale ones at their value."""
        effective = self.effective_tokens_per_round
        return (self.tokens_per_round if effective is None else effective) / self.round_s if self.round_s > 0 else 0.0

    @property
    def trained_tokens_per_s(self) -> float:
        return self.tokens_per_round / self.round_s if self.round_s > 0 else 0.0

    @property
    def feasible(self) -> bool:
        return all(n.memory_ok for n in self.nodes.values())

    def utilisation(self, peer_id: str) -> float:
        node = self.nodes[peer_id]
        return node.compute_s / (node.every * self.round_s) if self.round_s > 0 else 0.0

    @property
    def max_bytes_per_peer(self) -> float:
        return max((max(n.bytes_up, n.bytes_down) for n in self.nodes.values()), default=0.0)


MIN_LINK_MBPS = 1e-3
"""A link advertised as 0 Mbit/s (a node whose bandwidth probe failed says exactly that) is priced at 1 kbit/s: slow
enough to place nothing on it, and no division by zero for every joiner that reads its record (trust review)."""


def _transfer_s(nbytes_up: float, nbytes_down: float, peer: PeerInfo) -> float:
    """Seconds to move both directions at once over the node's link (the slower direction decides)."""
    up = nbytes_up * 8 / (max(peer.upload_mbps, MIN_LINK_MBPS) * 1e6) if nbytes_up else 0.0
    down = nbytes_down * 8 / (max(peer.download_mbps, MIN_LINK_MBPS) * 1e6) if nbytes_down else 0.0
    return max(up, down)


def full_step_s(peer: PeerInfo, shape: RunShape) -> float:
    return shape.tokens_per_step / peer.tokens_per_s if peer.tokens_per_s > 0 else math.inf


def boundary_bytes(stage: int, shape: RunShape) -> tuple[int, int]:
    """(up, down) bytes per inner step of stage `stage`: forward out and backward in toward the next stage,
    forward in and backward out toward the previous one."""
    to_next, to_prev = stage < shape.stages - 1, stage > 0
    up = to_next * shape.boundary_forward_bytes + to_prev * shape.boundary_backward_bytes
    down = to_prev * shape.boundary_forward_bytes + to_next * shape.boundary_backward_bytes
    return up, down


def _slot_s(holders: Sequence[PeerInfo], shape: RunShape) -> float:
    """A pipeline's slot: one microbatch on its slowest stage, its forward and backward or its boundary transfers,
    whichever take longer: a stage sends in the background while it computes the next microbatch
    (`client/roles/stage_link.py: StageSender`). On the netlab (`tiny`, 2 edge stages, single-batch steps of 4
    microbatches, `bench/topologies/pipeline-link-*.toml`) a step took 0.110 s on 900 Mbit/s links and 0.132 s on
    1.5 Mbit/s ones, where each stage moves 17 KB a batch each way (0.094 s): the sum of the two predicted 0.227 s,
    the longer of them 0.117 s."""
    slots = []
    for stage, peer in enumerate(holders):
        if peer.tokens_per_s <= 0:
            return math.inf
        compute = shape.tokens_per_step * shape.stage_compute_share[stage] / peer.tokens_per_s
        slots.append(max(compute, _transfer_s(*boundary_bytes(stage, shape), peer)) / shape.microbatches)
    return max(slots)


@dataclass(frozen=True)
class Latency:
    """Round trips between nodes, estimated from what each record says: its round trip to one common peer (the
    bootstrap, usually; `client/node/round_trip.py`).

    Each such round trip is twice the node's own access delay plus the common peer's, so between nodes a and b it
    is rtt_a + rtt_b less twice the common peer's share, which is taken to be the best-connected node's round trip
    (`core_ms`, the smallest in the swarm): exact when the common peer is as close to the core as that node (the
    netlab's access-latency model, `bench/delay_proxy.py`: 20, 80 and 140 ms between its datacenter and edge nodes
    from records of 20 and 80 ms). A node whose record says nothing (0) counts at `LinkModel.rtt_ms` (so a swarm
    file's single round trip is every pair's), or where that is 0 too, as the best-connected node."""

    default_ms: float = 0.0
    """An unmeasured node's round trip."""
    core_ms: float = 0.0
    typical_ms: float = 0.0
    """The (lower) median exchange member's round trip: the far end of an exchange hop, which relays among them."""

    @classmethod
    def of(cls, peers: Iterable[PeerInfo], links: LinkModel, members: Iterable[PeerInfo] | None = None) -> Latency:
        """From every record (`peers`: the core and an unmeasured node's figure) and the exchange's `members`
        (its typical member; all of `peers` when None)."""
        peers = list(peers)
        figures = [p.rtt_ms for p in peers]
        default = links.rtt_ms or min((f for f in figures if f > 0), default=0.0)
        own = sorted(f or default for f in figures)
        exchanging = own if members is None else sorted(p.rtt_ms or default for p in members)
        core = own[0] if own else default
        return cls(default, core, exchanging[(len(exchanging) - 1) // 2] if exchanging else core)

    def own_ms(self, peer: PeerInfo) -> float:
        return peer.rtt_ms or self.default_ms

    def pair_ms(self, a: PeerInfo, b: PeerInfo) -> float:
        return max(self.own_ms(a) + self.own_ms(b) - self.core_ms, 0.0)

    def hop_ms(self, peer: PeerInfo) -> float:
        """One exchange hop to or from `peer`: its round trip to the median member."""
        return max(self.own_ms(peer) + self.typical_ms - self.core_ms, 0.0)

    def boundaries_s(self, holders: Sequence[PeerInfo]) -> float:
        """A pipeline's round trips, one per boundary (forward one way, the gradient back), in seconds."""
        return sum(self.pair_ms(a, b) for a, b in itertools.pairwise(holders)) / 1e3


def virtual_step_s(holders: Sequence[PeerInfo], shape: RunShape, latency: Latency) -> float:
    """A GPipe inner step: (M + S − 1) slots of the slowest stage, plus a round trip across every boundary."""
    return (shape.microbatches + shape.stages - 1) * _slot_s(holders, shape) + latency.boundaries_s(holders)


def accumulated_pace(holders: Sequence[PeerInfo], shape: RunShape, latency: Latency) -> tuple[float, float]:
    """(seconds per batch, seconds per step) of a virtual replica whose steps accumulate several batches
    (`client/roles/pipeline_schedule.py`): `batches_in_flight` batches' microbatches stream through the pipeline, so a
    batch costs M slots, or a share of a microbatch's trip through the pipeline and back where latency is longer;
    a step of one batch is `virtual_step_s`, the GPipe step, and each step pays the difference once."""
    slot = _slot_s(holders, shape)
    if not math.isfinite(slot):
        return math.inf, 0.0
    trip = latency.boundaries_s(holders)
    per_batch = max(shape.microbatches * slot, (trip + shape.stages * slot) / shape.batches_in_flight)
    return per_batch, virtual_step_s(holders, shape, latency) - per_batch


def exchange_bytes(nbytes: float, contributors: int, exchange: str, limit: int = 0) -> float:
    """Bytes each way one member moves (on average) for one shard whose message is `nbytes`, among `contributors`,
    at most `limit` of whose messages are aggregated (relay-tree only)."""
    if contributors < 2:
        return 0.0
    if exchange == "all-to-all":
        return (contributors - 1) * nbytes
    if exchange == "relay-tree":  # K messages, each to C − 1 members, the uploads spread over the C members
        return aggregated(contributors, limit) * nbytes * (contributors - 1) / contributors
    return 2 * nbytes * (contributors - 1) / contributors  # reduce-scatter, then all-gather, of 1/R parts


def relay_upload_bytes(nbytes: float, contributors: int, limit: int, slow: int, is_slow: bool) -> float:
    """Bytes one member uploads for one shard's relay trees when `slow` of the `contributors` are on slow uplinks
    (`slow_uplinks`): a slow one is a leaf and uploads only its own message, once, when it is selected; the others
    carry the rest of the K(C−1) copies. With none slow this is `exchange_bytes`'s average."""
    if contributors < 2:
        return 0.0
    k = aggregated(contributors, limit)
    own_once = k / contributors * nbytes
    if is_slow:
        return own_once
    return (k * (contributors - 1) * nbytes - slow * own_once) / (contributors - slow)


def exchange_hops(contributors: int, exchange: str) -> int:
    """Round trips a message's trip takes: its relay tree's depth, ⌊log2 C⌋ (relay-tree), else one."""
    if exchange == "relay-tree" and contributors > 2:
        return contributors.bit_length() - 1
    return 1


Member = tuple[str, str, int, int, tuple[int, ...]]
"""(peer, role, replica, stage, shards held) of one node in an assignment."""
SLOW_TOKEN_VALUE = (0.1, 0.25)
"""(worthless, full): a token of a replica that trains at most `worthless` of the fastest replica's batches a round
is worth nothing against the fastest's, from `full` on all of it, linearly between (unmeasured). The algorithm lab's
cells (`make sim-slow-steps`, bench/README *In a stretched round*; `tiny`, 4 replicas of which 2 slow, 3 seeds,
against the slow ones sitting out): at a quarter they helped (−1.3% ± 0.5% eval loss), at a tenth (+0.4% ± 1.9%)
and a twentieth (−0.8% ± 1.8%) nothing measurable."""
LATE_TOLERANCE_S = 1e-6
"""Lateness below this is rounding, not a replica still busy with its exchange."""
Exchange = tuple[float, float, float, float]
"""(bytes up, bytes down, seconds, seconds the others wait on it) of one node's round exchange (`_exchanges`)."""


def predict_round(
    peers: Mapping[str, PeerInfo], assignment: Assignment, shape: RunShape, links: LinkModel = LinkModel()
) -> RoundPrediction:
    """The model's round for this assignment (see the module docstring). Unknown peer ids are a KeyError."""
    latency = Latency.of(peers.values(), links, [peers[p] for p in assignment.nodes])
    paces = [(full_step_s(peers[p], shape), 0.0) for p in assignment.full]
    paces += [accumulated_pace([peers[p] for p in vr], shape, latency) for vr in assignment.virtual]
    step_s = [per_batch + per_step for per_batch, per_step in paces]  # a step of one batch
    finite = [s for s in step_s if math.isfinite(s)]
    base = shape.inner_steps * min(finite) if finite else 0.0
    members: list[Member] = [(p, "full", i, -1, tuple(range(shape.stages))) for i, p in enumerate(assignment.full)]
    members += [
        (p, "stage", len(assignment.full) + v, s, (s,))
        for v, vr in enumerate(assignment.virtual)
        for s, p in enumerate(vr)
    ]
    roles = {replica: role for _, role, replica, _, _ in members}

    def replica_exchange(exchanges: Mapping[str, Exchange], field: int = 2) -> list[float]:
        return [max((exchanges[p][field] for p, _, r, _, _ in members if r == i), default=0.0)
                for i in range(len(paces))]  # fmt: skip

    steps, own = _steps_in(base, 1, paces, shape)
    trains = [math.isfinite(s) for s in step_s] if links.cadence else [n > 0 for n in steps]
    exchanges = _exchanges(peers, members, trains, shape, links, latency)
    window, accumulation = _stretched(base, [e for r, e in enumerate(replica_exchange(exchanges))
                                             if roles[r] == "full" and trains[r]], shape)  # fmt: skip
    if window > base:  # the protocol's stretched round: H bigger steps (`client/roles/schedule.py`)
        steps, own = _steps_in(window, accumulation, paces, shape)
        stretched_trains = [math.isfinite(s) for s in step_s] if links.cadence else [n > 0 for n in steps]
        if stretched_trains != trains:
            trains, exchanges = stretched_trains, _exchanges(peers, members, stretched_trains, shape, links, latency)
    batches = [n * a for n, a in zip(steps, own, strict=True)]

    def settle(trains: list[bool], exchanges: Mapping[str, Exchange]) -> tuple[float, list[int], list[int], list[int]]:
        """(round, steps, batches, every): a replica still busy with its exchange when the others start trains less
        (`_late_s`), or under `cadence` contributes once per w rounds."""
        settled_steps, settled_batches, every = list(steps), list(batches), [1] * len(paces)
        per_replica, holding = replica_exchange(exchanges), replica_exchange(exchanges, 3)
        live = [r for r in range(len(paces)) if trains[r]]
        round_s = _round_s(window, [(roles[r], holding[r]) for r in live], shape)
        for r in live:
            late = _late_s(roles[r], per_replica[r], window, round_s, shape)
            if late > LATE_TOLERANCE_S:
                (settled_steps[r],), (a,) = _steps_in(window, accumulation, [paces[r]], shape, late)
                settled_batches[r] = settled_steps[r] * a
            if links.cadence and (late > LATE_TOLERANCE_S or not settled_steps[r]):
                catch_up = max(_transfer_s(0, exchanges[p][1], peers[p]) for p, _, i, _, _ in members if i == r)
                n, w = _window(paces[r], per_replica[r], catch_up, round_s, shape)
                if w > 1:  # catching up: a round's download, for each round it skips
                    settled_batches[r], every[r], settled_steps[r] = n, w, min(n, shape.inner_steps)
        return round_s, settled_steps, settled_batches, every

    round_s, steps, batches, every = settle(trains, exchanges)
    if any(t and not n for t, n in zip(trains, batches, strict=True)):  # late below its minimum: it sits out
        trains = [t and n > 0 for t, n in zip(trains, batches, strict=True)]
        exchanges = _exchanges(peers, members, trains, shape, links, latency)
        round_s, steps, batches, every = settle(trains, exchanges)

    per_round = [n / w for n, w in zip(batches, every, strict=True)]
    values = [token_value(n, max(per_round, default=0.0)) for n in per_round]
    nodes = {}
    for peer_id, role, replica, stage, _ in members:
        peer, n = peers[peer_id], batches[replica]
        up, down, exchange_s, _ = exchanges[peer_id] if n else (0.0, 0.0, 0.0, 0.0)
        down *= every[replica]  # a windowed replica catches up every round it skipped
        b_up, b_down = (n * b for b in boundary_bytes(stage, shape)) if role == "stage" else (0, 0)
        up, down = up + b_up, down + b_down
        if role == "stage":
            compute = n * shape.tokens_per_step * shape.stage_compute_share[stage] / peer.tokens_per_s if n else 0.0
            memory = shape.stage_memory_bytes[stage]
        else:
            compute, memory = (n * full_step_s(peer, shape) if n else 0.0), shape.full_memory_bytes
        nodes[peer_id] = NodeRound(
            role, replica, steps[replica], compute, exchange_s, up, down, memory <= peer.memory_bytes, every[replica],
            n, b_up, b_down, values[replica],
        )  # fmt: skip
    tokens = sum(per_round) * shape.tokens_per_step
    effective = shape.tokens_per_step * sum(
        n * STALE_TOKEN_VALUE[w] * v for n, w, v in zip(per_round, every, values, strict=True)
    )
    contributors = sum(1 for n in batches if n)
    limit = shape.max_contributors if _exchange_kind(shape, links) == "relay-tree" else 0
    return RoundPrediction(
        window, round_s, tokens, contributors, nodes, aggregated(contributors, limit), effective, accumulation
    )


def _exchange_kind(shape: RunShape, links: LinkModel) -> str:
    """The exchange modelled: DiLoCo's messages come from their authors, never through relay trees."""
    return links.exchange if shape.relayed or links.exchange != "relay-tree" else "all-to-all"


def _steps_in(
    window: float, accumulation: int, paces: Sequence[tuple[float, float]], shape: RunShape, late: float = 0.0
) -> tuple[list[int], list[int]]:
    """(inner steps, batches per step) of each replica in the window, starting `late`: the round's `accumulation`,
    or fewer batches where that leaves a slow replica under a quarter of H steps in the whole window
    (`own_batches_per_step`; the nodes' clock folds a pipeline's per-step fill into its measured time per batch,
    the model keeps it apart); no steps below `min_inner_steps`."""
    steps, own = [], []
    for per_batch, per_step in paces:
        finite = math.isfinite(per_batch + per_step)
        a = own_batches_per_step(window, shape.inner_steps, per_batch, per_step, accumulation) if finite else 1
        n = int(max(window - late, 0.0) / (a * per_batch + per_step) + 1e-9) if finite else 0
        steps.append(n if n >= shape.min_inner_steps else 0)
        own.append(a)
    return steps, own


def _stretched(base: float, full_exchanges: Sequence[float], shape: RunShape) -> tuple[float, int]:
    """(window, batches per step): the protocol stretches a round of H steps of the fastest replica (`base`) so that
    training fills `target_utilisation` of it next to the full replicas' upper-median overhead, here their
    exchange (the protocol's own rule, `client/roles/schedule.py`). Not under overlap, whose overhead (the settling
    of an outer step) the model does not know."""
    if shape.overlap or shape.target_utilisation <= 0 or not full_exchanges or base <= 0:
        return base, 1
    overhead = sorted(full_exchanges)[len(full_exchanges) // 2]
    window = stretched_window(base, overhead, shape.target_utilisation, shape.inner_steps, False)
    return window, batches_per_step(window, base)


def _exchanges(
    peers: Mapping[str, PeerInfo], members: Sequence[Member], trains: Sequence[bool], shape: RunShape,
    links: LinkModel, latency: Latency,
) -> dict[str, Exchange]:  # fmt: skip
    """peer → (bytes up, bytes down, seconds, seconds the others wait on it) of its round's exchange: the messages of
    the shards it holds, T_fixed, the protocol's overhead; nothing for a replica that does not train.

    The others wait on a relay's whole exchange (its children need what it downloads and re-serves), but on a slow
    leaf only for its own message, one upload when it is selected: its downloads and T_fixed's upkeep delay its
    own next window alone (`_late_s`). T_fixed's changes are served by the shard-0 holders that are not slow
    (`client/roles/stage_peer.py: table_donors`), in the background of their next window; a later stage fetches
    them after the outer step, at its own link or at a server's share of its upload, whichever is slower."""
    contributors = sum(1 for t in trains if t)
    exchange = _exchange_kind(shape, links)
    limit = shape.max_contributors if exchange == "relay-tree" else 0
    on_slow_uplinks = _slow_holders(peers, members, trains, shape.stages)
    slow = on_slow_uplinks if exchange == "relay-tree" else {}
    relays = _typical_relays(peers, members, trains, slow)
    shard0 = [p for p, _, replica, stage, _ in members if stage <= 0 and trains[replica]]
    table_servers = [p for p in shard0 if p not in on_slow_uplinks.get(0, ())] or shard0
    table_fetchers = sum(1 for _, _, replica, stage, _ in members if stage > 0 and trains[replica])
    table_down, table_up = _table_upkeep_bytes(
        shape, links, aggregated(contributors, limit), len(table_servers), table_fetchers
    )
    serving_s = max((_transfer_s(table_up, 0, peers[p]) for p in table_servers), default=0.0)
    exchanges = {}
    for peer_id, _, replica, stage, shards in members:
        peer = peers[peer_id]
        if not trains[replica]:
            exchanges[peer_id] = (0.0, 0.0, 0.0, 0.0)
            continue
        down = links.overhead_bytes + sum(
            exchange_bytes(shape.shard_message_bytes[s], contributors, exchange, limit) for s in shards
        )
        up = down
        if exchange == "relay-tree":  # slow leaves (`protocol/flat_exchange.py`): the fast members upload more
            up = links.overhead_bytes + sum(
                relay_upload_bytes(shape.shard_message_bytes[s], contributors, limit, len(slow[s]), peer_id in slow[s])
                for s in shards
            )
        leaf = bool(shards) and all(peer_id in slow.get(s, ()) for s in shards)
        own_message = links.overhead_bytes + sum(shape.shard_message_bytes[s] for s in shards)
        waited = _transfer_s(own_message, 0, peer) if leaf else _transfer_s(up, down, peer)
        busy = _transfer_s(up, down, peer)
        if stage > 0 and table_down:
            busy, down = busy + max(_transfer_s(0, table_down, peer), serving_s), down + table_down
        up += table_up if stage <= 0 and peer_id in table_servers else 0.0
        hops = exchange_hops(contributors, exchange)
        # a tree level: its relay stores a whole message, then forwards it; a slow leaf's relays are not itself
        via = {s: relays.get(s, peer) if peer_id in slow.get(s, ()) else peer for s in shards}
        level_s = sum(_transfer_s(shape.shard_message_bytes[s], shape.shard_message_bytes[s], via[s]) for s in shards)
        fixed_s = links.matchmaking_s + hops * latency.hop_ms(peer) / 1e3 + (hops - 1) * level_s
        exchanges[peer_id] = (up, down, busy + fixed_s, waited + fixed_s)
    return exchanges


def token_value(batches: float, fastest: float) -> float:
    """What a token of a replica training `batches` a round is worth beside the fastest replica's `fastest`
    (`SLOW_TOKEN_VALUE`)."""
    worthless, full = SLOW_TOKEN_VALUE
    return min(1.0, max(0.0, (batches / fastest - worthless) / (full - worthless))) if fastest > 0 else 0.0


def _late_s(role: str, exchange_s: float, window: float, round_s: float, shape: RunShape) -> float:
    """How long after the others start their next window a replica whose own exchange takes `exchange_s` is still
    busy with it: it then adopts their deadline (`client/roles/schedule.py`: the earliest one announced) and trains
    that much less. Under overlap a full replica's exchange runs behind the next window."""
    behind = role == "full" and shape.overlap
    return exchange_s - (round_s if behind else round_s - window)


def _window(
    pace: tuple[float, float], exchange_s: float, catch_up_s: float, round_s: float, shape: RunShape
) -> tuple[int, int]:
    """(batches, w) of a replica that starts late (`cadence`): what it trains in w rounds less its exchange and its
    catching up on the w − 1 rounds it skipped (link and compute taken in turn, not overlapped), for the w with the
    most tokens of value per round (`STALE_TOKEN_VALUE`; its `SLOW_TOKEN_VALUE` is priced after, not in this
    choice); (0, 1) when no window holds `min_inner_steps` steps."""
    best = (0.0, 0, 1)
    for w, value in sorted(STALE_TOKEN_VALUE.items()):
        n = _batches_in(w * round_s - exchange_s - (w - 1) * catch_up_s, *pace, shape.inner_steps)
        if min(n, shape.inner_steps) >= shape.min_inner_steps and n * value / w > best[0]:
            best = (n * value / w, n, w)
    return best[1], best[2]


def _batches_in(seconds: float, per_batch: float, per_step: float, inner_steps: int) -> int:
    """Batches a replica trains in `seconds`: one per step up to H steps, beyond that H steps accumulating more (as
    stretched rounds do, `client/roles/schedule.py`), each step paying `per_step` once."""
    if seconds <= 0 or not math.isfinite(per_batch):
        return 0
    n = seconds / (per_batch + per_step)
    if n > inner_steps:
        n = (seconds - inner_steps * per_step) / per_batch
    return int(n + 1e-9)


def _slow_holders(
    peers: Mapping[str, PeerInfo], members: Sequence[tuple[str, str, int, int, tuple[int, ...]]], trains: list[bool],
    stages: int,
) -> dict[int, frozenset[str]]:  # fmt: skip
    """Per shard, its training holders on slow uplinks (`slow_uplinks`): the leaves of that shard's relay trees."""
    slow = {}
    for s in range(stages):
        holders = {p: peers[p].upload_mbps for p, _, replica, _, held in members if trains[replica] and s in held}
        slow[s] = slow_uplinks(holders, list(holders))
    return slow


def _typical_relays(
    peers: Mapping[str, PeerInfo], members: Sequence[Member], trains: Sequence[bool],
    slow: Mapping[int, frozenset[str]],
) -> dict[int, PeerInfo]:  # fmt: skip
    """Per shard with slow holders, its median relay (by upload): the link a message crosses at each level of its
    tree on its way to a slow leaf, which never relays (`relay_parent`)."""
    relays = {}
    for s, leaves in slow.items():
        if not leaves:
            continue
        candidates = sorted(
            (peers[p] for p, _, replica, _, held in members if trains[replica] and s in held and p not in leaves),
            key=lambda peer: peer.upload_mbps,
        )
        if candidates:
            relays[s] = candidates[len(candidates) // 2]
    return relays


def _table_upkeep_bytes(
    shape: RunShape, links: LinkModel, messages: int, holders: int, fetchers: int
) -> tuple[float, float]:
    """(what a later stage downloads, what each shard-0 holder uploads) per round to keep T_fixed current, when the
    outer step aggregated `messages` messages."""
    if not shape.fixed_table_bytes or not holders:
        return 0.0, 0.0
    down = float(shape.fixed_table_bytes)
    if links.table_upkeep == "changes":  # the union of the contributors' selections: 4 of 8 bytes per entry
        changed = 1 - (1 - shape.embedding_density) ** messages
        down = min(down, 2 * changed * shape.fixed_table_bytes)
    return down, down * fetchers / holders


def _round_s(window: float, exchanges: Sequence[tuple[str, float]], shape: RunShape) -> float:
    """The window plus the slowest (role, exchange seconds) of the replicas that run every round (see the module
    docstring for overlap)."""
    full = max((e for role, e in exchanges if role == "full"), default=0.0)
    stage = max((e for role, e in exchanges if role == "stage"), default=0.0)
    if shape.overlap:
        return max(window + stage, window, full)
    return window + max(full, stage)
