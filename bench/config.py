"""The lab commands' options, one config dataclass per `hetero-node-lab` command.

Over ~450 lines on purpose: each class is short and none imports the others' code, and side by side they read as
the lab's one table of knobs (the CLI is generated from them, `client/cli/options.py`).

`BenchConfig` (`hetero-node-lab bench`): every method of one benchmark trains the same preset on the same data for
the same number of tokens per node (rounds × H inner steps of batch_size × seq_len), so the report can compare
them row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetero_node.bench.sim_cadence import SLOW_RULES, SLOW_STEPS
from hetero_node.models.trainer import resolve_device
from hetero_node.protocol.errors import ConfigError, positive_int_list, require_positive
from hetero_node.protocol.run_config import OuterConfig

METHODS = ("ddp", "diloco", "sparseloco", "hetero", "compress-all")
"""ddp: dense fp32 gradient all-reduce every step (torch.distributed, gloo); diloco: every node a full replica,
dense pseudo-gradients every H steps; sparseloco: every node a full replica, SparseLoCo; hetero: every node
with its topology role (the planner's choice under auto), selective activation compression; compress-all: the
same nodes, every replica's activations compressed."""


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark scenario: a topology and the methods to run on it, one after the other."""

    topology: Path = field(
        default=Path("hetero"),
        metadata={
            "help": "Topology TOML file, or a bundled one (bench/topologies/): hetero, hetero-tiny, mixed-speed, "
            "edge-only, uniform, ..."
        },
    )
    methods: str = field(
        default=",".join(METHODS), metadata={"help": f"Comma-separated methods to run: {', '.join(METHODS)}."}
    )
    preset: str = field(default="small", metadata={"help": "Model preset: tiny or small (bigger ones need GPUs)."})
    rounds: int = field(default=3, metadata={"help": "Outer rounds (ddp: evaluations) per method."})
    swarm_rounds: int = field(
        default=0,
        metadata={"help": "Swarm methods: outer rounds, when they get a larger budget than ddp (0: --rounds)."},
    )
    inner_steps: int = field(default=10, metadata={"help": "H: inner steps per round (ddp: steps per evaluation)."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per inner step, per node."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    stages: int = field(default=2, metadata={"help": "Parameter shards / pipeline stages."})
    subspace_rank: int = field(
        default=0, metadata={"help": "hetero and compress-all: activation subspace rank k (0: d_model/8)."}
    )
    lr: float = field(default=2e-3, metadata={"help": "Peak inner learning rate (warm-up: min(50, H) steps)."})
    round_s: float = field(
        default=0.0,
        metadata={"help": "Swarm methods: round length in seconds (0: H steps at the fastest node's speed)."},
    )
    overlap: bool = field(
        default=False, metadata={"help": "Swarm methods: full replicas overlap each round's exchange with training."}
    )
    target_utilisation: float = field(
        default=OuterConfig.target_utilisation,
        metadata={
            "help": "Swarm methods: the run's --target-utilisation (0: rounds of H steps, not stretched; --overlap "
            "stretches by the run's --overlap-utilisation instead, and --round-s fixes the length)."
        },
    )
    aggregation: str = field(
        default="mean",
        metadata={
            "help": "SparseLoCo methods' rule: mean (the lab's nodes are its own processes, as ddp's ranks are) or "
            "robust (a public swarm's default; diloco has the mean rule only)."
        },
    )
    eval_batches: int = field(default=4, metadata={"help": "Validation batches per evaluation."})
    threads_per_node: int = field(
        default=1, metadata={"help": "Torch threads per node process (nodes share this machine's cores)."}
    )
    measure_bandwidth: bool = field(
        default=False,
        metadata={"help": "Let each node probe its link instead of advertising its topology rate (slower)."},
    )
    timeout_s: float = field(default=1800.0, metadata={"help": "Give up on a method's run after this long."})
    stall_timeout_s: float = field(
        default=300.0, metadata={"help": "Give up on a run when no node gets past its furthest round for this long."}
    )
    out: Path | None = field(
        default=None, metadata={"help": "Results directory (default: bench/results/<topology name>)."}
    )
    report_only: bool = field(
        default=False, metadata={"help": "Run nothing: rebuild the report and plots from the raw runs in the results."}
    )

    def __post_init__(self) -> None:
        require_positive(
            self, "rounds", "inner_steps", "batch_size", "seq_len", "stages", "lr", "eval_batches",
            "threads_per_node", "timeout_s", "stall_timeout_s",
        )  # fmt: skip
        if self.swarm_rounds < 0:
            raise ConfigError(f"--swarm-rounds must not be negative, got {self.swarm_rounds}")
        if not self.round_s >= 0:
            raise ConfigError(f"--round-s must be ≥ 0, got {self.round_s}")
        unknown = [m for m in self.method_list if m not in METHODS]
        if unknown or not self.method_list:
            raise ConfigError(f"--methods {self.methods!r}: choose from {', '.join(METHODS)}")
        if self.subspace_rank < 0:
            raise ConfigError(f"--subspace-rank must not be negative, got {self.subspace_rank}")
        OuterConfig(target_utilisation=self.target_utilisation, aggregation=self.aggregation)  # checked before ddp runs

    @property
    def method_list(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.methods.split(",") if m.strip())

    def rounds_for(self, method: str) -> int:
        """Outer rounds (ddp: evaluations of H steps) `method` trains: each method's cosine schedule spans its own
        budget, so a time-to-loss scenario can give the swarm methods more tokens than ddp."""
        return self.rounds if method == "ddp" or not self.swarm_rounds else self.swarm_rounds

    @property
    def warmup_steps(self) -> int:
        """As in the demo: a run as short as a benchmark's must not spend most of its steps warming up."""
        return min(50, self.inner_steps)


@dataclass(frozen=True)
class DDPWorkerConfig:
    """This rank's place in the job; the run options (model, data, H, rounds, optimizer) come separately."""

    rank: int = field(default=0, metadata={"help": "This process's rank; it also picks the data shard."})
    world_size: int = field(default=1, metadata={"help": "Number of ranks."})
    master: str = field(default="127.0.0.1:29500", metadata={"help": "ADDR:PORT of rank 0's rendezvous store."})
    metrics: Path | None = field(default=None, metadata={"help": "Append one JSON line per round to this file."})
    eval_batches: int = field(default=4, metadata={"help": "Validation batches per evaluation."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto."})
    timeout_s: float = field(default=600.0, metadata={"help": "Rendezvous and collective timeout."})

    def __post_init__(self) -> None:
        require_positive(self, "world_size", "eval_batches", "timeout_s")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"--rank {self.rank} is not in 0..{self.world_size - 1}")


@dataclass(frozen=True)
class KillSoakConfig:
    """The fault schedule and the swarm it hits; defaults take about 7 minutes on a 2-core machine."""

    kills: int = field(default=20, metadata={"help": "SIGKILLs of random peers (each restarted at once)."})
    freezes: int = field(default=5, metadata={"help": "SIGSTOP freezes of random peers (SIGCONT after --freeze-s)."})
    freeze_s: float = field(default=8.0, metadata={"help": "How long a frozen peer stays stopped."})
    interval_s: float = field(default=12.0, metadata={"help": "Seconds between two faults."})
    full: int = field(default=3, metadata={"help": "Full replicas."})
    virtual: int = field(default=1, metadata={"help": "Virtual replicas (2 stage peers each)."})
    preset: str = field(default="tiny", metadata={"help": "Model preset."})
    round_s: float = field(default=4.0, metadata={"help": "Round length in seconds."})
    settle_rounds: int = field(default=3, metadata={"help": "Rounds to run after the last fault before stopping."})
    seed: int = field(default=0, metadata={"help": "Seed of the fault schedule (which peer, kill or freeze)."})
    out: Path = field(default=Path("bench/results/kills"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "freeze_s", "interval_s", "round_s", "settle_rounds")
        if min(self.kills, self.freezes, self.full, self.virtual) < 0 or self.full + self.virtual < 2:
            raise ConfigError("--kills, --freezes, --full and --virtual must not be negative; two replicas at least")


ROUND_MODES = ("synchronous", "time-boxed", "overlap")


@dataclass(frozen=True)
class AgreementConfig:
    """The CI shape looped: fresh loopback swarms of full replicas on 2 shards; defaults take about 1 min a run."""

    runs: int = field(default=50, metadata={"help": "Swarms to run one after the other."})
    replicas: int = field(default=4, metadata={"help": "Full replicas per swarm."})
    rounds: int = field(default=4, metadata={"help": "Rounds per swarm."})
    inner_steps: int = field(default=8, metadata={"help": "Inner steps per round (tiny, batch 8 × 64)."})
    out: Path = field(default=Path("bench/results/agreement"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "runs", "rounds", "inner_steps")
        if self.replicas < 2:
            raise ConfigError(f"--replicas must be at least 2, got {self.replicas}")


@dataclass(frozen=True)
class RoundModesConfig:
    """Which round modes to compare, on what swarm, how many seeds each; defaults take about 15 minutes."""

    modes: str = field(default=",".join(ROUND_MODES), metadata={"help": f"Modes: {', '.join(ROUND_MODES)}."})
    seeds: int = field(default=3, metadata={"help": "Runs per mode (seeds 0..N-1 of weights and data order)."})
    preset: str = field(default="tiny", metadata={"help": "Model preset."})
    full: int = field(default=3, metadata={"help": "Full replicas."})
    rounds: int = field(default=8, metadata={"help": "Outer rounds per run."})
    inner_steps: int = field(default=30, metadata={"help": "H."})
    out: Path = field(default=Path("bench/results/round-modes"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "seeds", "full", "rounds", "inner_steps")
        if not self.mode_list or any(m not in ROUND_MODES for m in self.mode_list):
            raise ConfigError(f"--modes {self.modes!r}: choose from {', '.join(ROUND_MODES)}")

    @property
    def mode_list(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.modes.split(",") if m.strip())


@dataclass(frozen=True)
class SlowLinkConfig:
    """The slow-link scenario (`bench/slow_link.py`): two netlab runs of the same swarm; about 10 minutes."""

    preset: str = field(default="small", metadata={"help": "Model preset."})
    rounds: int = field(default=8, metadata={"help": "Outer rounds per run."})
    inner_steps: int = field(default=10, metadata={"help": "H."})
    round_s: float = field(default=20.0, metadata={"help": "Round length in seconds (0: H steps of the fastest)."})
    overlap: bool = field(default=False, metadata={"help": "Full replicas overlap each round's exchange."})
    out: Path = field(default=Path("bench/results/slow-link"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "inner_steps")
        if not self.round_s >= 0:
            raise ConfigError(f"--round-s must be ≥ 0, got {self.round_s}")


BYZANTINE_ATTACKS = (
    "scale", "sign-flip", "heavy-flip", "fixed-top", "concentrate", "zero", "collude", "negate", "blind-negate",
    "dilute", "noise", "hidden-concentrate",
)  # fmt: skip
"""scale: its honest Δ ×100; sign-flip: −Δ (gradient ascent); heavy-flip: −Δ claiming 2⁴⁰× the tokens; fixed-top:
the same coordinates at the top centroid every round; concentrate: the whole norm budget on one row of the head, along
the mean final hidden state (one token's logit up everywhere); zero: an all-zero message; collude: two peers sending
the same fixed-top message; negate: −100× the honest members' mean step, read from their messages before it sends
its own (what serving messages before statements allowed); blind-negate: −100× its own Δ, the most an attacker that
must state its digest before it can read any message (commit, then reveal) can aim at the honest step; dilute: its
Δ × 10⁻³ (it agrees with everyone, so the robust rule's agreement admission counts it, and it adds nothing); noise:
its Δ plus a random step three times as long (it agrees a little and is mostly noise); hidden-concentrate: the
head-row push in the head tensor and its honest Δ in every other one (it agrees overall)."""


@dataclass(frozen=True)
class ByzantineConfig:
    """Which attacks against which aggregation rules, in which groups; one seed of the defaults takes about 35
    minutes on 2 cores (12 rounds: the head-row push broke the old robust rule after its 5th round, and the lab
    once ran 6)."""

    attacks: str = field(default=",".join(BYZANTINE_ATTACKS), metadata={"help": "Comma-separated attacks."})
    rules: str = field(
        default="mean,robust",
        metadata={"help": "Rules to compare: mean, robust; with +loss (mean+loss): loss-scored admission first."},
    )
    honest: str = field(default="4,2", metadata={"help": "Group sizes of honest replicas (one attacker each)."})
    preset: str = field(default="tiny", metadata={"help": "Model preset."})
    rounds: int = field(default=12, metadata={"help": "Outer rounds after the warm start."})
    inner_steps: int = field(default=20, metadata={"help": "H: inner steps per replica per round."})
    warm_steps: int = field(default=150, metadata={"help": "Steps of one replica before the swarm starts from it."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step."})
    seq_len: int = field(default=64, metadata={"help": "Tokens per sequence."})
    eval_batches: int = field(default=4, metadata={"help": "Validation batches per evaluation."})
    seeds: int = field(default=1, metadata={"help": "Runs per cell (seeds 0..N-1 of weights and data order)."})
    out: Path = field(default=Path("bench/results/byzantine"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "inner_steps", "batch_size", "seq_len", "eval_batches", "seeds")
        if self.warm_steps < 0:
            raise ConfigError(f"--warm-steps must not be negative, got {self.warm_steps}")
        if not set(self.attack_list) <= set(BYZANTINE_ATTACKS) or not self.attack_list:
            raise ConfigError(f"--attacks {self.attacks!r}: choose from {', '.join(BYZANTINE_ATTACKS)}")
        if not set(self.rule_list) <= {"mean", "robust", "mean+loss", "robust+loss"} or not self.rule_list:
            raise ConfigError(f"--rules {self.rules!r}: choose from mean, robust, mean+loss, robust+loss")
        try:
            sizes = self.honest_sizes
        except ValueError:
            raise ConfigError(f"--honest {self.honest!r}: comma-separated positive integers") from None
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"--honest {self.honest!r}: comma-separated positive integers")

    @property
    def attack_list(self) -> list[str]:
        return [a for a in self.attacks.split(",") if a]

    @property
    def rule_list(self) -> list[str]:
        return [r for r in self.rules.split(",") if r]

    @property
    def honest_sizes(self) -> list[int]:
        return [int(n) for n in self.honest.split(",") if n]


@dataclass(frozen=True)
class FuzzConfig:
    """How many malformed inputs, from which seed; the default 10⁵ take about 30 s."""

    cases: int = field(default=100_000, metadata={"help": "Inputs in all, split evenly over the entry points."})
    seed: int = field(default=0, metadata={"help": "Seed of the mutations."})
    out: Path = field(default=Path("bench/results/fuzz"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "cases")


POISON_SCENARIOS = ("one-ahead", "far-ahead", "same-round", "claims-honest-fp", "nan-ahead", "nan-claims-honest-fp",
                    "minority-ahead", "tie", "tie-liars-ahead", "record-only-ahead")  # fmt: skip
"""Donors a joiner may load from, beside honest ones at round 5 (`bench/poison.py` has each one's parameters):
one liar a round ahead, at round 10⁶, or at round 5 with other weights (each advertising its own weights'
fingerprint); one at round 5 advertising the honest fingerprint while serving other or NaN weights; one serving NaN a
round ahead; 2 liars sharing a fingerprint a round ahead of 3 honest; 2 liars against 2 honest at round 5 or 6; one
liar a round ahead backed by 3 ids with a signed record and no running node."""


@dataclass(frozen=True)
class PoisonConfig:
    """How many independent trials of which poisoned-state scenarios; 5 of each take about 14 min on 2 cores, most
    of it starting peers."""

    trials: int = field(default=5, metadata={"help": "Trials per scenario, each on fresh peers."})
    scenarios: str = field(
        default=",".join(POISON_SCENARIOS),
        metadata={"help": f"Comma-separated scenarios: {', '.join(POISON_SCENARIOS)}."},
    )
    wait_s: float = field(
        default=10.0, metadata={"help": "How long the joiner's loader looks for a donor it can trust before giving up."}
    )
    out: Path = field(default=Path("bench/results/poison"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "trials", "wait_s")
        if not self.scenario_list or not set(self.scenario_list) <= set(POISON_SCENARIOS):
            raise ConfigError(f"--scenarios {self.scenarios!r}: choose from {', '.join(POISON_SCENARIOS)}")

    @property
    def scenario_list(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.scenarios.split(",") if s.strip())


ADMISSION_RULES = ("mean", "robust", "mean+loss", "robust+loss")
ADMISSION_ATTACKS = ("none", "negate")


@dataclass(frozen=True)
class AdmissionConfig:
    """Which (attack, rule) cells of real swarms to run (`bench/admission.py`): 2 honest full replicas, with or
    without a negating one, on loopback; each cell about 40 s on 2 cores."""

    cells: str = field(
        default="none:mean,negate:mean,none:robust,negate:robust,none:mean+loss,negate:mean+loss",
        metadata={
            "help": f"Comma-separated attack:rule cells; attacks {', '.join(ADMISSION_ATTACKS)}, rules "
            f"{', '.join(ADMISSION_RULES)} (+loss: --admission loss)."
        },
    )
    rounds: int = field(default=8, metadata={"help": "Outer rounds per swarm."})
    inner_steps: int = field(default=8, metadata={"help": "H: every replica trains exactly this many steps a round."})
    out: Path = field(default=Path("bench/results/admission"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "inner_steps")
        pairs = [c.split(":") for c in self.cell_list]
        if not pairs or any(len(p) != 2 or p[0] not in ADMISSION_ATTACKS or p[1] not in ADMISSION_RULES for p in pairs):
            raise ConfigError(f"--cells {self.cells!r}: give attack:rule pairs, e.g. negate:mean+loss")

    @property
    def cell_list(self) -> tuple[str, ...]:
        return tuple(c.strip() for c in self.cells.split(",") if c.strip())


@dataclass(frozen=True)
class SybilConfig:
    """How many record-only identities flood the run's records (`bench/sybil.py`); in one process, seconds."""

    floods: str = field(
        default="4097,100000", metadata={"help": "Comma-separated numbers of Sybil records, one flood each."}
    )
    out: Path = field(default=Path("bench/results/sybil"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        try:
            sizes = self.flood_sizes
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"--floods {self.floods!r}: give positive whole numbers, e.g. 4097,100000")

    @property
    def flood_sizes(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.floods.split(",") if s.strip())


@dataclass(frozen=True)
class SwarmFuzzConfig:
    """How many malformed inputs a peer process sends a training swarm (streams, RPCs and DHT records)."""

    cases: int = field(default=100_000, metadata={"help": "Inputs in all (stream handlers, RPCs and DHT records)."})
    dht_cases: int = field(default=4_000, metadata={"help": "Of those, records stored in the DHT."})
    calm_rounds: int = field(default=3, metadata={"help": "Rounds watched before fuzzing, to compare with."})
    round_s: float = field(default=4.0, metadata={"help": "The swarm's round length in seconds."})
    seed: int = field(default=0, metadata={"help": "Seed of the inputs."})
    out: Path = field(default=Path("bench/results/fuzz-swarm"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "cases", "calm_rounds", "round_s")
        if not 0 <= self.dht_cases <= self.cases:
            raise ConfigError(f"--dht-cases must be in [0, --cases], got {self.dht_cases}")


@dataclass(frozen=True)
class SoakConfig:
    """How long, with how many replicas, on what links; the default hour on 50 Mbit/s links is the issue's soak
    (`--minutes 3` for a quick look, `--link-mbit 0` for loopback where network namespaces are missing)."""

    minutes: float = field(default=60.0, metadata={"help": "How long the swarm runs."})
    warmup_minutes: float = field(default=5.0, metadata={"help": "Growth is measured from this minute on."})
    sample_s: float = field(default=30.0, metadata={"help": "Seconds between two samples of every peer."})
    full: int = field(default=3, metadata={"help": "Full replicas."})
    virtual: int = field(default=1, metadata={"help": "Virtual replicas (2 stage peers each)."})
    link_mbit: float = field(
        default=50.0, metadata={"help": "Every peer's up and down link in Mbit/s (tc tbf, root); 0: loopback."}
    )
    preset: str = field(default="tiny", metadata={"help": "Model preset."})
    round_s: float = field(default=4.0, metadata={"help": "Round length in seconds."})
    out: Path = field(default=Path("bench/results/soak"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "minutes", "sample_s", "full", "round_s")
        if self.virtual < 0 or self.link_mbit < 0:
            raise ConfigError(f"--virtual and --link-mbit must not be negative, got {self.virtual}, {self.link_mbit}")
        if not 0 <= self.warmup_minutes < self.minutes:
            raise ConfigError(f"--warmup-minutes must be in [0, --minutes), got {self.warmup_minutes}")


@dataclass(frozen=True)
class NatBenchConfig:
    """The relay's cost: two full replicas, the second public then behind NAT, on shaped links (root)."""

    preset: str = field(default="small", metadata={"help": "Model preset."})
    rounds: int = field(default=6, metadata={"help": "Outer rounds per scenario."})
    round_s: float = field(default=8.0, metadata={"help": "Round length in seconds."})
    link_mbit: float = field(default=20.0, metadata={"help": "Every node's up and down link in Mbit/s (tc tbf)."})
    out: Path = field(default=Path("bench/results/nat"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "round_s", "link_mbit")


SIM_METHODS = ("ddp", "diloco", "sparseloco", "hetero", "compress-all", "none")
"""ddp: one gradient step on every replica's batch (dense all-reduce every step); diloco and sparseloco: every
replica a full one; hetero: half the replicas full, half virtual with subspace boundaries; compress-all: every
replica virtual with subspace boundaries; none: hetero's layout with dense boundaries (no activation compression)."""
SUBSPACE_METHODS = ("hetero", "compress-all")


@dataclass(frozen=True)
class SimConfig:
    """`hetero-node-lab sim`: the algorithm lab's grid (every list is swept) and its token budget; defaults are the
    README's findings on `tiny` (about 1 h on 2 cores; `--seeds 1 --rounds 4` for a quick look)."""

    methods: str = field(default=",".join(SIM_METHODS), metadata={"help": f"Methods: {', '.join(SIM_METHODS)}."})
    preset: str = field(default="tiny", metadata={"help": "Model preset (tiny for sweeps, small for the findings)."})
    replicas: str = field(default="4", metadata={"help": "Replica counts to sweep (hetero/none: half full, half VR)."})
    rank_divisors: str = field(
        default="8,16,32,64", metadata={"help": "hetero/compress-all: subspace ranks as d_model/N."}
    )
    inner_steps: str = field(default="20", metadata={"help": "H values to sweep (ddp: steps per evaluation)."})
    topk: str = field(default="64", metadata={"help": "SparseLoCo entries kept per 64×64 chunk, values to sweep."})
    rounds: int = field(default=20, metadata={"help": "Outer rounds per run."})
    max_contributors: str = field(
        default="0", metadata={"help": "K values to sweep: messages a round aggregates at most (0: every replica's)."}
    )
    slow_replicas: int = field(
        default=0, metadata={"help": "Replicas (the last ones) that train 1/--slow-factor as fast as the others."}
    )
    slow_factor: int = field(default=4, metadata={"help": "How many times slower a slow replica is (divides H)."})
    slow_windows: str = field(
        default="1",
        metadata={"help": "Slow replicas contribute once per N rounds, values to sweep (1: every round what it "
                          "trained in it; N > 1: N·H/F steps from θ N − 1 outer steps old; 0: they sit out)."},
    )  # fmt: skip
    slow_rules: str = field(
        default="plain", metadata={"help": f"How contributions are scaled, to sweep: {', '.join(SLOW_RULES)}."}
    )
    accumulation: int = field(
        default=1, metadata={"help": "Batches per inner step of the fast replicas: a round stretched for them."}
    )
    slow_steps: str = field(
        default="fewer",
        metadata={"help": "How slow replicas fill a stretched round, to sweep: fewer (H/F steps of --accumulation "
                          "batches) or smaller (H steps of --accumulation/F batches)."},
    )  # fmt: skip
    stages: int = field(default=2, metadata={"help": "Parameter shards = pipeline stages of a virtual replica."})
    microbatches: int = field(default=2, metadata={"help": "Microbatches per inner step in a virtual replica."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step, per replica."})
    seq_len: int = field(default=64, metadata={"help": "Tokens per sequence."})
    lr: float = field(default=3e-3, metadata={"help": "Peak inner learning rate."})
    warmup_steps: int = field(default=20, metadata={"help": "Inner LR warm-up steps."})
    eval_batches: int = field(default=8, metadata={"help": "Validation batches per evaluation (after every round)."})
    seeds: int = field(default=3, metadata={"help": "Runs per cell (seeds 0..N-1 of weights and data order)."})
    device: str = field(
        default="cpu", metadata={"help": "Where replicas train: cpu, cuda, cuda:N or auto (bf16 autocast on CUDA)."}
    )
    jobs: int = field(
        default=1, metadata={"help": "Runs at a time, each in its own process (e.g. one per core on a GPU machine)."}
    )
    out: Path = field(default=Path("bench/results/sim"), metadata={"help": "Results directory."})
    report_only: bool = field(
        default=False, metadata={"help": "Rebuild report.md and the plots from --out's report.json; run nothing."}
    )

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "stages", "microbatches", "batch_size", "seq_len", "lr", "eval_batches",
                         "seeds", "jobs", "accumulation")  # fmt: skip
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must not be negative, got {self.warmup_steps}")
        if not set(self.method_list) <= set(SIM_METHODS) or not self.method_list:
            raise ConfigError(f"--methods {self.methods!r}: choose from {', '.join(SIM_METHODS)}")
        if min(self.replica_counts) < 2:
            raise ConfigError(f"--replicas {self.replicas!r}: at least 2 (one full and one virtual in hetero)")
        resolve_device(self.device)  # a wrong --device fails here, not after the corpus is loaded
        self._check_slow()
        for flag, values in (("--rank-divisors", self.rank_list), ("--inner-steps", self.h_list),
                             ("--topk", self.topk_list), ("--max-contributors", self.contributor_list),
                             ("--slow-windows", self.window_list)):  # fmt: skip
            if not values:
                raise ConfigError(f"{flag} must not be empty")

    def _check_slow(self) -> None:
        if self.slow_replicas < 0 or self.slow_replicas >= min(self.replica_counts):
            raise ConfigError(f"--slow-replicas must be ≥ 0 and leave one replica fast, got {self.slow_replicas}")
        if self.slow_factor < 1 or (self.slow_replicas and any(h % self.slow_factor for h in self.h_list)):
            raise ConfigError(f"--slow-factor {self.slow_factor} must be ≥ 1 and divide every --inner-steps")
        if not self.slow_rule_list or not set(self.slow_rule_list) <= set(SLOW_RULES):
            raise ConfigError(f"--slow-rules {self.slow_rules!r}: choose from {', '.join(SLOW_RULES)}")
        if not self.slow_steps_list or not set(self.slow_steps_list) <= set(SLOW_STEPS):
            raise ConfigError(f"--slow-steps {self.slow_steps!r}: choose from {', '.join(SLOW_STEPS)}")

    @property
    def window_list(self) -> list[int]:
        return _non_negative_ints(self.slow_windows, "--slow-windows")

    @property
    def slow_rule_list(self) -> list[str]:
        return [r.strip() for r in self.slow_rules.split(",") if r.strip()]

    @property
    def slow_steps_list(self) -> list[str]:
        return [r.strip() for r in self.slow_steps.split(",") if r.strip()]

    @property
    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]

    @property
    def replica_counts(self) -> list[int]:
        return positive_int_list(self.replicas, "--replicas")

    @property
    def rank_list(self) -> list[int]:
        return positive_int_list(self.rank_divisors, "--rank-divisors")

    @property
    def h_list(self) -> list[int]:
        return positive_int_list(self.inner_steps, "--inner-steps")

    @property
    def topk_list(self) -> list[int]:
        return positive_int_list(self.topk, "--topk")

    @property
    def contributor_list(self) -> list[int]:
        """K values; 0 (every replica's message) is allowed here, unlike in the other lists."""
        return _non_negative_ints(self.max_contributors, "--max-contributors")


def _non_negative_ints(text: str, flag: str) -> list[int]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or not all(v.isdigit() for v in values):
        raise ConfigError(f"{flag} {text!r}: comma-separated integers ≥ 0")
    return [int(v) for v in values]


@dataclass(frozen=True)
class PlanScalingConfig:
    """`hetero-node-lab plan-scaling`: the cost model's weak scaling over swarm sizes drawn from one swarm file."""

    swarm: Path = field(
        default=Path("bench/swarms/volunteers-1000.toml"), metadata={"help": "Swarm file (its first N nodes per size)."}
    )
    sizes: str = field(default="10,30,100,300,1000", metadata={"help": "Swarm sizes to plan, comma-separated."})
    preset: str = field(default="1b", metadata={"help": "Model preset."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per inner step, per replica."})
    seq_len: int = field(default=1024, metadata={"help": "Tokens per sequence."})
    stages: int = field(default=4, metadata={"help": "Pipeline stages of a virtual replica."})
    microbatches: int = field(default=4, metadata={"help": "Microbatches per inner step in a pipeline."})
    inner_steps: int = field(default=30, metadata={"help": "The run's H (the planner may choose another)."})
    h_choices: str = field(default="10,20,30,50,100", metadata={"help": "H values the planner may choose from."})
    out: Path = field(default=Path("bench/results/plan-scaling"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "batch_size", "seq_len", "stages", "microbatches", "inner_steps")
        positive_int_list(self.sizes, "--sizes")  # a bad list fails here, before any work
        positive_int_list(self.h_choices, "--h-choices")

    @property
    def size_list(self) -> list[int]:
        return positive_int_list(self.sizes, "--sizes")


@dataclass(frozen=True)
class ExchangeScalingConfig:
    """`hetero-node-lab exchange`: loopback swarms of full replicas of `tiny`, one per size."""

    replicas: str = field(default="2,4,8,16", metadata={"help": "Swarm sizes (full replicas), comma-separated."})
    rounds: int = field(default=3, metadata={"help": "Outer rounds per swarm."})
    inner_steps: int = field(default=5, metadata={"help": "H."})
    round_s_per_replica: float = field(
        default=2.5,
        metadata={"help": "Round length per replica, in s (R processes share this machine's cores; 0: H steps)."},
    )
    max_contributors: int = field(
        default=4, metadata={"help": "K of every swarm (the run's --max-contributors; 0: every member's message)."}
    )
    out: Path = field(default=Path("bench/results/exchange-scaling"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "rounds", "inner_steps")
        if self.round_s_per_replica < 0:
            raise ConfigError(f"--round-s-per-replica must not be negative, got {self.round_s_per_replica}")
        if self.max_contributors < 0:
            raise ConfigError(f"--max-contributors must be ≥ 0, got {self.max_contributors}")
        positive_int_list(self.replicas, "--replicas")  # a bad list fails here, before any work


@dataclass(frozen=True)
class LocalRanksConfig:
    """One node's step on several local devices against one process's on all the batches; defaults (two CPU ranks,
    tiny) take under a minute."""

    devices: str = field(default="cpu,cpu", metadata={"help": "The node's devices, as `join --devices` takes them."})
    preset: str = field(default="tiny", metadata={"help": "Model preset."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per batch (each rank trains one per step)."})
    seq_len: int = field(default=64, metadata={"help": "Tokens per sequence."})
    steps: int = field(default=20, metadata={"help": "Timed inner steps of each, after one untimed."})
    out: Path = field(default=Path("bench/results/local-ranks"), metadata={"help": "Results directory."})

    def __post_init__(self) -> None:
        require_positive(self, "batch_size", "seq_len", "steps")
