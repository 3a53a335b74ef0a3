"""Helpers of the multi-peer tests: the tests' run definition, node command lines, reading metrics, waiting."""

from __future__ import annotations

import dataclasses
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hetero_node.bootstrap.config import BootstrapConfig, RelayConfig
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, read_checkpoint
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig


def with_fields(configs: tuple[Any, ...], **values: Any) -> tuple[Any, ...]:
    """`configs` with each value given to the one config that has a field of its name."""
    owners = {f.name: i for i, config in enumerate(configs) for f in dataclasses.fields(config)}
    unknown = set(values) - set(owners)
    assert not unknown, f"no option of the command is named {sorted(unknown)}"
    return tuple(
        dataclasses.replace(config, **{k: v for k, v in values.items() if owners[k] == i})
        for i, config in enumerate(configs)
    )


def run_args(
    rounds: int, inner_steps: int = 8, preset: str = "tiny", target_utilisation: float = 0.0, **fields: Any
) -> list[str]:
    """The tests' run definition; the bootstrap announces it and replicas adopt it. By default rounds of H steps
    (or `--round-s`), not stretched to a utilisation target: short rounds keep the suite short (the target has its
    own test, `test_round_sizing.py`). `fields` set any other option of `bootstrap` (`round_s=4`, `swarm_key=...`)."""
    run = RunOptions(preset=preset, batch_size=8, seq_len=64)
    outer = OuterConfig(rounds=rounds, inner_steps=inner_steps, stages=2, target_utilisation=target_utilisation)
    configs = (run, outer, OptimConfig(warmup_steps=5, lr=3e-3), SparseLoCoConfig(), PipelineConfig())
    return to_argv(*with_fields((*configs, BootstrapConfig(), RelayConfig()), **fields))


def join_args(
    peers: str, index: int, workdir: Path, role: str = "full", stage: int | None = None, quiet: bool = True,
    **fields: Any,
) -> list[str]:  # fmt: skip
    """Replica `index`'s node options (no run options: it learns the run from the bootstrap); `fields` set any
    other node option (`min_peers=2`, `host=...`)."""
    node = NodeConfig(
        peers=[peers], replica_id=index, record_refresh_s=3, settle_s=1, bandwidth_mbps=1000,
        metrics=workdir / f"r{index}.jsonl", checkpoint_dir=workdir / f"r{index}.ckpt",
    )  # fmt: skip
    timeouts = SyncTimeouts(matchmaking_s=3, round_timeout_s=20, fetch_timeout_s=10)
    place = ["--role", role, *(["--stage", str(stage)] if stage is not None else [])]
    options = to_argv(*with_fields((node, timeouts, RelayConfig()), **fields))
    return ["--log-level", "INFO", "join", *place, *options, *(["--quiet"] if quiet else [])]


def start_replicas(
    swarm: LocalSwarm, count: int, workdir: Path, rounds: int, inner_steps: int = 8,
    run_extra: dict[str, Any] | None = None, **node_extra: Any,
) -> str:  # fmt: skip
    """A bootstrap plus replicas r0..r{count-1} of one run; returns the bootstrap's multiaddr for later joiners."""
    peers = swarm.start_bootstrap(run_args(rounds, inner_steps, **(run_extra or {})))
    node_extra.setdefault("min_peers", count)  # start together: processes take seconds to import on 2 cores
    for i in range(count):
        swarm.start(f"r{i}", join_args(peers, i, workdir, **node_extra))
    return peers


def eval_losses(replicas: list[dict[int, dict[str, Any]]], rounds: range) -> dict[int, float]:
    """Each round's eval loss, from whichever full replicas computed it: all evaluate the same θ(t+1), and one that
    rebuilt the round from its messages, or was behind the next deadline, leaves it to the others."""
    losses = {t: [r[t]["eval_loss"] for r in replicas if r[t]["eval_loss"] is not None] for t in rounds}
    assert all(v and max(v) - min(v) < 1e-3 for v in losses.values()), f"missing or disagreeing eval losses: {losses}"
    return {t: v[0] for t, v in losses.items()}


def rounds_of(workdir: Path, index: int) -> dict[int, dict[str, Any]]:
    """Replica `index`'s round records by round (a restarted replica's later record wins)."""
    return {r["round"]: r for r in read_metrics(workdir / f"r{index}.jsonl")[1]}


def wait_for_round(workdir: Path, index: int, round_: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if round_ in rounds_of(workdir, index):
            return
        time.sleep(0.2)
    raise AssertionError(f"replica {index} did not complete round {round_} within {timeout} s")


def assert_all_exit_cleanly(swarm: LocalSwarm, names: list[str], timeout: float = 240.0) -> None:
    for name in names:
        code = swarm.wait(name, timeout)
        assert code == 0, f"{name} exited with {code}; log:\n{swarm.log_path(name).read_text()[-3000:]}"


def ef_fingerprint(checkpoint_dir: Path) -> str:
    """Fingerprint of the error-feedback buffers in a checkpoint, as the node logs it when it resumes."""
    state = read_checkpoint(checkpoint_dir / CHECKPOINT_NAME)
    return fingerprint([b for sync in state["syncs"] for b in sync["error_feedback"]["buffers"]])


def probe(url: str) -> tuple[int, str]:
    """(HTTP status, body) of a node's HTTP endpoint; a 503 is an answer here, not an error, and status 0 means
    nothing listens there yet."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except urllib.error.URLError as e:
        return 0, str(e.reason)
