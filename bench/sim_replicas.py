"""The algorithm lab's replicas: a full replica and a virtual replica in one process, running the nodes' own code.

A full replica is what `FullReplica.train` does: AdamW steps on its data shard, the batch of inner step i of round
t at index t·STEP_STRIDE + i, the LR schedule at t·H + i. A virtual replica is `PipelineStage`s (the code a stage
peer runs) composed in sequence: every microbatch goes forward through the stages as encoded boundary messages
(subspace code or dense, in the run's wire dtype, bytes counted) and its activation-gradients come back the same
way; each stage clips its own shard and re-projects after its optimizer step, exactly as on a stage peer. Only the
transport is missing, which the lab does not measure.

Both hold one `OuterMethod` per parameter shard (SparseLoCo's error feedback is per replica), and both start every
round from the swarm's θ(t) and T_fixed (`load`). Their modules may live on a GPU (`hetero-node-lab sim --device`); the
outer methods' error feedback and messages stay on the CPU, as on a node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

from hetero_node.client.roles.pipeline_stage import PipelineStage
from hetero_node.client.roles.replica import STEP_STRIDE
from hetero_node.client.roles.stage_link import microbatch_sizes
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore
from hetero_node.models.shards import shard_parameter_names
from hetero_node.models.subspace import enable_subspace, subspace_basis
from hetero_node.models.trainer import InnerTrainer
from hetero_node.models.transformer import Transformer
from hetero_node.protocol import boundary_codec as codec
from hetero_node.protocol.outer_methods import OuterMethod, outer_method
from hetero_node.protocol.run_config import RunConfig

CPU = torch.device("cpu")


def global_model(run: RunConfig) -> Transformer:
    """θ(0) of the run as every node builds it (with T_fixed + E_S in a subspace run)."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    model = Transformer(cfg, seed=run.seed)
    if run.uses_subspace:
        enable_subspace(model, subspace_basis(cfg.d_model, run.pipeline.rank(cfg.d_model), run.seed))
    return model


class SimReplica(ABC):
    """One replica of the lab: trains a round from θ(t), then says what changed, per parameter shard."""

    def __init__(self, run: RunConfig, store: TokenStore, data_shard: int) -> None:
        self.run = run
        self.batches = ShardBatches(store, data_shard % run.data_shards, run.data_shards, run.batch_size,
                                    run.seq_len, run.seed)  # fmt: skip
        cfg = get_preset(run.preset, vocab_size=run.vocab_size)
        self.shard_names = shard_parameter_names(cfg, run.outer.stages)
        self.methods: list[OuterMethod] = []
        self.boundary_bytes = 0
        """Bytes of the boundary messages of the last round (a virtual replica's; 0 for a full one)."""

    @abstractmethod
    def modules(self) -> list[nn.Module]:
        """The modules holding this replica's parameters (one model, or its stages)."""

    @abstractmethod
    def train(self, t: int, steps: int, accumulation: int = 1) -> None:
        """Round t's inner steps from the loaded θ(t), each on the mean gradient of `accumulation` batches (the
        batches of step i: t·STEP_STRIDE + i·accumulation onwards, as `FullReplica.train` reads them)."""

    def _params(self) -> dict[str, Tensor]:
        return {name: p for m in self.modules() for name, p in m.named_parameters()}

    @torch.no_grad()
    def load(self, theta: dict[str, Tensor], fixed: Tensor | None) -> None:
        """Start from the swarm's θ(t) (and T_fixed); inner optimizer and error feedback carry over, as on a node."""
        for name, p in self._params().items():
            p.copy_(theta[name])
        for m in self.modules():
            if fixed is not None:
                m.embed_fixed.copy_(fixed)
        self.start = {name: p.detach().clone() for name, p in self._params().items()}

    def shard_deltas(self, origin: dict[str, Tensor] | None = None) -> list[list[Tensor]]:
        """Δ = start − θ_local per shard, in the shards' parameter order; from `origin` instead of the start when
        given (a stale window rebased on the θ its contribution is applied to)."""
        params, start = self._params(), self.start if origin is None else origin
        return [[start[n] - params[n].detach() for n in names] for names in self.shard_names]

    def _make_methods(self) -> None:
        params = self._params()
        self.methods = [outer_method(self.run, [tuple(params[n].shape) for n in names]) for names in self.shard_names]


