"""`python -m hetero_node.bench.gpu_check`: what this code gets out of one GPU, and whether a swarm on it agrees.

Three parts, written to `--out`/gpu_check.json (after each) and printed as tables:

* **throughput**: the inner step (`InnerTrainer.train_step`, the one every replica runs) per preset at the shapes of
  issue 28 (178m at 32 × 1024, 1b at 8 × 1024), compiled and eager: tokens/s and MFU on random tokens of the
  preset's vocabulary. MFU counts 6 FLOPs per matmul weight and token plus attention's 12·L·d·T (PaLM's
  convention), over the GPU's dense bf16 peak.
* **outer work**: what one member's outer step costs per shard of the swarm's preset (issue 28: at most 0.3 s per
  shard of 178m): encoding Δ, decoding and combining 4 messages, the outer step, the fingerprint of θ(t+1).
* **swarm**: `hetero-node demo` on one GPU (2 full replicas and one 2-stage virtual replica, every peer a real
  process), with and without `--overlap`. It must agree every round (one fingerprint per shard), every peer must
  contribute to every round, and no peer may fail; each full replica's compute utilisation and
  every round's time split (compute, exchange, blocked waiting, overhead) come from the peers' round records.

It downloads nothing: the swarm trains on the bundled corpus already in the cache (`make gpu-wheels` copies it
into .cache/hetero-node). `--device cpu --presets tiny --swarm-preset tiny` with small shapes runs every code path
on a CPU (tests/test_gpu_check.py). The process exits with status 1 when any figure is missing or a check fails.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from hetero_node.client.cli.demo import DemoConfig, compute_utilisation, run_demo
from hetero_node.client.cli.options import expand_dataclass_options
from hetero_node.models.config import ModelConfig, get_preset
from hetero_node.protocol.errors import ConfigError, require_positive
from hetero_node.protocol.run_config import OuterConfig

logger = logging.getLogger(__name__)

GPU_SHAPES: dict[str, tuple[int, int]] = {
    "tiny": (32, 128),
    "small": (32, 256),
    "178m": (32, 1024),
    "560m": (16, 1024),
    "1b": (8, 1024),
}
"""(batch size, sequence length) per preset on a GPU: issue 28's shapes for 178m and 1b."""
OVERLAP_MODES = {"off": False, "on": True}
CPU_SHAPE = (4, 64)
"""Every preset's shape on a CPU: a smoke test of the code paths, not a measurement."""
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0))
"""Dense bf16 tensor-core peaks by (a part of) the device name, most specific first."""


@dataclass(frozen=True)
class GpuCheckConfig:
    """What to measure; the defaults are the check `make gpu-check` runs (about 8.5 min on an H200)."""

    device: str = field(default="cuda", metadata={"help": "cuda, cuda:N, or cpu (a smoke test of the code paths)."})
    presets: str = field(
        default="178m", metadata={"help": "Presets to time, comma-separated (1b: 2 min more on an H200)."}
    )
    steps: int = field(default=10, metadata={"help": "Timed inner steps per preset and mode."})
    warmup_steps: int = field(default=3, metadata={"help": "Untimed steps first (after compiling)."})
    peak_tflops: float = field(
        default=0.0, metadata={"help": "The device's dense bf16 peak (0: from the GPU's name; unknown: no MFU)."}
    )
    swarm: bool = field(default=True, metadata={"help": "Also run the demo swarm, with and without --overlap."})
    overlap_modes: str = field(
        default="off,on",
        metadata={"help": "The swarm's runs, comma-separated: off (without --overlap), on (with it); one fits a call."},
    )
    swarm_preset: str = field(default="178m", metadata={"help": "The swarm's model preset."})
    rounds: int = field(default=4, metadata={"help": "The swarm's outer rounds."})
    inner_steps: int = field(
        default=OuterConfig.inner_steps, metadata={"help": "The swarm's H (the run's default: issue 28's targets are "
                                                   "at default options)."}
    )  # fmt: skip
    swarm_batch_size: int = field(default=8, metadata={"help": "The swarm's sequences per inner step."})
    swarm_seq_len: int = field(default=1024, metadata={"help": "The swarm's tokens per sequence."})
    out: Path = field(default=Path("bench/results/gpu-check"), metadata={"help": "Writes gpu_check.json here."})

    def __post_init__(self) -> None:
        require_positive(self, "steps", "rounds", "inner_steps", "swarm_batch_size", "swarm_seq_len")
        if self.warmup_steps < 0 or self.peak_tflops < 0:
            raise ConfigError("--warmup-steps and --peak-tflops must not be negative")
        for name in (*self.preset_list, self.swarm_preset):
            get_preset(name)  # a typo fails now, not after minutes of measuring
        if not self.overlap_list or any(m not in OVERLAP_MODES for m in self.overlap_modes.split(",")):
            raise ConfigError(f"--overlap-modes takes off and/or on, comma-separated; got {self.overlap_modes!r}")

    @property
    def preset_list(self) -> list[str]:
        return [p.strip() for p in self.presets.split(",") if p.strip()]

    @property
    def overlap_list(self) -> list[bool]:
        return [OVERLAP_MODES[m] for m in self.overlap_modes.split(",") if m in OVERLAP_MODES]


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward and backward FLOPs per trained token: 6 per matmul weight (the input embedding is a lookup, the
    norms are not matmuls) plus 12·L·d·T for attention's scores and weighted sum."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    return 6.0 * (cfg.n_params() - lookup - norms) + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def peak_flops(device: Any, override_tflops: float) -> float | None:
    """The device's dense bf16 FLOP/s: the override, else looked up by GPU name (None: unknown, e.g. a CPU)."""
    import torch

    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for part, tflops in PEAK_BF16_TFLOPS if part in name), None)


