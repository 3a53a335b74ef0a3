"""The command line every process of a benchmark run starts with, per method: the CLI a user would type.

Swarm methods start `hetero-node bootstrap` with the run options and `hetero-node join` with node options only
(the joiner learns the run from the bootstrap); `ddp` starts one `hetero-node-lab ddp-rank` per node with the
same run options. Pure functions of the config, so they are unit-tested without a lab.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hetero_node.bench.config import BenchConfig, DDPWorkerConfig
from hetero_node.bench.topology import NodeSpec, Topology
from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig

CLI = [sys.executable, "-m", "hetero_node.client.cli"]
LAB = [sys.executable, "-m", "hetero_node.bench"]
DDP = [*LAB, "--log-level", "INFO", "ddp-rank"]
BOOTSTRAP_PORT = 31337
"""Each lab node has a namespace of its own, so fixed ports never collide."""
DDP_PORT = 29500
SWARM_LOG_LEVEL = "INFO"

SWARM_METHODS: dict[str, str | None] = {"diloco": "full", "sparseloco": "full", "hetero": None, "compress-all": None}
"""Per swarm method, the role each node asks for (None: its topology role)."""


def run_configs(cfg: BenchConfig, method: str) -> tuple[RunOptions, OuterConfig, OptimConfig]:
    """The model, data and schedule every method shares (same preset, data, LR schedule), and its budget."""
    return (
        RunOptions(preset=cfg.preset, batch_size=cfg.batch_size, seq_len=cfg.seq_len),
        OuterConfig(rounds=cfg.rounds_for(method), inner_steps=cfg.inner_steps, stages=cfg.stages),
        OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps),
    )


def method_configs(cfg: BenchConfig, method: str) -> tuple[RunOptions, OuterConfig, OptimConfig, PipelineConfig]:
    """A swarm method's run: the shared part, its outer method or boundaries, and the rounds' timing."""
    run, outer, optim = run_configs(cfg, method)
    outer = dataclasses.replace(
        outer, round_s=cfg.round_s, overlap=cfg.overlap, target_utilisation=cfg.target_utilisation
    )
    pipeline = PipelineConfig()
    if method == "diloco":  # the mean rule only
        outer = dataclasses.replace(outer, outer="diloco", diloco_wire="fp32")
    elif method == "sparseloco":
        outer = dataclasses.replace(outer, outer="sparseloco", aggregation=cfg.aggregation)
    else:  # the planner's virtual replicas (hetero), or every replica one (compress-all)
        compression = "subspace" if method == "hetero" else "compress-all"
        outer = dataclasses.replace(outer, aggregation=cfg.aggregation)
        pipeline = PipelineConfig(activation_compression=compression, subspace_rank=cfg.subspace_rank)
    return run, outer, optim, pipeline


def bootstrap_argv(cfg: BenchConfig, method: str, address: str, identity: str) -> list[str]:
    where = BootstrapConfig(host=address, port=BOOTSTRAP_PORT, identity=Path(identity))
    return [*CLI, "bootstrap", *to_argv(where, *method_configs(cfg, method), explicit={"port", "aggregation"})]


def node_role(method: str, spec: NodeSpec) -> str:
    return SWARM_METHODS[method] or spec.role


def expected_replicas(method: str, topology: Topology, stages: int) -> int:
    """How many replicas should be online before round 0 (`--min-peers`), so nobody starts alone.

    Under the planner (hetero) this is a guess: nodes that ask for `full` or are `auto` on the fastest links
    become full replicas, the rest virtual replicas of `stages` nodes each; compress-all makes every replica
    virtual.
    """
    if SWARM_METHODS[method] == "full":
        return len(topology.nodes)
    edges = set(topology.edge_nodes)
    full = 0 if method == "compress-all" else sum(
        1 for n in topology.nodes if n.role == "full" or (n.role == "auto" and n.name not in edges)
    )  # fmt: skip
    return max(1, full + (len(topology.nodes) - full) // stages)


def join_argv(
    cfg: BenchConfig, method: str, topology: Topology, index: int, address: str, peers: str, metrics: str
) -> list[str]:
    spec = topology.nodes[index]
    role = node_role(method, spec)
    node = NodeConfig(
        peers=[peers], host=address, replica_id=index, metrics=Path(metrics), eval_batches=cfg.eval_batches,
        min_peers=expected_replicas(method, topology, cfg.stages),
        memory_gb=spec.memory_gb if role != "full" else None,  # the planner decides: tell it
        remeasure_bandwidth=cfg.measure_bandwidth, bandwidth_mbps=None if cfg.measure_bandwidth else spec.link_mbit,
    )  # fmt: skip
    return [*CLI, "--log-level", SWARM_LOG_LEVEL, "join", "--role", role, *to_argv(node), "--quiet"]


def ddp_argv(cfg: BenchConfig, rank: int, world_size: int, master_address: str, metrics: str) -> list[str]:
    worker = DDPWorkerConfig(
        rank=rank, world_size=world_size, master=f"{master_address}:{DDP_PORT}", metrics=Path(metrics),
        eval_batches=cfg.eval_batches,
    )  # fmt: skip
    return [*DDP, *to_argv(worker, *run_configs(cfg, "ddp"))]
