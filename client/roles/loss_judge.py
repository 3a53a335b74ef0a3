"""A full replica's judge under `--admission loss`: how much each selected message's step alone lowers the probe loss.

The rule, and how the judges' verdicts are agreed, are `protocol/admission.py`; this module only measures. The judge
keeps its own copy of the model, so a replica that trains the next round while a round's exchange runs (`--overlap`)
is not disturbed, and one lock, since each shard's round finishes in its own worker thread. A shard's candidate is
scored with every other shard at its θ(t), the state the round started from.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from hetero_node.client.outer.shard_sync import Drops
from hetero_node.models.data import Batch, TokenStore, probe_batches
from hetero_node.models.shards import shard_tensors
from hetero_node.models.trainer import mean_loss
from hetero_node.protocol.admission import PROBE_BATCHES
from hetero_node.protocol.run_config import RunConfig


class LossJudge:
    """See the module docstring."""

    def __init__(self, model: nn.Module, shard_names: list[list[str]], store: TokenStore, run: RunConfig) -> None:
        """`model`: the replica's live model (copied once; its buffers are read at each judgement, since a subspace
        run's upkeep moves the fixed token table between rounds)."""
        self.live = model
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.params = [shard_tensors(self.model, names) for names in shard_names]
        self.device = next(self.model.parameters()).device
        self.probe: Callable[[int], list[Batch]] = lambda draw: probe_batches(
            store, run.data_shards, run.batch_size, run.seq_len, run.seed, draw, PROBE_BATCHES
        )
        self.lock = threading.Lock()

    def for_shard(self, shard: int, starts: Callable[[], Mapping[int, list[Tensor]]]) -> Drops:
        """`drops` for one shard's rounds; `starts()`: θ(t) of every shard, as the replica holds it now."""
        return lambda draw, start, candidates: self.drops(draw, {**starts(), shard: start}, shard, candidates)

    @torch.no_grad()
    def drops(
        self, draw: int, starts: Mapping[int, list[Tensor]], shard: int, candidates: Iterable[tuple[str, list[Tensor]]]
    ) -> dict[str, float]:
        """Author → probe loss at θ(t) minus probe loss with `shard` at that author's θ(t+1), on the probe batches
        of `draw`; `candidates` are made one at a time, so only one θ(t+1) is held."""
        with self.lock:
            batches = self.probe(draw)
            ours = dict(self.model.named_buffers())
            for name, live in self.live.named_buffers():
                ours[name].copy_(live)
            for s, tensors in starts.items():
                self._load(s, tensors)
            before = mean_loss(self.model, batches, self.device)
            drops = {}
            for author, tensors in candidates:
                self._load(shard, tensors)
                drops[author] = before - mean_loss(self.model, batches, self.device)
            return drops

    def _load(self, shard: int, tensors: list[Tensor]) -> None:
        for param, value in zip(self.params[shard], tensors, strict=True):
            param.copy_(value)
