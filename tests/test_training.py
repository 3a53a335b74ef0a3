"""The local training job: it learns on the bundled corpus, and its summary reports what actually happened."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

from hetero_node.client.config import OptimConfig, TrainConfig
from hetero_node.client.roles.local_train import TrainProgress, run_local_training
from hetero_node.models.config import get_preset
from hetero_node.models.data import build_token_store
from hetero_node.models.tokenizer import load_tokenizer


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """Enough varied text for a few tiny batches without the bundled corpus."""
    lines = [
        f"Line {i}: the {['quick', 'lazy', 'brown'][i % 3]} fox jumps over dog number {i * 7 % 13}."
        for i in range(3000)
    ]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.mark.timeout(900)  # ≈45 s on 2 idle cores, but compute-bound: a busy machine stretches it several-fold
@pytest.mark.long
def test_small_learns_on_bundled_corpus(bundled_cache_dir: Path) -> None:
    """150 CPU steps must take the byte-level loss far below chance (ln 256)."""
    cfg = TrainConfig(
        preset="small",
        steps=150,
        batch_size=4,
        seq_len=128,
        eval_every=150,
        eval_batches=4,
        cache_dir=bundled_cache_dir,
    )
    summary = run_local_training(cfg, OptimConfig(lr=3e-3, warmup_steps=20))
    assert abs(summary.initial_eval_loss - math.log(256)) < 0.5  # starts from chance...
    assert summary.final_eval_loss < 0.6 * summary.initial_eval_loss  # ...and learns (≈2.35 nats after 150 steps)


def test_tiny_summary_reports_the_run(text_file: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(
        preset="tiny",
        steps=6,
        batch_size=3,
        seq_len=32,
        eval_every=4,
        eval_batches=2,
        data=text_file,
        cache_dir=tmp_path,
    )
    reports: list[TrainProgress] = []
    summary = run_local_training(cfg, OptimConfig(warmup_steps=2), reports.append)

    assert summary.preset == "tiny" and summary.device == "cpu" and summary.steps == 6
    assert summary.n_params == get_preset("tiny").n_params()
    assert summary.tokens == 6 * 3 * 32
    assert summary.data_identity == build_token_store(text_file, load_tokenizer(None), tmp_path).identity
    assert [step for step, _ in summary.eval_history] == [0, 4, 6]  # before training, every 4 steps, at the end
    assert summary.initial_eval_loss == summary.eval_history[0][1]
    assert summary.final_eval_loss == summary.eval_history[-1][1]
    assert summary.wall_s > 0 and summary.tokens_per_s > 0

    assert [r.step for r in reports] == list(range(7)) and all(r.total_steps == 6 for r in reports)
    assert reports[0].train_loss is None and all(r.train_loss is not None for r in reports[1:])
    assert reports[-1].eval_loss == summary.final_eval_loss


def test_model_follows_the_tokenizer_and_sequence_length(text_file: Path, tmp_path: Path) -> None:
    """A custom tokenizer sets the vocabulary; a --seq-len beyond the preset's max_seq_len still trains (RoPE)."""
    bpe = RustTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train([str(text_file)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tokenizer_path = tmp_path / "tokenizer.json"
    bpe.save(str(tokenizer_path))
    vocab_size = load_tokenizer(tokenizer_path).vocab_size
    assert vocab_size != 256

    seq_len = get_preset("tiny").max_seq_len + 8
    cfg = TrainConfig(
        preset="tiny",
        steps=1,
        batch_size=1,
        seq_len=seq_len,
        eval_batches=1,
        data=text_file,
        tokenizer=tokenizer_path,
        cache_dir=tmp_path / "cache",
    )
    summary = run_local_training(cfg, OptimConfig(warmup_steps=0))
    assert summary.n_params == get_preset("tiny", vocab_size=vocab_size).n_params()
    assert summary.tokens == seq_len