def measure_step(cfg: GpuCheckConfig, preset: str, compile: bool, device: Any, peak: float | None) -> dict[str, Any]:
    """Time `cfg.steps` inner steps of `preset` after compiling and warming up; a failure is a figure too."""
    import torch

    from hetero_node.models.trainer import InnerTrainer
    from hetero_node.models.transformer import Transformer
    from hetero_node.protocol.run_config import OptimConfig

    batch, seq = GPU_SHAPES.get(preset, CPU_SHAPE) if device.type == "cuda" else CPU_SHAPE
    model_cfg = get_preset(preset, max_seq_len=max(seq, get_preset(preset).max_seq_len))
    figure: dict[str, Any] = {"preset": preset, "compile": compile, "batch_size": batch, "seq_len": seq}
    model = trainer = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = Transformer(model_cfg, seed=0).to(device)
        trainer = InnerTrainer(model, OptimConfig(), cfg.warmup_steps + cfg.steps, device, compile=compile)
        generator = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=generator) for _ in range(2))
        started = time.perf_counter()
        trainer.warm_up(x, y)
        figure["compile_s"] = round(time.perf_counter() - started, 2)
        for _ in range(cfg.warmup_steps):
            trainer.train_step(x, y)
        trainer.synchronize()
        started = time.perf_counter()
        for _ in range(cfg.steps):
            loss = trainer.train_step(x, y)
        trainer.synchronize()
        seconds = time.perf_counter() - started
        tokens_per_s = cfg.steps * batch * seq / seconds
        figure.update(
            compiled=trainer.compiled,
            step_ms=round(1000 * seconds / cfg.steps, 2),
            tokens_per_s=round(tokens_per_s, 1),
            mfu=None if peak is None else round(tokens_per_s * training_flops_per_token(model_cfg, seq) / peak, 4),
            loss=float(loss),
            peak_memory_gb=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        )
    except Exception as e:  # an OOM or a compile that broke: recorded, and the check fails at the end
        logger.exception("%s (compile %s) failed", preset, compile)
        figure["error"] = f"{type(e).__name__}: {e}"
    finally:
        model = trainer = None  # freed before the cache is emptied
        gc.collect()
        torch._dynamo.reset()  # the next preset compiles afresh instead of counting against the recompile limit
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return figure


OUTER_MEMBERS = 4
"""Messages a member's outer step combines in the outer-work part: the 178m demo swarm's round (2 full replicas and
a virtual replica: 3), and one more."""


