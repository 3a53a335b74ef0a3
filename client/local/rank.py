"""A local rank of a multi-device node (`python -m hetero_node.client.local.rank RANK DEVICE SPEC`, started by
`group.LocalGroup`): it builds the run's model on its device, then follows rank 0's commands until told to leave.
It never talks to the swarm."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hetero_node.client.local.collective import (
    EXIT,
    STEP,
    SYNC,
    backend_for,
    mean_gradients,
    mean_loss,
    receive_command,
    share_batches,
    share_state,
)
from hetero_node.models.replica_model import full_model
from hetero_node.models.trainer import InnerTrainer
from hetero_node.protocol.run_config import RunConfig

IDLE_TIMEOUT = timedelta(days=7)
"""A rank waits for rank 0's next command as long as the node runs (catch-ups, waits for peers): it ends when rank 0
does (parent-death signal, or the collective failing), never on a timer."""
PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a node killed with SIGKILL leaves no rank
    behind; and ignore Ctrl-C, which the terminal sends the whole process group: the node decides when we leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody would ever kill us
        sys.exit(1)


def serve(rank: int, device: torch.device, spec: dict[str, Any]) -> None:
    """Build the model, say so, then train, sync or leave as rank 0 says."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = RunConfig.from_dict(spec["run"])
    model, _ = full_model(run, device)
    trainer = InnerTrainer(model, run.optim, run.total_inner_steps, device, spec["compile"], mean_gradients)
    shape = (run.batch_size, run.seq_len)
    if trainer.compiled:  # compile before the first step, as rank 0 does
        tokens = torch.zeros(shape, dtype=torch.int64)
        trainer.warm_up(tokens, tokens)
    store = dist.TCPStore("127.0.0.1", spec["port"], spec["world"], is_master=False)
    store.set(f"ready/{rank}", "1")  # rank 0 then forms the group with us
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=spec["world"],
                            timeout=IDLE_TIMEOUT)  # fmt: skip
    try:
        while True:
            command, step, per_rank = receive_command(device)
            if command == EXIT:
                return
            if command == SYNC:
                share_state(model, trainer.optimizer, device)
            elif command == STEP:
                trainer.step = step
                loss = trainer.train_accumulated(share_batches(None, per_rank, shape, device))
                mean_loss(loss)  # our part of the collective; rank 0 reports the mean
    finally:
        dist.destroy_process_group()


def main() -> None:
    rank, device, spec = int(sys.argv[1]), torch.device(sys.argv[2]), json.loads(sys.argv[3])
    die_with(spec["parent"])
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    serve(rank, device, spec)


if __name__ == "__main__":
    main()
