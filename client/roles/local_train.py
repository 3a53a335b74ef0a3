"""The single-process training job: one whole model on one machine, no peers.

It is the quality baseline every swarm run is compared with, and the first thing a volunteer runs to check their
machine. UI stays out of it: progress goes to a callback, the result comes back as a `TrainSummary`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from hetero_node.client.config import OptimConfig, TrainConfig
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, build_token_store, val_batches
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.models.trainer import InnerTrainer, compile_wanted, resolve_device
from hetero_node.models.transformer import Transformer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainProgress:
    """State after an inner step (step 0: after the initial evaluation, before any training)."""

    step: int
    total_steps: int
    train_loss: float | None
    """Loss of the batch just trained on (None before the first step)."""
    eval_loss: float
    """Most recent held-out loss."""
    tokens_per_s: float
    """Training throughput so far, evaluation time excluded."""


@dataclass(frozen=True)
class TrainSummary:
    """What a local run achieved; `--report` writes it as JSON, so field names are a stable interface."""

    preset: str
    n_params: int
    device: str
    data_identity: str
    """`TokenStore.identity` of the training data: equal hashes mean the same tokens (see the README)."""
    steps: int
    tokens: int
    """Training tokens consumed: steps × batch size × sequence length."""
    wall_s: float
    """Whole job after data preparation: training steps plus evaluations."""
    tokens_per_s: float
    """Training tokens per second of training-step time (evaluation excluded, so it compares across settings)."""
    initial_eval_loss: float
    final_eval_loss: float
    eval_history: list[tuple[int, float]]
    """(step, held-out loss), starting with step 0 (before training) and ending with the last step."""


ProgressCallback = Callable[[TrainProgress], None]


def run_local_training(
    train: TrainConfig, optim: OptimConfig, on_progress: ProgressCallback | None = None
) -> TrainSummary:
    """Train `train.preset` on shard 0 of 1 of the data for `train.steps` inner steps and evaluate along the way."""
    tokenizer = load_tokenizer(train.tokenizer)
    preset = get_preset(train.preset)
    # RoPE has no learned positions, so a longer --seq-len than the preset's only needs longer rotation tables
    model_cfg = get_preset(
        train.preset, vocab_size=tokenizer.vocab_size, max_seq_len=max(preset.max_seq_len, train.seq_len)
    )
    device = resolve_device(train.device)
    store = build_token_store(train.data, tokenizer, train.cache_dir or default_cache_dir())
    batches = ShardBatches(store, 0, 1, train.batch_size, train.seq_len, train.seed)
    held_out = val_batches(store, train.batch_size, train.seq_len, train.eval_batches)
    model = Transformer(model_cfg, seed=train.seed).to(device)
    trainer = InnerTrainer(
        model, optim, total_steps=train.steps, device=device, compile=compile_wanted(train.compile, device)
    )
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = train.batch_size * train.seq_len
    logger.info(
        "training %s (%d parameters) on %s, data %s, %d tokens per step",
        train.preset,
        n_params,
        device,
        store.identity[:12],
        tokens_per_step,
    )

    start = time.perf_counter()
    trainer.warm_up(*batches.batch(0))  # compiling is part of the job's wall time, not of its training speed
    history = [(0, trainer.evaluate(held_out))]
    train_time = 0.0
    train_loss = None

    def report(step: int) -> None:
        if on_progress is not None:
            speed = step * tokens_per_step / train_time if train_time else 0.0
            on_progress(TrainProgress(step, train.steps, train_loss, history[-1][1], speed))

    report(0)
    for step in range(1, train.steps + 1):
        step_start = time.perf_counter()
        loss = trainer.train_step(*next(batches))
        due = step % train.eval_every == 0 or step == train.steps
        if on_progress is not None or due:  # reading the loss waits for the step: only when it is shown
            train_loss = float(loss)
        train_time += time.perf_counter() - step_start
        if due:
            history.append((step, trainer.evaluate(held_out)))
            logger.info("step %d: train loss %.4f, eval loss %.4f", step, train_loss, history[-1][1])
        report(step)
    wall_s = time.perf_counter() - start

    tokens = train.steps * tokens_per_step
    return TrainSummary(
        preset=train.preset,
        n_params=n_params,
        device=str(device),
        data_identity=store.identity,
        steps=train.steps,
        tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / train_time,
        initial_eval_loss=history[0][1],
        final_eval_loss=history[-1][1],
        eval_history=history,
    )