def measure_outer_work(cfg: GpuCheckConfig, device: Any) -> list[dict[str, Any]]:
    """What a member's outer work costs per shard of the swarm's preset on this device (issue 28: at most 0.3 s per
    shard for 178m): encoding Δ (error feedback, top-k, 2-bit values, into bytes), decoding and combining
    `OUTER_MEMBERS` members' messages, the outer step, and the fingerprint of θ(t+1); the best of three rounds
    (the first also warms the kernels up)."""
    import torch

    from hetero_node.models.shards import shard_parameter_names, shard_tensors
    from hetero_node.models.transformer import Transformer
    from hetero_node.protocol.outer_methods import outer_method
    from hetero_node.protocol.run_config import OuterConfig, RunConfig

    model_cfg = get_preset(cfg.swarm_preset)
    stages = OuterConfig.stages
    run = RunConfig(cfg.swarm_preset, model_cfg.vocab_size, cfg.swarm_batch_size, cfg.swarm_seq_len, 0, 1, "", "",
                    OuterConfig(stages=stages, inner_steps=cfg.inner_steps))  # fmt: skip
    model = Transformer(model_cfg, seed=0).to(device)
    figures = []
    for shard, names in enumerate(shard_parameter_names(model_cfg, stages)):
        start = [p.detach() for p in shard_tensors(model, names)]
        shapes = [tuple(p.shape) for p in start]
        members = [outer_method(run, shapes, device) for _ in range(OUTER_MEMBERS)]
        generator = torch.Generator(device=device).manual_seed(shard)
        best: dict[str, float] = {}
        for _ in range(3):
            deltas = [[1e-3 * torch.randn(p.shape, device=device, generator=generator) for p in start]
                      for _ in members]  # fmt: skip
            times = _outer_round(members, start, deltas, device)
            best = {k: min(v, best.get(k, v)) for k, v in times.items()}
        figure = {f"{phase}_s": round(seconds, 4) for phase, seconds in best.items()}
        figures.append({"shard": shard, "parameters": sum(p.numel() for p in start), "members": OUTER_MEMBERS,
                        **figure, "total_s": round(sum(best.values()), 4)})  # fmt: skip
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def _outer_round(members: list[Any], start: list[Any], deltas: list[list[Any]], device: Any) -> dict[str, float]:
    """One round's outer work as member 0 does it, every member's message encoded (timed per member); seconds per
    phase, each phase's device work waited for."""
    from hetero_node.models.shards import fingerprint

    clock = _PhaseClock(device)
    payloads = [m.encode(d).payload for m, d in zip(members, deltas, strict=True)]
    clock.mark("encode", per=len(members))
    decoded = [members[0].decode(p) for p in payloads]
    clock.mark("decode")
    names = [str(i) for i in range(len(decoded))]
    combined = members[0].combine(decoded, [1.0] * len(names), names)
    clock.mark("combine")
    new = members[0].update(start, combined)
    clock.mark("update")
    fingerprint(new)
    clock.mark("fingerprint")
    return clock.times


class _PhaseClock:
    """Seconds between marks, the device's queued work waited for at each."""

    def __init__(self, device: Any) -> None:
        self.device, self.times = device, {}
        self._last = time.perf_counter()

    def mark(self, phase: str, per: int = 1) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[phase], self._last = (now - self._last) / per, now


def throughput_problems(figures: list[dict[str, Any]]) -> list[str]:
    """What makes the throughput part fail: an error, a missing or non-finite figure, an MFU outside (0, 1)."""
    problems = []
    for f in figures:
        name = f"{f['preset']} compile={f['compile']}"
        if "error" in f:
            problems.append(f"{name}: {f['error']}")
        elif not (f["tokens_per_s"] > 0 and f["loss"] == f["loss"] and f["loss"] < 100):
            problems.append(f"{name}: tokens/s {f['tokens_per_s']}, loss {f['loss']}")
        elif f["mfu"] is not None and not 0 < f["mfu"] < 1:
            problems.append(f"{name}: MFU {f['mfu']} is not a fraction")
    return problems


