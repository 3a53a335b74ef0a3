"""A multi-device node (`--devices`) trains one replica on several local ranks: here two gloo ranks on the CPU.
The node's step is the step one process takes on all the batches (rank 1's batches and gradients count), every
rank ends with the same θ and optimizer state, a resumed rank 0 hands its state to the others, and the ranks end
with the node, however it ends."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from factories import run_config
from swarm_helpers import assert_all_exit_cleanly, join_args, rounds_of, run_args, wait_for_round

from hetero_node.bench.local_ranks import random_batches
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.local.collective import mean_gradients
from hetero_node.client.local.devices import resolve_devices
from hetero_node.client.local.group import LocalGroup
from hetero_node.models.replica_model import full_model
from hetero_node.models.shards import fingerprint
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.errors import ConfigError

CPU = torch.device("cpu")


def trainer_state(trainer: InnerTrainer) -> str:
    moments = [v for state in trainer.optimizer.state.values() for k, v in sorted(state.items()) if v.dim() > 0]
    return fingerprint([*trainer.model.state_dict().values(), *moments])


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("cpu,cuda:0", "all CUDA devices or all CPU"),
        ("cpu,,cpu", "name each device"),
        ("auto,cpu", "name each device"),
        ("gpu0", "is not a device"),
    ],
)
def test_a_malformed_device_list_is_a_clear_error(devices: str, message: str) -> None:
    if "cuda" in devices and not torch.cuda.is_available():
        message = "no CUDA device"
    with pytest.raises(ConfigError, match=message):
        resolve_devices("auto", devices)


def test_a_device_list_names_the_ranks() -> None:
    assert resolve_devices("cpu", "") == [CPU]
    assert resolve_devices("auto", " cpu , cpu ") == [CPU, CPU]
    if torch.cuda.is_available():
        assert resolve_devices("cpu", "all") == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_devices("cpu", "all")


GPUS = torch.cuda.device_count()
DEVICE_PAIRS = [
    pytest.param([CPU, CPU], 1e-5, id="gloo-cpu"),
    pytest.param(
        [torch.device("cuda", 0), torch.device("cuda", 1)], 2e-3, id="nccl-2-gpus",
        marks=pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (NCCL refuses two ranks on one); {GPUS} here"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("devices", "tolerance"), DEVICE_PAIRS)
def test_two_ranks_take_the_step_one_process_takes_on_all_their_batches(
    devices: list[torch.device], tolerance: float
) -> None:
    run = run_config()
    device = devices[0]
    alone, _ = full_model(run, device)
    reference = InnerTrainer(alone, run.optim, run.total_inner_steps, device)
    model, _ = full_model(run, device)
    trainer = InnerTrainer(model, run.optim, run.total_inner_steps, device, gradient_hook=mean_gradients)
    group = LocalGroup(run, devices, compile=False)
    try:
        group.sync(model, trainer.optimizer)
        for step in range(3):
            data = random_batches(4, seed=step)  # 2 per rank
            reference.step = trainer.step = step
            expected = reference.train_accumulated(data)
            got = group.step(trainer, data)
            assert torch.allclose(got, expected, atol=tolerance), "the loss is not the mean over both ranks' batches"
        for ours, theirs in zip(model.parameters(), alone.parameters(), strict=True):
            assert torch.allclose(ours, theirs, atol=tolerance), "rank 1's gradients did not count"
        initial = full_model(run, device)[0].parameters()
        assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), initial, strict=True)), "no step"
    finally:
        group.close()
    assert [p.returncode for p in group.ranks] == [0], "the rank did not leave cleanly when told to"


def test_a_resumed_rank_0_hands_its_state_to_the_other_ranks() -> None:
    """Rank 0 resumes θ and AdamW moments the other rank never made; after `sync`, both ranks step alike: two
    nodes (one of them resumed) from the same state take the same step."""
    run = run_config()
    source, _ = full_model(run, CPU)
    source_trainer = InnerTrainer(source, run.optim, run.total_inner_steps, CPU)
    source_trainer.train_accumulated(random_batches(2, seed=7))  # moments exist now
    model, _ = full_model(run, CPU)
    trainer = InnerTrainer(model, run.optim, run.total_inner_steps, CPU, gradient_hook=mean_gradients)
    model.load_state_dict(source.state_dict())
    trainer.load_state_dict(copy.deepcopy(source_trainer.state_dict()))  # loading keeps the tensors it is given
    group = LocalGroup(run, [CPU, CPU], compile=False)
    try:
        group.sync(model, trainer.optimizer)
        data = random_batches(2, seed=8)
        source_trainer.step = trainer.step = 1
        source_trainer.train_accumulated(data)
        group.step(trainer, data)
        for ours, theirs in zip(model.parameters(), source.parameters(), strict=True):
            assert torch.allclose(ours, theirs, atol=1e-5), "rank 1 did not step from rank 0's resumed state"
    finally:
        group.close()


KILLED_NODE = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
from factories import run_config
from hetero_node.client.local.group import LocalGroup
group = LocalGroup(run_config(), [torch.device("cpu")] * 2, compile=False)
print(*(p.pid for p in group.ranks), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killing_the_node_ends_its_ranks() -> None:
    tests = os.path.dirname(__file__)
    node = subprocess.Popen([sys.executable, "-c", KILLED_NODE.format(tests=tests)], stdout=subprocess.PIPE, text=True)
    try:
        line = node.stdout.readline() if node.stdout else ""
        ranks = [int(pid) for pid in line.split()]
        assert ranks and all(alive(pid) for pid in ranks), f"the ranks did not start: {line!r}"
        node.send_signal(signal.SIGKILL)
        node.wait()
        give_up = time.monotonic() + 20
        while any(alive(pid) for pid in ranks) and time.monotonic() < give_up:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in ranks), "a local rank outlived its node"
    finally:
        node.kill()


def test_the_local_ranks_bench_reports_agreeing_weights(tmp_path: Path) -> None:
    from hetero_node.bench.config import LocalRanksConfig
    from hetero_node.bench.local_ranks import run_local_ranks

    report = run_local_ranks(LocalRanksConfig(steps=2, out=tmp_path))
    assert report["devices"] == ["cpu", "cpu"] and report["node_tokens_per_s"] > 0 and report["speedup"] > 0
    assert report["max_weight_difference"] < 1e-5
    assert "One replica on 2 local devices" in (tmp_path / "report.md").read_text()


ROUNDS = 3
STEPS = 6


@pytest.mark.multipeer
def test_a_two_rank_node_is_one_member_of_the_swarm(tmp_path: Path) -> None:
    """A node on two CPU ranks next to a single-process full replica, loopback: one record (advertising both
    ranks), one member of each round's set, both contribute every round, their θ agrees, and the two-rank node
    trains twice the tokens per step (rank 1's batches count)."""
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(run_args(ROUNDS, STEPS, min_inner_steps=STEPS, max_inner_steps=STEPS))
        swarm.start("r0", join_args(peers, 0, tmp_path, min_peers=2, devices="cpu,cpu"))
        swarm.start("r1", join_args(peers, 1, tmp_path, min_peers=2))
        wait_for_round(tmp_path, 0, 0)
        status = subprocess.run(
            [sys.executable, "-m", "hetero_node.client.cli", "status", "--peers", peers, "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert_all_exit_cleanly(swarm, ["r0", "r1"])
    records = json.loads(status.stdout)["peers"]
    assert sorted(r["devices"] for r in records) == [1, 2], f"not one record per node: {records}"
    node, single = rounds_of(tmp_path, 0), rounds_of(tmp_path, 1)
    for t in range(ROUNDS):
        assert node[t]["fingerprints"] == single[t]["fingerprints"], f"round {t} disagrees"
        assert node[t]["contributed"] and single[t]["contributed"], f"round {t}: a member did not contribute"
        assert node[t]["contributors"] == 2, f"round {t}: the node was not one member: {node[t]}"
        assert node[t]["inner_steps"] == single[t]["inner_steps"] == STEPS
        assert node[t]["tokens"] == 2 * single[t]["tokens"], f"round {t}: rank 1's tokens are not the node's"
