"""The algorithm lab's slow replicas (`hetero-node-lab sim --slow-replicas`): when a slow replica trains and
contributes, how its contribution is scaled, that sitting out is the same as being absent, and the report's
slow-token value on synthetic runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetero_node.bench.config import SimConfig
from hetero_node.bench.sim import FULL, Cell, cell_run_config, grid, simulate
from hetero_node.bench.sim_cadence import Cadence, contribution_scaling, lab_cadences
from hetero_node.bench.sim_report import finding_slow, slow_token_value, summarize
from hetero_node.models.data import build_token_store, val_batches
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.protocol.errors import ConfigError


def test_a_window_opens_after_the_last_closes_and_the_first_is_shortened_by_its_offset() -> None:
    staggered = Cadence(5, window=4, offset=1)
    assert [t for t in range(10) if staggered.starts(t)] == [0, 3, 7]
    assert [t for t in range(10) if staggered.ends(t)] == [2, 6]
    assert staggered.steps(0) == 15 and staggered.steps(3) == 20  # 3 rounds, then 4, of 5 steps a round
    every = Cadence(20)
    assert all(every.starts(t) and every.ends(t) and every.steps(t) == 20 for t in range(5))
    idle = Cadence(5, window=0)
    assert not any(idle.starts(t) or idle.ends(t) for t in range(5))
    with pytest.raises(ValueError):
        Cadence(5, window=2, offset=2)
    assert lab_cadences(4, 20, 2, 4, 4) == [Cadence(20), Cadence(20), Cadence(5, 4, 0), Cadence(5, 4, 1)]


def test_in_a_stretched_round_slow_replicas_take_fewer_steps_of_its_size_or_h_smaller_ones() -> None:
    """Fast replicas at 4 batches a step; quarter-speed ones train 20 batches a round either way."""
    fast = Cadence(20, accumulation=4)
    assert lab_cadences(3, 20, 1, 4, 1, 4, "fewer") == [fast, fast, Cadence(5, accumulation=4)]
    assert lab_cadences(3, 20, 1, 4, 1, 4, "smaller") == [fast, fast, Cadence(20, accumulation=1)]
    assert lab_cadences(2, 20, 1, 2, 1, 4, "smaller")[1] == Cadence(20, accumulation=2)  # half speed: steps of 2
    assert lab_cadences(2, 20, 1, 8, 1, 4, "smaller")[1] == Cadence(10, accumulation=1)  # F > A: fewer single ones
    with pytest.raises(ValueError):
        lab_cadences(2, 20, 1, 4, 1, 4, "bigger")


def test_a_contribution_is_scaled_by_its_rule() -> None:
    assert contribution_scaling("plain", 5, 20, 3) == (1.0, 1.0)
    assert contribution_scaling("discounted", 20, 20, 3) == (0.5, 1.0)  # (1 + 3)^-1/2
    assert contribution_scaling("rescaled", 5, 20, 0) == (4.0, 4.0)  # H / n, claiming H steps' tokens
    assert contribution_scaling("rescaled", 4, 20 * 4, 0) == (20.0, 20.0)  # 4 batches against 20 steps of 4
    assert contribution_scaling("rescaled-discounted", 5, 20, 3) == (2.0, 4.0)
    assert contribution_scaling("rebased", 5, 20, 3) == (1.0, 1.0)  # rebased by the lab's swarm, not scaled
    assert all(contribution_scaling(rule, 20, 20, 0) == (1.0, 1.0) for rule in ("plain", "rescaled", "discounted"))
    with pytest.raises(ValueError, match="slow rule"):
        contribution_scaling("magic", 5, 20, 0)


def test_the_grid_sweeps_windows_and_rules_and_bad_slow_options_are_refused() -> None:
    cfg = SimConfig(methods="sparseloco,ddp", replicas="4", inner_steps="20", slow_replicas=2, slow_windows="0,1,4",
                    slow_rules="plain,discounted,rescaled")  # fmt: skip
    names = [c.name for c in grid(cfg)]
    assert names == [
        "sparseloco R4 H20 k64",
        "sparseloco R4 H20 k64 slow2/4 sit out",
        "sparseloco R4 H20 k64 slow2/4 w1 plain",
        "sparseloco R4 H20 k64 slow2/4 w1 rescaled",
        "sparseloco R4 H20 k64 slow2/4 w4 plain",
        "sparseloco R4 H20 k64 slow2/4 w4 discounted",
        "sparseloco R4 H20 k64 slow2/4 w4 rescaled",
        "ddp R4 H20",
    ]  # fmt: skip  (a fresh window is never discounted; ddp has no rounds)
    for bad, match in ((dict(slow_replicas=4), "--slow-replicas"), (dict(slow_replicas=1, slow_factor=3),
                       "--slow-factor"), (dict(slow_windows="1,x"), "--slow-windows"),
                       (dict(slow_rules="plain,magic"), "--slow-rules")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            SimConfig(replicas="4", inner_steps="20", **bad)  # type: ignore[arg-type]


def test_slow_replicas_that_sit_out_change_nothing_and_a_window_contributes_once_with_its_tokens(
    bundled_cache_dir: Path,
) -> None:
    """A replica that sits out every round leaves θ exactly as if it were not there; one slow replica with a window of
    two rounds adds its tokens once per window, at the window's end."""
    store = build_token_store(None, load_tokenizer(None), bundled_cache_dir)
    cfg = SimConfig(rounds=3, batch_size=4, seq_len=32, eval_batches=1, seeds=1, replicas="2", inner_steps="4",
                    slow_replicas=1, slow_factor=2)  # fmt: skip
    cell = dataclasses.replace(Cell("sparseloco", 2, 4, 64, None), slow=1, slow_factor=2)
    run = cell_run_config(cfg, cell, 0, load_tokenizer(None).vocab_size, store)
    held_out = val_batches(store, cfg.batch_size, cfg.seq_len, 1)
    alone = simulate(run, [FULL], store, held_out, lambda _p: None, names=["replica-0000"])
    sitting = simulate(run, [FULL, FULL], store, held_out, lambda _p: None,
                       cadences=dataclasses.replace(cell, window=0).cadences())  # fmt: skip
    assert [p.fingerprints for p in sitting] == [p.fingerprints for p in alone]
    windowed = simulate(run, [FULL, FULL], store, held_out, lambda _p: None,
                        cadences=dataclasses.replace(cell, window=2).cadences(), slow_rule="plain")  # fmt: skip
    step_tokens = cfg.batch_size * cfg.seq_len
    assert [p.tokens for p in windowed] == [4 * step_tokens, (8 + 4) * step_tokens, (12 + 4) * step_tokens]
    assert windowed[0].fingerprints == alone[0].fingerprints  # the slow one's window is still open
    assert windowed[1].fingerprints != alone[1].fingerprints
    rebased = simulate(run, [FULL, FULL], store, held_out, lambda _p: None,
                       cadences=dataclasses.replace(cell, window=2).cadences(), slow_rule="rebased")  # fmt: skip
    assert rebased[0].fingerprints == windowed[0].fingerprints  # only the stale contribution differs
    assert rebased[1].fingerprints != windowed[1].fingerprints