def round_split(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where each round's time went for one replica: training, exchange, training blocked on the exchange, and
    everything else between two trainings; `wall_s` is the time since the previous round's training ended."""
    split, previous = [], None
    for r in sorted(rounds, key=lambda r: r["round"]):
        ended = r.get("trained_at") or None
        wall = ended - previous if ended and previous else None
        split.append(
            {
                "round": r["round"],
                "inner_steps": r["inner_steps"],
                "compute_s": r["compute_s"],
                "comm_s": r["comm_s"],
                "wait_s": r.get("wait_s", 0.0),
                "overhead_s": r.get("overhead_s", 0.0),
                "phases_s": r.get("phases_s", {}),
                "wall_s": None if wall is None else round(wall, 3),
                "contributed": r["contributed"],
            }
        )
        previous = ended
    return split


def swarm_problems(report: dict[str, Any], rounds: int) -> list[str]:
    """What makes a swarm run fail: a failed peer, a round missing or disagreeing, a peer that did not contribute to
    a round (the first included: every peer waits for the others to have built their model, and the founding
    members for each other's statements)."""
    summary = report["summary"]
    problems = [f"peer failed: {name}" for name in summary["failed_peers"]]
    if summary["rounds"] != rounds or summary["rounds_with_agreeing_fingerprints"] != rounds:
        problems.append(f"{summary['rounds_with_agreeing_fingerprints']} of {rounds} rounds agree")
    for peer in report["peers"]:
        missed = sorted(set(range(rounds)) - {r["round"] for r in peer["rounds"] if r["contributed"]})
        if missed:
            problems.append(f"{peer['role']} {peer['peer_id'][-8:]} did not contribute to rounds {missed}")
    return problems


def steady_utilisation(rounds: list[dict[str, Any]]) -> float | None:
    """Compute utilisation over the later half of the rounds: the first ones are sized from overheads still being
    measured (round 0 is untimed, round 1 knows one round's cost), so a short run's whole-run figure is mostly
    ramp-up."""
    ordered = sorted(rounds, key=lambda r: r["round"])
    return compute_utilisation(ordered[len(ordered) // 2 :])


def run_swarm(cfg: GpuCheckConfig, overlap: bool, console: Console) -> dict[str, Any]:
    """One demo swarm on this machine; its report reduced to the check's figures."""
    name = "swarm-overlap" if overlap else "swarm"
    demo = DemoConfig(
        preset=cfg.swarm_preset,
        rounds=cfg.rounds,
        inner_steps=cfg.inner_steps,
        batch_size=cfg.swarm_batch_size,
        seq_len=cfg.swarm_seq_len,
        overlap=overlap,
        workdir=cfg.out / name,
        report=cfg.out / f"{name}-report.json",
    )
    report = run_demo(demo, console)
    full = [p for p in report["peers"] if p["role"] == "full"]
    return {
        "overlap": overlap,
        "wall_s": round(report["summary"]["wall_s"], 1),
        "rounds_with_agreeing_fingerprints": report["summary"]["rounds_with_agreeing_fingerprints"],
        "replicas": [
            {
                "peer_id": p["peer_id"],
                "utilisation": compute_utilisation(p["rounds"]),
                "steady_utilisation": steady_utilisation(p["rounds"]),
                "rounds": round_split(p["rounds"]),
            }
            for p in full
        ],
        "problems": swarm_problems(report, cfg.rounds),
    }


def _throughput_table(figures: list[dict[str, Any]]) -> Table:
    table = Table(title="inner step (InnerTrainer.train_step)")
    for column in ("preset", "shape", "compile", "tokens/s", "MFU", "step ms", "compile s", "peak GiB", "note"):
        table.add_column(column)
    for f in figures:
        shape = f"{f['batch_size']}×{f['seq_len']}"
        if "error" in f:
            table.add_row(f["preset"], shape, str(f["compile"]), "", "", "", "", "", f["error"][:60])
            continue
        table.add_row(
            f["preset"],
            shape,
            str(f["compile"]),
            f"{f['tokens_per_s']:,.0f}",
            "-" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%",
            f"{f['step_ms']:.1f}",
            f"{f['compile_s']:.1f}",
            "-" if f["peak_memory_gb"] is None else f"{f['peak_memory_gb']:.1f}",
            "" if f["compiled"] == f["compile"] else "compile failed: eager",
        )
    return table


def _outer_work_table(figures: list[dict[str, Any]], preset: str) -> Table:
    table = Table(title=f"outer work per shard of {preset} (one member's, seconds; {OUTER_MEMBERS} messages combined)")
    phases = ("encode", "decode", "combine", "update", "fingerprint", "total")
    for column in ("shard", "parameters", *phases):
        table.add_column(column)
    for f in figures:
        table.add_row(str(f["shard"]), f"{f['parameters']:,}", *(f"{f[f'{phase}_s']:.3f}" for phase in phases))
    return table


def _swarm_table(swarm: dict[str, Any]) -> Table:
    table = Table(title=f"swarm {'with' if swarm['overlap'] else 'without'} --overlap: full replicas' rounds")
    for column in ("replica", "utilisation: all, later half", "round", "steps", "compute s", "exchange s", "blocked s",
                   "overhead s", "round wall s", "contributed", "phases s"):  # fmt: skip
        table.add_column(column)
    for replica in swarm["replicas"]:
        util = " ".join(
            "-" if replica[k] is None else f"{100 * replica[k]:.1f}%" for k in ("utilisation", "steady_utilisation")
        )
        for r in replica["rounds"]:
            table.add_row(
                replica["peer_id"][-8:], util, str(r["round"]), str(r["inner_steps"]), f"{r['compute_s']:.2f}",
                f"{r['comm_s']:.2f}", f"{r['wait_s']:.2f}", f"{r['overhead_s']:.2f}",
                "-" if r["wall_s"] is None else f"{r['wall_s']:.2f}", str(r["contributed"]),
                " ".join(f"{phase} {seconds:.2f}" for phase, seconds in r["phases_s"].items()),
            )  # fmt: skip
            util = ""
    return table


def run_gpu_check(cfg: GpuCheckConfig, console: Console) -> dict[str, Any]:
    """Both parts; returns (and writes) the figures, `ok` False when any check failed."""
    import torch

    from hetero_node.models.trainer import resolve_device

    device = resolve_device(cfg.device)
    peak = peak_flops(device, cfg.peak_tflops)
    started = time.monotonic()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "peak_tflops": None if peak is None else peak / 1e12,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "throughput": [],
        "swarm": [],
    }
    with console.status("timing inner steps") as status:
        for preset in cfg.preset_list:
            for compile in (True, False):
                status.update(f"timing {preset}, compile {compile}")
                result["throughput"].append(measure_step(cfg, preset, compile, device, peak))
    console.print(_throughput_table(result["throughput"]))
    problems = throughput_problems(result["throughput"])
    result["throughput_s"] = round(time.monotonic() - started, 1)
    with console.status(f"timing the outer work of {cfg.swarm_preset}'s shards"):
        result["outer_work"] = measure_outer_work(cfg, device)
    console.print(_outer_work_table(result["outer_work"], cfg.swarm_preset))
    problems += [f"outer work of shard {f['shard']}: {f}" for f in result["outer_work"] if not f["total_s"] > 0]
    _write(cfg.out, result)  # each part as it ends: a device call cut short keeps what it measured
    if cfg.swarm:
        if device.type == "cpu":  # the peers pick their device themselves (auto): keep them off any GPU too
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        for overlap in cfg.overlap_list:
            swarm = run_swarm(cfg, overlap, console)
            console.print(_swarm_table(swarm))
            result["swarm"].append(swarm)
            problems += [f"swarm overlap={overlap}: {p}" for p in swarm["problems"]]
            _write(cfg.out, result)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["problems"], result["ok"] = problems, not problems
    _write(cfg.out, result)
    return result


def _write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")


app = typer.Typer(add_completion=False)


@app.command()
@expand_dataclass_options
def main(cfg: GpuCheckConfig) -> None:
    """Tokens/s and MFU per preset, then the demo swarm's agreement and utilisation on this GPU."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    result = run_gpu_check(cfg, console)
    console.print(f"figures: {cfg.out / 'gpu_check.json'} ({result['wall_s']:.0f} s)")
    for problem in result["problems"]:
        console.print(f"[red]FAILED[/] {problem}")
    if not result["ok"]:
        raise typer.Exit(1)
    console.print("[green]gpu check passed[/]")


if __name__ == "__main__":
    app()
