"""The `ddp` baseline: what users would otherwise run, plain data parallelism over torch.distributed (gloo).

One process per node (`hetero-node-lab ddp-rank --rank R --world-size W --master ADDR:PORT ...`, run options as for
`hetero-node bootstrap`; the benchmark starts them). Every rank trains the same model from the same seed on its
own data shard with the same inner optimizer as the swarm's replicas, and after every backward pass the ranks
all-reduce the dense fp32 gradients (one flat buffer) and step on their mean. Communication is not overlapped
with the backward pass (torch's DistributedDataParallel would overlap it per bucket): this keeps compute and
communication time separate in the metrics, and on a 50 Mbit/s link the backward pass it could hide is a small
part of a step.

Each rank writes a metrics JSONL file in the nodes' format (a header line, then one round line per H steps with
an evaluation), so the report treats ddp like every other method. `bytes_sent` is what a ring all-reduce of that
buffer sends per rank, 2(W-1)/W of it; `allreduce_bytes` is the buffer itself.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero_node.bench.config import DDPWorkerConfig
from hetero_node.client.local.collective import average
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, val_batches
from hetero_node.models.shards import fingerprint
from hetero_node.models.trainer import InnerTrainer, resolve_device
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)


class GradientAllReduce:
    """Replaces every parameter's gradient by its mean over the ranks once backward has produced all of them.

    A post-accumulate-grad hook counts the gradients in; the last one triggers one all_reduce of the flat buffer,
    so the inner trainer's clipping and AdamW step then see the global mean, as under DDP.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pending = len(self.params)
        self.seconds = 0.0
        self.bytes = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _param: torch.Tensor) -> None:
        self.pending -= 1
        if self.pending == 0:
            self._all_reduce()

    def _all_reduce(self) -> None:
        start = time.perf_counter()
        self.bytes += average([p.grad for p in self.params if p.grad is not None])
        self.seconds += time.perf_counter() - start  # the flat copies too: a few ms beside a 50 Mbit/s all-reduce
        self.pending = len(self.params)

    def check_reduced(self, *_args: object) -> None:
        """Optimizer pre-step hook: a step on local gradients would let the ranks' weights drift apart."""
        if self.pending != len(self.params):
            raise RuntimeError(f"{self.pending} gradients never arrived this step: ranks would diverge")


def train(run: RunConfig, store: TokenStore, worker: DDPWorkerConfig) -> None:
    """rounds × H steps on this rank's shard, an evaluation and a metrics line after every H."""
    device = resolve_device(worker.device)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{worker.master}", rank=worker.rank, world_size=worker.world_size,
        timeout=timedelta(seconds=worker.timeout_s),
    )  # fmt: skip
    try:
        model = Transformer(get_preset(run.preset, vocab_size=run.vocab_size), seed=run.seed).to(device)
        trainer = InnerTrainer(model, run.optim, run.total_inner_steps, device)
        sync = GradientAllReduce(model)
        trainer.optimizer.register_step_pre_hook(sync.check_reduced)
        batches = ShardBatches(
            store, worker.rank % run.data_shards, run.data_shards, run.batch_size, run.seq_len, run.seed
        )
        held_out = val_batches(store, run.batch_size, run.seq_len, worker.eval_batches)
        n_params = sum(p.numel() for p in model.parameters())
        header = {"peer_id": f"ddp-rank{worker.rank}", "role": "ddp", "stage": None, "vr": None,
                  "replica_id": worker.rank, "n_params": n_params, "run": run.to_dict()}  # fmt: skip
        _append(worker.metrics, {"header": header})
        ring_share = 2 * (worker.world_size - 1) / worker.world_size
        H = run.outer.inner_steps
        for t in range(run.outer.rounds):
            bytes_before, comm_before = sync.bytes, sync.seconds
            start = time.perf_counter()
            losses = [float(trainer.train_step(*batches.batch(t * H + i))) for i in range(H)]
            elapsed = time.perf_counter() - start
            comm_s = sync.seconds - comm_before
            round_bytes = sync.bytes - bytes_before
            eval_loss = trainer.evaluate(held_out)
            record = {
                "round": t, "inner_steps": H, "tokens": H * run.batch_size * run.seq_len,
                "train_loss": sum(losses) / H, "eval_loss": eval_loss, "bytes_sent": int(ring_share * round_bytes),
                "bytes_received": int(ring_share * round_bytes), "compute_s": elapsed - comm_s, "comm_s": comm_s,
                "fingerprints": {"model": fingerprint(list(model.parameters()))}, "group_size": worker.world_size,
                "contributors": worker.world_size, "allreduce_bytes": round_bytes,
            }  # fmt: skip
            _append(worker.metrics, record)
            logger.info("round %d: train %.4f eval %.4f, %.1f s compute, %.1f s all-reduce",
                        t, record["train_loss"], eval_loss, record["compute_s"], comm_s)  # fmt: skip
    finally:
        dist.destroy_process_group()


def _append(path: Path | None, line: dict[str, Any]) -> None:
    """One flushed JSON line, so the benchmark harness can follow the file while the rank runs."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