def _run(cell: Cell, seed: int, final: float, tokens: int) -> dict:
    rounds = [{"eval_loss": final, "tokens": tokens, "bytes_per_replica": 1.0,
               "traffic": {"outer": 1.0, "boundary": 0.0, "table": 0.0}}]  # fmt: skip
    return {**dataclasses.asdict(cell), "cell": cell.name, "seed": seed, "rounds": rounds}


def test_the_report_prices_a_slow_token_between_sitting_out_and_every_replica_fast() -> None:
    """Every replica fast gains 0.2 over the slow ones sitting out with 1,000 more tokens; a cell adding 250 tokens
    that gains 0.025 of it has slow tokens worth half a fast one's."""
    fast = Cell("sparseloco", 4, 20, 64, None)
    slow = dataclasses.replace(fast, slow=2, slow_factor=4)
    runs = [_run(fast, 0, 2.0, 2000), _run(dataclasses.replace(slow, window=0), 0, 2.2, 1000),
            _run(dataclasses.replace(slow, window=1, slow_rule="plain"), 0, 2.22, 1250),
            _run(dataclasses.replace(slow, window=4, slow_rule="rescaled"), 0, 2.175, 1250)]  # fmt: skip
    cells = summarize(runs)
    by_name = {c.window: c for c in cells.values() if c.slow}
    assert slow_token_value(by_name[4], by_name[0], cells[fast.name]) == pytest.approx(0.5)
    rows = {row.split(" | ")[0].strip("| "): row for row in finding_slow(cells)[2:]}
    assert set(rows) == {"sparseloco R4 H20 k64 slow2/4 w1 plain", "sparseloco R4 H20 k64 slow2/4 w4 rescaled"}
    assert "| -0.40 |" in rows["sparseloco R4 H20 k64 slow2/4 w1 plain"]  # worse than sitting out: negative
    assert "+0.9%" in rows["sparseloco R4 H20 k64 slow2/4 w1 plain"]  # 2.22 against 2.2
