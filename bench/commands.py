"""The command line every process of a benchmark run starts with, per method: the CLI a user would type.

Swarm methods start `hetero-node bootstrap` with the run options and `hetero-node join` with node options only
(the joiner learns the run from the bootstrap); `ddp` starts one `hetero-node-lab ddp-rank` per node with the
same run options. Pure functions of the config, so they are unit-tested without a lab.
"""

from __future__ import annotations

import sys

from hetero_node.bench.config import BenchConfig
from hetero_node.bench.topology import NodeSpec, Topology

CLI = [sys.executable, "-m", "hetero_node.client.cli"]
LAB = [sys.executable, "-m", "hetero_node.bench"]
DDP = [*LAB, "--log-level", "INFO", "ddp-rank"]
BOOTSTRAP_PORT = 31337
"""Each lab node has a namespace of its own, so fixed ports never collide."""
DDP_PORT = 29500
SWARM_LOG_LEVEL = "INFO"

# Per swarm method: the role each node asks for (None: its topology role) and the bootstrap's extra run options.
SWARM_METHODS: dict[str, tuple[str | None, list[str]]] = {
    "diloco": ("full", ["--outer", "diloco", "--diloco-wire", "fp32"]),
    "sparseloco": ("full", ["--outer", "sparseloco"]),
    "hetero": (None, ["--activation-compression", "subspace"]),
    "compress-all": (None, ["--activation-compression", "compress-all"]),
}


def run_options(cfg: BenchConfig, method: str) -> list[str]:
    """The model, data and schedule every method shares (same preset, data, LR schedule), and its budget."""
    return [
        "--preset", cfg.preset, "--rounds", str(cfg.rounds_for(method)), "--inner-steps", str(cfg.inner_steps),
        "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len), "--stages", str(cfg.stages),
        "--lr", str(cfg.lr), "--warmup-steps", str(cfg.warmup_steps),
    ]  # fmt: skip


def bootstrap_argv(cfg: BenchConfig, method: str, address: str, identity: str) -> list[str]:
    extra = [*SWARM_METHODS[method][1], "--round-s", str(cfg.round_s), *(["--overlap"] if cfg.overlap else [])]
    if method in ("hetero", "compress-all"):
        extra += ["--subspace-rank", str(cfg.subspace_rank)]
    return [*CLI, "bootstrap", "--host", address, "--port", str(BOOTSTRAP_PORT), "--identity", identity,
            *run_options(cfg, method), *extra]  # fmt: skip


def node_role(method: str, spec: NodeSpec) -> str:
    return SWARM_METHODS[method][0] or spec.role


def expected_replicas(method: str, topology: Topology, stages: int) -> int:
    """How many replicas should be online before round 0 (`--min-peers`), so nobody starts alone.

    Under the planner (hetero) this is a guess: nodes that ask for `full` or are `auto` on the fastest links
    become full replicas, the rest virtual replicas of `stages` nodes each; compress-all makes every replica
    virtual.
    """
    if SWARM_METHODS[method][0] == "full":
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
    argv = [
        *CLI, "--log-level", SWARM_LOG_LEVEL, "join", "--peers", peers, "--host", address,
        "--role", node_role(method, spec), "--replica-id", str(index), "--metrics", metrics,
        "--min-peers", str(expected_replicas(method, topology, cfg.stages)),
        "--eval-batches", str(cfg.eval_batches), "--quiet",
    ]  # fmt: skip
    if spec.memory_gb is not None and node_role(method, spec) != "full":  # the planner decides: tell it
        argv += ["--memory-gb", f"{spec.memory_gb:g}"]
    if cfg.measure_bandwidth:
        return [*argv, "--remeasure-bandwidth"]
    return [*argv, "--bandwidth-mbps", f"{spec.link_mbit:g}"]


def ddp_argv(cfg: BenchConfig, rank: int, world_size: int, master_address: str, metrics: str) -> list[str]:
    return [
        *DDP, "--rank", str(rank), "--world-size", str(world_size), "--master", f"{master_address}:{DDP_PORT}",
        "--metrics", metrics, "--eval-batches", str(cfg.eval_batches), *run_options(cfg, "ddp"),
    ]  # fmt: skip