class SimFullReplica(SimReplica):
    """The whole model on one replica (see the module docstring)."""

    def __init__(self, run: RunConfig, store: TokenStore, data_shard: int, device: torch.device = CPU) -> None:
        super().__init__(run, store, data_shard)
        self.model = global_model(run).to(device)
        self.trainer = InnerTrainer(self.model, run.optim, run.total_inner_steps, device)
        self._make_methods()

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def train(self, t: int, steps: int, accumulation: int = 1) -> None:
        H = self.run.outer.inner_steps
        for i in range(steps):
            self.trainer.step = t * H + min(i, H - 1)
            first = t * STEP_STRIDE + i * accumulation
            self.trainer.train_accumulated([self.batches.batch(first + k) for k in range(accumulation)])


class SimVirtualReplica(SimReplica):
    """The run's S stages composed in one process, boundary messages encoded and decoded (module docstring)."""

    def __init__(self, run: RunConfig, store: TokenStore, data_shard: int, device: torch.device = CPU) -> None:
        super().__init__(run, store, data_shard)
        self.stages = [PipelineStage(run, s, device) for s in range(run.outer.stages)]
        self.sizes = microbatch_sizes(run.batch_size, run.pipeline.microbatches)
        self._make_methods()

    def modules(self) -> list[nn.Module]:
        return [stage.module for stage in self.stages]

    def load(self, theta: dict[str, Tensor], fixed: Tensor | None) -> None:
        """θ(t), then the projection a stage applies to its start point (the deltas are taken from there)."""
        super().load(theta, fixed)
        if self.run.pipeline.project_start:
            for stage in self.stages:
                stage.project()
            self.start = {name: p.detach().clone() for name, p in self._params().items()}

    def train(self, t: int, steps: int, accumulation: int = 1) -> None:
        H = self.run.outer.inner_steps
        self.boundary_bytes = 0
        batch = sum(self.sizes) * accumulation
        for i in range(steps):
            for k in range(accumulation):
                index = i * accumulation + k
                x, y = self.batches.batch(t * STEP_STRIDE + index)
                for j, (xj, yj) in enumerate(zip(torch.tensor_split(x, len(self.sizes)),
                                                 torch.tensor_split(y, len(self.sizes)), strict=True)):  # fmt: skip
                    self._microbatch((index, j), xj, yj, self.sizes[j] / batch)
            for stage in self.stages:
                stage.trainer.step = t * H + min(i, H - 1)
                stage.optimizer_step()

    def _microbatch(self, key: tuple[int, int], x: Tensor, y: Tensor, weight: float) -> None:
        """One microbatch forward through every boundary and back, as the stage peers exchange it."""
        first, *middle, last = self.stages
        message = first.forward(key, x, y)
        for stage in middle:
            self.boundary_bytes += len(message)
            message = stage.forward(key, *self._parsed(stage, message))
        self.boundary_bytes += len(message)
        values, tokens, targets = codec.parse_activations(last.fmt, message)
        _, grad = last.forward_backward_last(values, tokens, targets, weight)
        b, length = x.shape
        for stage in reversed([first, *middle]):
            self.boundary_bytes += len(grad)
            grad = stage.backward(key, codec.parse_gradients(stage.fmt, grad, b, length))
        assert grad is None, "stage 0 sends no gradient"

    @staticmethod
    def _parsed(stage: PipelineStage, message: bytes) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens, targets, values) of an incoming activation message, in `PipelineStage.forward`'s order."""
        values, tokens, targets = codec.parse_activations(stage.fmt, message)
        return tokens, targets, values
