"""The algorithm lab (`hetero-node-lab sim`): a lab round is a swarm round, the same seed gives the same report, and
the report's arithmetic (mean ± std, when a curve reaches another, the findings' gaps) on synthetic runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from rich.progress import Progress
from swarm_helpers import rounds_of, start_replicas, wait_for_round

from hetero_node.bench.config import SimConfig
from hetero_node.bench.sim import FULL, Cell, cell_run_config, grid, run_cell, run_sim, simulate
from hetero_node.bench.sim_replicas import SimFullReplica
from hetero_node.bench.sim_report import (
    finding_composes,
    finding_outer,
    finding_selective,
    rounds_to_reach,
    summarize,
)
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.models.data import build_token_store, val_batches
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.sparseloco import chunk_plan


@pytest.fixture
def store(bundled_cache_dir: Path):
    return build_token_store(None, load_tokenizer(None), bundled_cache_dir)


# long: the lab's own check against a live swarm (28 s); `make test` keeps the lab's runs in one process
@pytest.mark.long
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_lab_round_gives_the_same_weights_as_a_loopback_swarm_round(tmp_path: Path, store) -> None:
    rounds, h = 2, 4
    exact = {"max_inner_steps": h, "min_inner_steps": h}  # both replicas train exactly H steps
    with LocalSwarm(tmp_path) as swarm:
        start_replicas(swarm, 2, tmp_path, rounds, h, run_extra=exact)
        for i in range(2):
            wait_for_round(tmp_path, i, rounds - 1)
    header, _ = read_metrics(tmp_path / "r0.jsonl")
    run = RunConfig.from_dict(header["run"])
    swarm_rounds = [rounds_of(tmp_path, i) for i in range(2)]
    assert run.uses_subspace, "the default run keeps T_fixed + E_S on full replicas too: the lab must as well"
    lab = simulate(run, [FULL, FULL], store, val_batches(store, run.batch_size, run.seq_len, 1), lambda _p: None)
    for t in range(rounds):
        assert swarm_rounds[0][t]["fingerprints"] == swarm_rounds[1][t]["fingerprints"], f"swarm round {t} split"
        assert lab[t].fingerprints == swarm_rounds[0][t]["fingerprints"], f"round {t}: lab ≠ swarm"


def _quick(**changes: object) -> SimConfig:
    base = {"rounds": 2, "batch_size": 4, "seq_len": 32, "microbatches": 2, "eval_batches": 1, "seeds": 1,
            "replicas": "2", "inner_steps": "2"}  # fmt: skip
    return SimConfig(**{**base, **changes})


@pytest.mark.parametrize("method", ["hetero", "ddp"])
def test_the_same_seed_gives_the_same_runs(store, method: str) -> None:
    cfg = _quick(methods=method)
    cell = grid(cfg)[0]
    held_out = val_batches(store, cfg.batch_size, cfg.seq_len, 1)
    vocab = load_tokenizer(None).vocab_size
    first, again = (run_cell(cfg, cell, 0, store, vocab, held_out, lambda _p: None) for _ in range(2))
    other_seed = run_cell(cfg, cell, 1, store, vocab, held_out, lambda _p: None)
    assert first == again
    assert first["rounds"][-1]["eval_loss"] < first["initial_eval_loss"], "two rounds of training did not help"
    assert other_seed["rounds"][-1]["fingerprints"] != first["rounds"][-1]["fingerprints"]


# long: the lab's --jobs plumbing (18 s); the runs themselves are checked in turn above
@pytest.mark.long
@pytest.mark.timeout(300)
def test_runs_in_worker_processes_give_the_same_report_as_runs_in_turn(bundled_cache_dir: Path, tmp_path: Path) -> None:
    """`--jobs` only changes where runs execute: every run's curve and fingerprints are those of the sweep in turn."""
    reports = {}
    for jobs in (1, 2):
        cfg = _quick(methods="sparseloco,hetero", rank_divisors="8", seeds=2, jobs=jobs, out=tmp_path / f"jobs{jobs}")
        with Progress(disable=True) as progress:
            run_sim(cfg, progress)
        runs = json.loads((cfg.out / "report.json").read_text())["runs"]
        reports[jobs] = {(r["cell"], r["seed"]): r["rounds"] for r in runs}
    assert len(reports[1]) == 4 and reports[2] == reports[1]
    assert (tmp_path / "jobs2" / "report.md").read_text() == (tmp_path / "jobs1" / "report.md").read_text()


