"""Rank 0's side of a multi-device node: it starts the other ranks, speaks for the node in the swarm, and drives
every step the ranks take together (`collective.py`).

The ranks are this node's own processes, one per device (`python -m hetero_node.client.local.rank`): no launcher
to learn. They meet through a TCP store on loopback, say when their model is built, and then only follow rank 0's
commands. They end with it: on `close`, on a failed collective (rank 0 gone), or by the kernel's parent-death
signal when rank 0 is killed outright.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetero_node.client.local.collective import (
    EXIT,
    STEP,
    SYNC,
    backend_for,
    mean_loss,
    send_command,
    share_batches,
    share_state,
)
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)

STEP_TIMEOUT_S = 600.0
"""Longest rank 0 waits in one collective: a rank that does not answer by then is gone (its error ends the node)."""
READY_TIMEOUT_S = 600.0
"""Longest the ranks may take to build (and compile) their model."""
EXIT_WAIT_S = 10.0


def threads_per_rank(devices: list[torch.device]) -> int:
    """CPU ranks share the machine's cores; GPU ranks keep torch's default."""
    return max(1, (os.cpu_count() or 1) // len(devices)) if devices[0].type == "cpu" else 0


class LocalGroup:
    """Ranks 1…N−1 of this node; this process is rank 0 on `devices[0]`."""

    def __init__(self, run: RunConfig, devices: list[torch.device], compile: bool) -> None:
        self.device, self.world = devices[0], len(devices)
        self.shape = (run.batch_size, run.seq_len)
        threads = threads_per_rank(devices)
        if threads:
            torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False)
        spec = {"run": run.to_dict(), "port": store.port, "world": self.world, "compile": compile,
                "threads": threads, "parent": os.getpid()}  # fmt: skip
        command = [sys.executable, "-m", "hetero_node.client.local.rank"]
        self.ranks = [
            subprocess.Popen([*command, str(rank), str(device), json.dumps(spec)])
            for rank, device in enumerate(devices[1:], start=1)
        ]
        try:
            self._await_ready(store)
            dist.init_process_group(
                backend_for(self.device), store=store, rank=0, world_size=self.world,
                timeout=timedelta(seconds=STEP_TIMEOUT_S),
            )  # fmt: skip
        except BaseException:
            self._end_ranks()
            raise
        self._store = store  # the ranks' process group lives on it
        logger.info("training one replica on %d devices: %s", self.world, ", ".join(str(d) for d in devices))

    def _await_ready(self, store: dist.TCPStore) -> None:
        """Until every rank has built its model; a rank that exits first is a clear error, not a hang."""
        give_up = time.monotonic() + READY_TIMEOUT_S
        while not store.check([f"ready/{rank}" for rank in range(1, self.world)]):
            for rank, process in enumerate(self.ranks, start=1):
                if process.poll() is not None:
                    raise ConfigError(f"local rank {rank} exited with code {process.returncode} while starting")
            if time.monotonic() > give_up:
                raise ConfigError(f"the local ranks were not ready within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)

    def sync(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes this process's θ and optimizer state (after an outer step, a catch-up, a resume)."""
        self._check_ranks()
        send_command(self.device, SYNC)
        share_state(module, optimizer, self.device)

    def step(self, trainer: InnerTrainer, batches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One inner step of the node on `batches` (a multiple of the world size: rank r trains on the r-th slice;
        the trainer's gradient hook averages gradients); returns the mean loss over all of them."""
        self._check_ranks()
        per_rank = len(batches) // self.world
        send_command(self.device, STEP, trainer.step, per_rank)
        mine = share_batches(batches, per_rank, self.shape, self.device)
        return mean_loss(trainer.train_accumulated(mine))

    def _check_ranks(self) -> None:
        for rank, process in enumerate(self.ranks, start=1):
            if process.poll() is not None:
                raise RuntimeError(f"local rank {rank} exited with code {process.returncode}; the node stops")

    def close(self) -> None:
        """Tell the ranks to leave and wait for them; any still running after `EXIT_WAIT_S` is killed."""
        try:
            if all(process.poll() is None for process in self.ranks):
                send_command(self.device, EXIT)
        except RuntimeError as e:  # a rank already gone: the others end on the broken collective
            logger.warning("local ranks: %s", e)
        finally:
            self._end_ranks()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _end_ranks(self) -> None:
        give_up = time.monotonic() + EXIT_WAIT_S
        for process in self.ranks:
            try:
                process.wait(timeout=max(0.1, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
