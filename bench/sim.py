"""`hetero-node-lab sim`: the algorithm lab. R replicas in one process, step-synchronous, no network.

It measures algorithms, not timing: every replica trains its H inner steps from θ(t) on its own data shard
(`sim_replicas`: the nodes' trainer, and for a virtual replica the stage peers' `PipelineStage`s with real boundary
messages), encodes Δ with its own outer method per parameter shard (error feedback, top-k, 2-bit codec), and θ(t+1)
is the judge's `combine` + `update` of the decoded messages, then the drift transfer, as on every member of a
group. Bytes are the real payload lengths, times what each method's transport moves (`messages_moved`). A test
shows that a 2-replica round here and on a loopback swarm give the same θ(t+1) fingerprint.

The grid (`SimConfig`): methods × replica counts × H × top-k × subspace rank, each for `--seeds` seeds; the report
(`sim_report`) gives mean ± std over seeds, the paper's three findings as tables, and loss-vs-tokens and
loss-vs-bytes plots.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.progress import Progress

from hetero_node.bench.config import SUBSPACE_METHODS, SimConfig
from hetero_node.bench.sim_cadence import Cadence, contribution_scaling, lab_cadences
from hetero_node.bench.sim_replicas import CPU, SimFullReplica, SimReplica, SimVirtualReplica, global_model
from hetero_node.bench.sim_report import write_report
from hetero_node.bench.sim_traffic import messages_moved, table_upkeep_bytes
from hetero_node.client.outer.shard_state import state_fingerprint
from hetero_node.client.roles.replica import STEP_STRIDE
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, build_token_store, val_batches
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.shards import fingerprint, shard_parameter_names, shard_tensors
from hetero_node.models.subspace import drift_transfer_, embedding_change, subspace_basis
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.models.trainer import InnerTrainer, resolve_device
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.flat_exchange import contributor_limit, selected_contributors, selection_seed
from hetero_node.protocol.outer_methods import outer_method
from hetero_node.protocol.run_config import OptimConfig, OuterConfig, PipelineConfig, RunConfig, SparseLoCoConfig
from hetero_node.protocol.state_wire import EMBED, FIXED

logger = logging.getLogger(__name__)

FULL, VIRTUAL = "full", "virtual"


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a method and the settings swept for it (None where the method has no such knob)."""

    method: str
    replicas: int
    inner_steps: int
    topk: int | None
    rank_divisor: int | None
    contributors: int = 0
    """K: messages each round aggregates (`--max-contributors`); 0 when every replica's is (K ≥ R, ddp)."""
    slow: int = 0
    """The last `slow` replicas train 1/`slow_factor` as fast, contributing once per `window` rounds (`sim_cadence`)."""
    slow_factor: int = 1
    window: int = 1
    slow_rule: str = ""
    """How contributions are scaled (`SLOW_RULES`); "" where the slow replicas sit out."""
    accumulation: int = 1
    """Batches per inner step of the fast replicas (a stretched round)."""
    slow_steps: str = "fewer"
    """How the slow replicas fill a stretched round (`SLOW_STEPS`)."""

    @property
    def name(self) -> str:
        parts = [self.method, f"R{self.replicas}", f"H{self.inner_steps}"]
        parts += [] if self.topk is None else [f"k{self.topk}"]
        parts += [] if self.rank_divisor is None else [f"d/{self.rank_divisor}"]
        parts += [f"K{self.contributors}"] if self.contributors else []
        parts += [f"A{self.accumulation}"] if self.accumulation > 1 else []
        if self.slow:
            every = f"w{self.window} {self.slow_rule}" if self.window else "sit out"
            parts += [f"slow{self.slow}/{self.slow_factor}", every]
            parts += ["smaller steps"] if self.window and self.slow_steps == "smaller" else []
        return " ".join(parts)

    def cadences(self) -> list[Cadence]:
        return lab_cadences(self.replicas, self.inner_steps, self.slow, self.slow_factor, self.window,
                            self.accumulation, self.slow_steps)  # fmt: skip

    @property
    def layout(self) -> list[str]:
        """Which replicas are full and which virtual: hetero and none put the first half full."""
        if self.method == "compress-all":
            return [VIRTUAL] * self.replicas
        if self.method in ("hetero", "none"):
            full = self.replicas // 2
            return [FULL] * full + [VIRTUAL] * (self.replicas - full)
        return [FULL] * self.replicas