def test_traffic_is_the_encoded_messages_and_boundaries(store) -> None:
    """SparseLoCo's message has one exact size; a virtual replica's boundaries are counted, compressed ones
    smaller; only virtual replicas fetch T_fixed."""
    vocab = load_tokenizer(None).vocab_size
    cfg = _quick(methods="hetero,none")
    held_out = val_batches(store, cfg.batch_size, cfg.seq_len, 1)
    runs = {c.method: run_cell(cfg, c, 0, store, vocab, held_out, lambda _p: None) for c in grid(cfg)}
    run = cell_run_config(cfg, grid(cfg)[0], 0, vocab, store)
    methods = SimFullReplica(run, store, 0).methods
    message = sum(m.max_message_bytes for m in methods)
    for r in runs.values():
        assert all(p["traffic"]["outer"] == message for p in r["rounds"])  # R = 2: one peer's message, both ways
    hetero, dense = runs["hetero"]["rounds"][0]["traffic"], runs["none"]["rounds"][0]["traffic"]
    assert 0 < hetero["boundary"] < dense["boundary"] / 4  # d/8 codes in bf16 against d_model values
    # stage 1 of the one VR downloads the entries of E_S the step changed (8 bytes each), shared over 2 replicas:
    # at most what the two messages selected in the embedding, far below the dense fp32 table (d_model 128)
    selected = chunk_plan((vocab, 128), 64, 64).num_selected
    assert dense["table"] == 0 and 0 < hetero["table"] * 2 <= 2 * selected * 8 < vocab * 128 * 4 / 10


def test_steps_of_several_batches_move_every_batch_through_the_pipeline_and_count_its_tokens(store) -> None:
    """--accumulation 2 (a stretched round): each inner step of the virtual replica sends both batches' microbatches
    across its boundary, and the swarm's tokens double."""
    vocab = load_tokenizer(None).vocab_size
    runs = {}
    for a in (1, 2):
        cfg = _quick(methods="hetero", rank_divisors="8", accumulation=a)
        held_out = val_batches(store, cfg.batch_size, cfg.seq_len, 1)
        runs[a] = run_cell(cfg, grid(cfg)[0], 0, store, vocab, held_out, lambda _p: None)["rounds"][0]
    assert runs[2]["traffic"]["boundary"] == 2 * runs[1]["traffic"]["boundary"] > 0
    assert runs[2]["tokens"] == 2 * runs[1]["tokens"]
    assert runs[2]["fingerprints"] != runs[1]["fingerprints"]


def test_the_grid_sweeps_only_the_knobs_a_method_has() -> None:
    cells = grid(SimConfig(methods="ddp,hetero,sparseloco", rank_divisors="8,16", topk="16,64", inner_steps="10"))
    assert [c.name for c in cells if c.method == "ddp"] == ["ddp R4 H10"]
    assert len([c for c in cells if c.method == "hetero"]) == 4  # 2 top-k × 2 ranks
    assert len([c for c in cells if c.method == "sparseloco"]) == 2
    assert Cell("hetero", 5, 10, 64, 8).layout == ["full", "full", "virtual", "virtual", "virtual"]
    with pytest.raises(ConfigError, match="--rank-divisors"):
        SimConfig(rank_divisors="8,x")
    with pytest.raises(ConfigError, match="--methods"):
        SimConfig(methods="hetero,magic")


