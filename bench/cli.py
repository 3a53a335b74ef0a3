"""`hetero-node-lab` (also `python -m hetero_node.bench`): the lab's commands, outside the product's CLI.

The lab stands on the product (it drives `hetero-node` processes and imports its code); the product never imports
the lab, as torchtitan keeps `experiments/` and hivemind `benchmarks/` outside their libraries. Each command
imports what it runs, so `--help` answers at once.
"""

from __future__ import annotations

import typer

from hetero_node.bench.config import (
    AdmissionConfig,
    AgreementConfig,
    BenchConfig,
    ByzantineConfig,
    DDPWorkerConfig,
    ExchangeScalingConfig,
    FuzzConfig,
    KillSoakConfig,
    LocalRanksConfig,
    NatBenchConfig,
    PlanScalingConfig,
    PoisonConfig,
    RoundModesConfig,
    SimConfig,
    SlowLinkConfig,
    SoakConfig,
    SwarmFuzzConfig,
    SybilConfig,
)
from hetero_node.client.cli.entry import command_line, err_console, print_plain, run, run_with_progress
from hetero_node.client.cli.options import expand_dataclass_options
from hetero_node.client.config import OptimConfig, RunOptions
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

lab = command_line(
    "hetero-node-lab", "The hetero-node lab: benchmarks on shaped links, soaks, fuzzers, the algorithm lab."
)


@lab.command()
@expand_dataclass_options
def bench(cfg: BenchConfig) -> None:
    """Compare training methods on a lab of shaped network namespaces (needs root); writes report.json/.md, plots."""
    from hetero_node.bench.suite import run_bench

    path = run_bench(cfg, err_console)
    print_plain(path.with_suffix(".md").read_text())
    print_plain(f"report: {path} and {path.with_suffix('.md')}")


@lab.command("plan-scaling")
@expand_dataclass_options
def bench_plan(cfg: PlanScalingConfig) -> None:
    """Weak scaling by the cost model from 10 to 1,000 volunteers (a swarm file's mix), all-to-all vs butterfly
    exchange, the planner choosing at every size; report.json, report.md and a plot under --out."""
    from hetero_node.bench.plan_scaling import render_markdown, run_plan_scaling

    run_with_progress(run_plan_scaling, render_markdown, cfg)


@lab.command("exchange")
@expand_dataclass_options
def bench_exchange(cfg: ExchangeScalingConfig) -> None:
    """Bytes a full replica downloads per round in loopback swarms of 2 to 16 replicas (tiny), measured and
    modelled (today's all-to-all exchange, and butterfly); report.json and report.md under --out."""
    from hetero_node.bench.exchange_scaling import render_markdown, run_exchange_scaling

    run_with_progress(run_exchange_scaling, render_markdown, cfg)


@lab.command("kills")
@expand_dataclass_options
def bench_kills(cfg: KillSoakConfig) -> None:
    """Kill (and restart) or freeze random peers of a local swarm through a long run; report agreement, waits,
    recovery and leftover processes (report.json and report.md under --out)."""
    from hetero_node.bench.kill_soak import render_markdown, run_kill_soak

    run_with_progress(run_kill_soak, render_markdown, cfg)


@lab.command("agreement")
@expand_dataclass_options
def bench_agreement(cfg: AgreementConfig) -> None:
    """The swarm CI's tests run (4 full replicas, 2 shards, tiny), looped: rounds in which replicas disagree, rounds
    aggregated without every replica, runs that failed (report.json and report.md under --out)."""
    from hetero_node.bench.agreement import render_markdown, run_agreement

    run_with_progress(run_agreement, render_markdown, cfg)


@lab.command("byzantine")
@expand_dataclass_options
def bench_byzantine(cfg: ByzantineConfig) -> None:
    """Attack the outer step with finite, well-formed messages (in one process, the nodes' own code) and compare
    the honest replicas' eval loss under each aggregation rule (report.json and report.md under --out)."""
    from hetero_node.bench.byzantine import render_markdown, run_byzantine

    run_with_progress(run_byzantine, render_markdown, cfg)


@lab.command("sim")
@expand_dataclass_options
def sim(cfg: SimConfig) -> None:
    """The algorithm lab: replicas in one process (the nodes' own training, codecs and outer step, no network)
    over a grid of methods, ranks, H, top-k and replica counts; mean ± std over seeds, the paper's three findings,
    loss-vs-tokens and loss-vs-bytes plots (report.json, report.md and PNGs under --out)."""
    from hetero_node.bench.sim import run_sim
    from hetero_node.bench.sim_report import render_markdown

    run_with_progress(run_sim, render_markdown, cfg)