def grid(cfg: SimConfig) -> list[Cell]:
    """Every cell of the sweep, knobs a method does not have left out (so no cell runs twice)."""
    cells = []
    for method in cfg.method_list:
        sparse = method not in ("ddp", "diloco")
        for replicas in cfg.replica_counts:
            for h in cfg.h_list:
                for k in cfg.topk_list if sparse else [None]:
                    for rank in cfg.rank_list if method in SUBSPACE_METHODS else [None]:
                        for limit in cfg.contributor_list if sparse else [0]:  # only SparseLoCo keeps Δ owed
                            cell = Cell(method, replicas, h, k, rank, limit if 0 < limit < replicas else 0,
                                        accumulation=1 if method == "ddp" else cfg.accumulation)  # fmt: skip
                            cells += _slow_variants(cfg, cell) if cfg.slow_replicas and method != "ddp" else [cell]
    return list(dict.fromkeys(cells))


def _slow_variants(cfg: SimConfig, cell: Cell) -> list[Cell]:
    """`cell` as it is (every replica fast: the report's reference), then with its last `--slow-replicas` slow, once
    per window, rule and step shape swept (a fresh window is neither discounted nor rebased: only windows of several
    rounds; step shapes differ only in a stretched round)."""
    slow = dict(slow=cfg.slow_replicas, slow_factor=cfg.slow_factor)
    shapes = cfg.slow_steps_list if cell.accumulation > 1 else ["fewer"]
    variants = [cell]
    for w in cfg.window_list:
        rules = [r for r in cfg.slow_rule_list if w > 1 or r in ("plain", "rescaled")] if w else [""]
        variants += [dataclasses.replace(cell, **slow, window=w, slow_rule=rule, slow_steps=shape)
                     for rule in rules for shape in (shapes if w else ["fewer"])]  # fmt: skip
    return variants