def _run(method: str, seed: int, curve: list[float], rank: int | None = None, traffic: float = 100.0) -> dict:
    cell = Cell(method, 4, 10, None if method in ("ddp", "diloco") else 64, rank)
    per_round = {"outer": traffic, "boundary": 0.0, "table": 0.0}
    rounds = [{"eval_loss": loss, "tokens": 1000 * (t + 1), "bytes_per_replica": traffic * (t + 1),
               "traffic": per_round} for t, loss in enumerate(curve)]  # fmt: skip
    return {**dataclasses.asdict(cell), "cell": cell.name, "seed": seed, "rounds": rounds}


def test_the_report_averages_seeds_and_finds_when_a_curve_reaches_another() -> None:
    runs = [
        _run("diloco", 0, [5.0, 4.0, 3.0], traffic=10_000.0), _run("diloco", 1, [5.0, 4.0, 3.2], traffic=10_000.0),
        _run("sparseloco", 0, [6.0, 4.6, 3.1]), _run("sparseloco", 1, [6.0, 3.6, 3.1]),
    ]  # fmt: skip
    cells = summarize(runs)
    sparse, dense = cells["sparseloco R4 H10 k64"], cells["diloco R4 H10"]
    assert sparse.finals == [3.1, 3.1] and sparse.mean == pytest.approx(3.1) and sparse.std == 0.0
    assert dense.mean == pytest.approx(3.1) and dense.std == pytest.approx(0.1414, abs=1e-4)
    assert sparse.curve == pytest.approx([6.0, 4.1, 3.1])
    assert rounds_to_reach(sparse.curve, dense.curve) == 2  # 20% over DiLoCo after round 1, then within 3%
    assert rounds_to_reach([6.0, 4.4, 3.1], dense.curve) == 3
    assert rounds_to_reach([2.0, 9.0], [2.0, 2.0]) is None
    row = finding_outer(cells)[2]
    assert "| +0.1% ± 4.6% |" in row and "| 2 |" in row  # paired by seed: +3.3% and −3.1%
    assert "| 200.0× |" in row and row.endswith("| 100.0× |")  # messages: 1.5 vs R − 1 = 3 of them moved


def test_the_findings_compare_like_with_like() -> None:
    runs = [_run("none", 0, [4.0]), _run("hetero", 0, [4.2], rank=8), _run("hetero", 0, [4.4], rank=64),
            _run("compress-all", 0, [4.4], rank=8), _run("compress-all", 0, [5.5], rank=64)]  # fmt: skip
    cells = summarize(runs)
    composes = finding_composes(cells)
    assert len(composes) == 4 and "+5.0%" in composes[2] and "+10.0%" in composes[3]
    selective = finding_selective(cells)
    assert [r.split(" | ")[0] for r in selective[2:]] == ["| d/8", "| d/64"]
    assert "+4.8%" in selective[2] and "+25.0%" in selective[3]
    assert finding_outer(cells) == []  # no DiLoCo run: no table rather than a wrong one


def test_cells_come_in_the_grids_order_whatever_order_their_runs_were_merged_in() -> None:
    """A sweep split across processes (one per cell, e.g. on a GPU) is merged by concatenating runs in any order."""
    runs = [_run("compress-all", 0, [5.5], rank=64), _run("hetero", 0, [4.4], rank=64),
            _run("hetero", 0, [4.2], rank=8), _run("compress-all", 0, [4.4], rank=8), _run("none", 0, [4.0]),
            _run("ddp", 0, [3.0])]  # fmt: skip
    assert list(summarize(runs)) == [
        "ddp R4 H10",
        "hetero R4 H10 k64 d/8",
        "hetero R4 H10 k64 d/64",
        "compress-all R4 H10 k64 d/8",
        "compress-all R4 H10 k64 d/64",
        "none R4 H10 k64",
    ]
    assert [r.split(" | ")[0] for r in finding_selective(summarize(runs))[2:]] == ["| d/8", "| d/64"]
