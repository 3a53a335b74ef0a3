"""What the ranks of a multi-device node do together. Every function is a collective: each rank calls it in the
same order, rank 0 with its values, the others receiving them.

Data parallelism inside the node: rank 0 reads the step's batches and broadcasts their token ids (a few hundred
kilobytes), each rank trains on its slice, and the ranks average their gradients (one all-reduce per bucket) before
each identical AdamW step, so the node takes the step one process would take on all the batches. θ changes outside
the steps only on rank 0 (outer steps, catch-up, checkpoints): `share_state` hands it to the others before training.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn

EXIT, SYNC, STEP = 0, 1, 2
"""Commands rank 0 sends: leave, take rank 0's state, train one step."""
BUCKET_ELEMENTS = 1 << 24
"""Gradients are averaged in flat buckets of up to this many elements (64 MB of fp32): few collectives, and no
second copy of every gradient at once."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _on_wire(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` where the backend can move it: NCCL moves CUDA tensors only (AdamW keeps some steps on the CPU)."""
    return tensor.to(device) if device.type == "cuda" and tensor.device != device else tensor


def _broadcast_into(tensor: Tensor, device: torch.device) -> None:
    wire = _on_wire(tensor, device)
    dist.broadcast(wire, src=0)
    if wire is not tensor:
        tensor.copy_(wire)


def send_command(device: torch.device, command: int, step: int = 0, per_rank: int = 0) -> None:
    """Rank 0: tell the others what comes next (`step`: the inner step's position in the LR schedule)."""
    dist.broadcast(torch.tensor([command, step, per_rank], dtype=torch.int64, device=device), src=0)


def receive_command(device: torch.device) -> tuple[int, int, int]:
    """Ranks ≥ 1: (command, inner step, batches per rank), as rank 0 sent them."""
    header = torch.zeros(3, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    command, step, per_rank = header.tolist()
    return command, step, per_rank


def share_batches(
    batches: list[tuple[Tensor, Tensor]] | None, per_rank: int, shape: tuple[int, int], device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """This rank's `per_rank` batches of the step: rank 0 passes all of them (rank r's are the r-th slice),
    the others None and the batch shape (B, T)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if batches is not None:
        ids = torch.stack([torch.stack(pair) for pair in batches]).to(device)
    else:
        ids = torch.zeros((per_rank * world, 2, *shape), dtype=torch.int64, device=device)
    dist.broadcast(ids, src=0)
    return [(pair[0], pair[1]) for pair in ids[rank * per_rank : (rank + 1) * per_rank]]


def mean_gradients(module: nn.Module) -> None:
    """Replace every rank's gradients by their mean over the ranks (called before clipping and the AdamW step)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for p in module.parameters():
        if p.grad is not None:
            by_dtype[p.grad.dtype].append(p.grad)
    for grads in by_dtype.values():
        bucket: list[Tensor] = []
        for grad in grads:
            bucket.append(grad)
            if sum(g.numel() for g in bucket) >= BUCKET_ELEMENTS:
                average(bucket)
                bucket = []
        if bucket:
            average(bucket)


def average(tensors: list[Tensor]) -> int:
    """Replace each of `tensors` (one dtype) by its mean over the ranks, in one all-reduce of a flat copy; returns
    the bytes of that buffer."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel() * flat.element_size()


def mean_loss(loss: Tensor) -> Tensor:
    """The step's loss over every rank's batches (a device tensor: nobody waits for it here)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def share_state(module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """θ, buffers (T_fixed) and the optimizer's moments as rank 0 holds them, on every rank. The moments' layout is
    sent first: rank 0 may hold moments the others never made (it resumed from a checkpoint before any step)."""
    for tensor in module.state_dict().values():
        _broadcast_into(tensor, device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layout: list[list[tuple[str, tuple[int, ...], str, bool]]] | None = None
    if dist.get_rank() == 0:
        layout = [
            [(k, tuple(v.shape), str(v.dtype), v.device.type == "cpu") for k, v in sorted(optimizer.state[p].items())]
            for p in params
        ]
    holder = [layout]
    dist.broadcast_object_list(holder, src=0, device=device)
    for p, entries in zip(params, holder[0] or [], strict=True):
        state = optimizer.state[p]
        for key, shape, dtype, on_cpu in entries:
            if key not in state:
                kind = getattr(torch, dtype.removeprefix("torch."))
                state[key] = torch.zeros(shape, dtype=kind, device="cpu" if on_cpu else p.device)
            _broadcast_into(state[key], device)