def cell_run_config(cfg: SimConfig, cell: Cell, seed: int, vocab_size: int, store: TokenStore) -> RunConfig:
    """The run every replica of a cell agrees on, as `hetero-node bootstrap` would announce it."""
    d_model = get_preset(cfg.preset, vocab_size=vocab_size).d_model
    compression = {"compress-all": "compress-all", "none": "none"}.get(cell.method, "subspace")
    return RunConfig(
        preset=cfg.preset, vocab_size=vocab_size, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed,
        data_shards=max(16, cell.replicas), data_identity=store.identity, tokenizer_identity="lab",
        outer=OuterConfig(outer="diloco" if cell.method == "diloco" else "sparseloco", inner_steps=cell.inner_steps,
                          rounds=cfg.rounds, stages=cfg.stages, max_contributors=cell.contributors),
        optim=OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps),
        sparseloco=SparseLoCoConfig(topk=cell.topk or SparseLoCoConfig.topk),
        pipeline=PipelineConfig(activation_compression=compression, microbatches=cfg.microbatches,
                                subspace_rank=max(1, d_model // cell.rank_divisor) if cell.rank_divisor else 0),
    )  # fmt: skip


# -------------------------------------------------------------------------------------------- the rounds


@dataclass
class RoundPoint:
    """The swarm after round t's outer step (cumulative tokens and bytes)."""

    round: int
    tokens: int
    """Tokens trained by all replicas so far."""
    bytes_per_replica: float
    """Mean bytes one replica sent so far (messages, boundaries, table)."""
    eval_loss: float
    fingerprints: dict[str, str]
    traffic: dict[str, float]
    """This round's bytes per replica by kind: outer, boundary, table."""


class OuterSwarm:
    """θ(t) and T_fixed as every member holds them (on the CPU, as the outer methods expect), the judge's outer
    methods that advance them, and an evaluator on `device` (a copy of θ(t) there when that is not the CPU)."""

    def __init__(self, run: RunConfig, device: torch.device = CPU) -> None:
        self.run = run
        self.model = global_model(run)
        cfg = self.model.cfg
        self.shard_names = shard_parameter_names(cfg, run.outer.stages)
        params = dict(self.model.named_parameters())
        self.judges = [outer_method(run, [tuple(params[n].shape) for n in names]) for names in self.shard_names]
        self.basis = subspace_basis(cfg.d_model, run.pipeline.rank(cfg.d_model), run.seed) if run.uses_subspace \
            else None  # fmt: skip
        self.eval_model = self.model if device == CPU else global_model(run).to(device)
        self.evaluator = InnerTrainer(self.eval_model, run.optim, run.total_inner_steps, device)
        self.change_bytes = 0
        """Bytes of the last outer step's change to E_S (what later stages download to keep T_fixed)."""

    def theta(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    @property
    def fixed(self) -> torch.Tensor | None:
        return self.model.embed_fixed

    def evaluate(self, held_out: list) -> float:
        """θ(t)'s held-out loss (copied to the evaluation device first)."""
        if self.eval_model is not self.model:
            self.eval_model.load_state_dict(self.model.state_dict())
        return self.evaluator.evaluate(held_out)

    @torch.no_grad()
    def step(
        self, replicas: list[SimReplica], names: list[str], round_: int, tokens: list[int], factors: list[float],
        rebased: list[bool] | None = None,
    ) -> list[int]:  # fmt: skip
        """θ(t+1) from the contributing replicas' encoded messages, each weighted by the tokens it trained and its
        Δ scaled by its factor (1 unless stale and discounted), taken from θ(t) where `rebased`; returns each
        replica's message bytes."""
        rebased = rebased or [False] * len(replicas)
        theta = self.theta() if any(rebased) else None
        deltas = [[[d * f for d in shard] if f != 1.0 else shard for shard in r.shard_deltas(theta if b else None)]
                  for r, f, b in zip(replicas, factors, rebased, strict=True)]  # fmt: skip
        before = self.model.embed.weight.detach().clone() if self.basis is not None else None
        sizes = [0] * len(replicas)
        limit = contributor_limit(self.run.outer)
        start_fps = self.fingerprints() if 0 < limit < len(names) else {}  # seeds, needed only to leave some out
        for s, (judge, shard) in enumerate(zip(self.judges, self.shard_names, strict=True)):
            seed = selection_seed(self.run.run_id, s, round_, start_fps.get(str(s), ""))
            chosen = set(selected_contributors(names, limit, seed))
            messages, senders, weights = [], [], []
            for i, replica in enumerate(replicas):
                encoded = replica.methods[s].encode(deltas[i][s])
                sizes[i] += len(encoded.payload)
                if names[i] in chosen:
                    messages.append(judge.decode(encoded.payload))
                    senders.append(names[i])
                    weights.append(float(tokens[i]))
                else:  # left out this round: its Δ stays owed, as on a swarm member
                    replica.methods[s].defer(encoded.snapshot, encoded.payload)
            combined = judge.combine(messages, weights, senders)
            start = shard_tensors(self.model, shard)
            for p, value in zip(start, judge.update([p.detach().clone() for p in start], combined), strict=True):
                p.copy_(value)
        if self.basis is not None and self.run.pipeline.drift_transfer:
            positions, values = embedding_change(before, self.model.embed.weight)
            self.change_bytes = 4 * (len(positions) + len(values))  # int32 positions, fp32 values
            drift_transfer_(self.model, self.basis)
        return sizes

    def fingerprints(self) -> dict[str, str]:
        """What a node's round record holds: each shard's θ(t+1) with T_fixed, and the tables T_fixed and E_S."""
        fixed = self.fixed
        fps = {str(s): state_fingerprint(shard_tensors(self.model, names), fixed)
               for s, names in enumerate(self.shard_names)}  # fmt: skip
        if fixed is None:
            return fps
        return {**fps, FIXED: fingerprint([fixed]), EMBED: fingerprint([self.model.embed.weight])}


def simulate(
    run: RunConfig, layout: list[str], store: TokenStore, held_out: list, on_round: Callable[[RoundPoint], None],
    names: list[str] | None = None, device: torch.device = CPU, cadences: list[Cadence] | None = None,
    slow_rule: str = "plain",
) -> list[RoundPoint]:  # fmt: skip
    """`run.outer.rounds` rounds of full ("full") and virtual ("virtual") replicas; replica i trains data shard i.

    `names` order the members as peer ids do in a swarm (the aggregate is summed in sorted-name order). `cadences`
    (default: H steps, every round) say when each replica trains and contributes; a window's steps are trained
    from the θ loaded at its start and contributed at its end, scaled by `slow_rule`. A point's tokens are those
    contributed so far (a window still open at the end has reached no θ).
    """
    swarm = OuterSwarm(run, device)
    replicas = [(SimFullReplica if kind == FULL else SimVirtualReplica)(run, store, i, device)
                for i, kind in enumerate(layout)]  # fmt: skip
    names = names or [f"replica-{i:04d}" for i in range(len(replicas))]
    H, R = run.outer.inner_steps, len(replicas)
    cadences = cadences or [Cadence(H)] * R
    tokens_per_step = run.batch_size * run.seq_len
    points: list[RoundPoint] = []
    sent, tokens = 0.0, 0
    opened, trained = [0] * R, [0] * R  # each replica's window: the round it opened, the steps it trained
    reference = H * max(c.accumulation for c in cadences)  # batches of a fast replica's round: `rescaled`'s H steps
    for t in range(run.outer.rounds):
        boundary = 0.0
        for i, (replica, cadence) in enumerate(zip(replicas, cadences, strict=True)):
            if cadence.starts(t):
                replica.load(swarm.theta(), swarm.fixed)
                opened[i], trained[i] = t, cadence.steps(t)
                replica.train(t, trained[i], cadence.accumulation)
                boundary += replica.boundary_bytes
        now = [i for i, cadence in enumerate(cadences) if cadence.ends(t)]
        outer = 0.0
        if now:  # else nobody closes a window: θ stays
            factors, weights = zip(*(contribution_scaling(slow_rule, trained[i] * cadences[i].accumulation, reference,
                                                          t - opened[i]) for i in now), strict=True)  # fmt: skip
            sizes = swarm.step([replicas[i] for i in now], [names[i] for i in now], t,
                               [trained[i] * cadences[i].accumulation * tokens_per_step * w
                                for i, w in zip(now, weights, strict=True)],
                               list(factors), [slow_rule == "rebased" and opened[i] < t for i in now])  # fmt: skip
            outer = messages_moved(run.outer.outer, len(now), H, contributor_limit(run.outer)) * sum(sizes) / R
        tokens += sum(trained[i] * cadences[i].accumulation for i in now) * tokens_per_step
        table = table_upkeep_bytes(run, swarm.change_bytes) * layout.count(VIRTUAL) / R
        sent += outer + boundary / R + table
        point = RoundPoint(t, tokens, sent, swarm.evaluate(held_out), swarm.fingerprints(),
                           {"outer": outer, "boundary": boundary / R, "table": table})  # fmt: skip
        points.append(point)
        on_round(point)
    return points


def simulate_ddp(
    run: RunConfig, replicas: int, store: TokenStore, held_out: list, on_round: Callable[[RoundPoint], None],
    device: torch.device = CPU,
) -> list[RoundPoint]:  # fmt: skip
    """Gradient averaging every step: one step on all replicas' batches at once (their mean gradient, as a
    DDP all-reduce gives), evaluated every H steps so its curve lines up with the outer methods' rounds."""
    model = Transformer(get_preset(run.preset, vocab_size=run.vocab_size), seed=run.seed).to(device)
    trainer = InnerTrainer(model, run.optim, run.total_inner_steps, device)
    shards = [ShardBatches(store, i % run.data_shards, run.data_shards, run.batch_size, run.seq_len, run.seed)
              for i in range(replicas)]  # fmt: skip
    H = run.outer.inner_steps
    per_round = messages_moved("ddp", replicas, H) * 4 * sum(p.numel() for p in model.parameters())  # fp32 grads
    points: list[RoundPoint] = []
    for t in range(run.outer.rounds):
        for i in range(H):
            batches = [s.batch(t * STEP_STRIDE + i) for s in shards]
            trainer.step = t * H + i
            trainer.train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        point = RoundPoint(t, (t + 1) * replicas * H * run.batch_size * run.seq_len, (t + 1) * per_round,
                           trainer.evaluate(held_out), {"model": fingerprint(list(model.parameters()))},
                           {"outer": per_round, "boundary": 0.0, "table": 0.0})  # fmt: skip
        points.append(point)
        on_round(point)
    return points


def run_cell(cfg: SimConfig, cell: Cell, seed: int, store: TokenStore, vocab_size: int, held_out: list,
             on_round: Callable[[RoundPoint], None]) -> dict[str, Any]:  # fmt: skip
    """One seed of one cell: its settings and its round curve."""
    run, device = cell_run_config(cfg, cell, seed, vocab_size, store), resolve_device(cfg.device)
    if cell.method == "ddp":
        points = simulate_ddp(run, cell.replicas, store, held_out, on_round, device)
    else:
        points = simulate(run, cell.layout, store, held_out, on_round, device=device, cadences=cell.cadences(),
                          slow_rule=cell.slow_rule or "plain")  # fmt: skip
    start_loss = Transformer(get_preset(run.preset, vocab_size=vocab_size), seed=seed).to(device)
    initial = InnerTrainer(start_loss, run.optim, 1, device).evaluate(held_out)
    return {**dataclasses.asdict(cell), "cell": cell.name, "seed": seed, "initial_eval_loss": initial,
            "rounds": [dataclasses.asdict(p) for p in points]}  # fmt: skip


@dataclass(frozen=True)
class LabData:
    """What every run of a sweep reads: the bundled corpus's tokens and the fixed held-out batches."""

    store: TokenStore
    vocab_size: int
    held_out: list

    @classmethod
    def load(cls, cfg: SimConfig) -> LabData:
        tokenizer = load_tokenizer(None)
        store = build_token_store(None, tokenizer, default_cache_dir())
        return cls(store, tokenizer.vocab_size, val_batches(store, cfg.batch_size, cfg.seq_len, cfg.eval_batches))


_worker_data: LabData | None = None


def _run_in_worker(cfg: SimConfig, cell: Cell, seed: int) -> dict[str, Any]:
    """One run in a `--jobs` worker process (the corpus loaded once per worker)."""
    global _worker_data
    if _worker_data is None:  # each worker gets its share of the cores: oversubscribed OpenMP threads spin (30× slower)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.jobs))
        _worker_data = LabData.load(cfg)
    data = _worker_data
    return run_cell(cfg, cell, seed, data.store, data.vocab_size, data.held_out, lambda _point: None)


def run_sim(cfg: SimConfig, progress: Progress) -> dict[str, Any]:
    """Every cell for every seed (a progress bar per run, or per sweep with `--jobs`); writes report.json after
    each run (an interrupted sweep keeps what finished), then report.md and the plots."""
    if cfg.report_only:
        return write_report(json.loads((cfg.out / "report.json").read_text()), cfg.out)
    runs = [(cell, seed) for cell in grid(cfg) for seed in range(cfg.seeds)]
    overall = progress.add_task("sim runs", total=len(runs))
    report: dict[str, Any] = {"config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()}, "runs": []}
    cfg.out.mkdir(parents=True, exist_ok=True)

    def finished(run: dict[str, Any]) -> None:
        report["runs"].append(run)
        progress.advance(overall)
        (cfg.out / "report.json").write_text(json.dumps(report, indent=1))
        logger.info("%s seed %d: final eval loss %.4f", run["cell"], run["seed"], run["rounds"][-1]["eval_loss"])

    if cfg.jobs > 1:
        _run_in_processes(cfg, runs, finished)
    else:
        _run_in_turn(cfg, runs, progress, finished)
    return write_report(report, cfg.out)


def _run_in_turn(cfg: SimConfig, runs: list[tuple[Cell, int]], progress: Progress,
                 finished: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
    data = LabData.load(cfg)
    for cell, seed in runs:  # cell by cell, so an interrupted sweep leaves whole cells in report.json
        name = f"{cell.name} seed {seed}"
        task = progress.add_task(name, total=cfg.rounds)

        def advance(point: RoundPoint, task: Any = task, name: str = name) -> None:
            progress.update(task, advance=1, description=f"{name}: eval {point.eval_loss:.3f}")

        finished(run_cell(cfg, cell, seed, data.store, data.vocab_size, data.held_out, advance))
        progress.update(task, visible=False)


def _run_in_processes(cfg: SimConfig, runs: list[tuple[Cell, int]], finished: Callable[[dict[str, Any]], None]) -> None:
    """`--jobs` worker processes, one run each at a time: each run is the same computation as in turn (its own
    models, data order and seed), so the report is the same; what a GPU machine's many cores are for."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=context) as pool:
        futures = [pool.submit(_run_in_worker, cfg, cell, seed) for cell, seed in runs]
        for future in as_completed(futures):
            finished(future.result())