@lab.command("fuzz")
@expand_dataclass_options
def bench_fuzz(cfg: FuzzConfig) -> None:
    """Feed structure-aware malformed inputs to every parser a peer's bytes reach; count crashes (report.json and
    report.md under --out; exits 1 if anything crashed)."""
    from hetero_node.bench.fuzz import render_markdown, run_fuzz

    with err_console.status(f"fuzzing with {cfg.cases:,} inputs"):
        results = run_fuzz(cfg.cases, cfg.seed, cfg.out)
    print_plain(render_markdown(results))
    if any(r.crashes for r in results.values()):
        raise typer.Exit(1)


@lab.command("poison")
@expand_dataclass_options
def bench_poison(cfg: PoisonConfig) -> None:
    """Let a joiner load the swarm's state from donors of which some lie (other rounds, weights or fingerprints);
    count, per scenario, what it loaded (report.json and report.md under --out)."""
    from hetero_node.bench.poison import render_markdown, run_poison

    run_with_progress(run_poison, render_markdown, cfg)


@lab.command("admission")
@expand_dataclass_options
def bench_admission(cfg: AdmissionConfig) -> None:
    """Loss-scored admission in real swarms: two honest full replicas with or without a negating one, under each
    rule with and without --admission loss (loopback, about 40 s a cell); report.json/.md under --out."""
    from hetero_node.bench.admission import render_markdown, run_admission

    run_with_progress(run_admission, render_markdown, cfg)


@lab.command("sybil")
@expand_dataclass_options
def bench_sybil(cfg: SybilConfig) -> None:
    """Flood the run's records with record-only identities (ids ground low, a round ahead, claiming a held slot) and
    ask an honest node's view and votes, before and after counting work (report.json and report.md under --out)."""
    from hetero_node.bench.sybil import render_markdown, run_sybil

    run_with_progress(run_sybil, render_markdown, cfg)


@lab.command("soak")
@expand_dataclass_options
def bench_soak(cfg: SoakConfig) -> None:
    """Run a local swarm for a long time and watch every peer's memory, file descriptors, threads and processes;
    then stop it and count what is left behind (report.json and report.md under --out)."""
    from hetero_node.bench.soak import render_markdown, run_soak

    run_with_progress(run_soak, render_markdown, cfg)


@lab.command("nat")
@expand_dataclass_options
def bench_nat(cfg: NatBenchConfig) -> None:
    """The cost of a circuit relay: two replicas on shaped links, direct then one behind NAT (root; report.md)."""
    from hetero_node.bench.nat_relay import render_markdown, run_nat_bench

    run_with_progress(run_nat_bench, render_markdown, cfg)


@lab.command("fuzz-swarm")
@expand_dataclass_options
def bench_fuzz_swarm(cfg: SwarmFuzzConfig) -> None:
    """Send malformed stream messages, RPCs and DHT records from a peer process to a local swarm while it trains;
    count what each entry point did and whether the swarm kept agreeing (report.json and report.md under --out)."""
    from hetero_node.bench.fuzz_swarm import render_markdown, run_swarm_fuzz

    run_with_progress(run_swarm_fuzz, render_markdown, cfg)


@lab.command("rounds")
@expand_dataclass_options
def bench_rounds(cfg: RoundModesConfig) -> None:
    """Compare synchronous, time-boxed and overlapped rounds at equal trained tokens (local demo swarms, seeds)."""
    from hetero_node.bench.round_modes import render_markdown, run_round_modes

    with err_console.status("running the round modes (one local swarm per mode and seed)"):
        report = run_round_modes(cfg)
    print_plain(render_markdown(report))


@lab.command("slow-link")
@expand_dataclass_options
def bench_slow_link(cfg: SlowLinkConfig) -> None:
    """A home volunteer on a 5 Mbit/s, 150 ms link beside three datacenter replicas, against the same swarm with it on
    a datacenter link (needs root): its contribution share and the others' round lengths; report.json and .md."""
    from hetero_node.bench.slow_link import render_markdown, run_slow_link

    run_with_progress(run_slow_link, render_markdown, cfg)


@lab.command("local-ranks")
@expand_dataclass_options
def bench_local_ranks(cfg: LocalRanksConfig) -> None:
    """One node's step on several local devices (`join --devices`) against one process's on the same batches:
    throughput ratio and weight agreement; report.json and report.md under --out."""
    from hetero_node.bench.local_ranks import render_markdown, run_local_ranks

    run_with_progress(run_local_ranks, render_markdown, cfg)


@lab.command("ddp-rank", hidden=True)
@expand_dataclass_options
def ddp_rank(run_options: RunOptions, outer: OuterConfig, optim: OptimConfig, worker: DDPWorkerConfig) -> None:
    """One rank of the benchmark's ddp baseline (`hetero-node-lab bench` starts one per lab node)."""
    from hetero_node.bench.ddp import train
    from hetero_node.client.node.run_definition import prepare_run

    run, store = prepare_run(run_options, outer, optim, SparseLoCoConfig(), PipelineConfig())
    train(run, store, worker)


def main() -> None:
    """The `hetero-node-lab` console script."""
    run(lab)
