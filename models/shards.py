"""Parameter shards: the parameters one pipeline stage owns, the unit replicas average across the swarm.

Full replicas hold every shard, a stage peer holds one; all-reduce groups, pseudo-gradients and fingerprints are
per shard, so every peer must list a shard's tensors in the same order. That order is the order of
`named_parameters()` of the stage module, which is the model's definition order:

    embed.weight                                   (shard 0 only)
    for each owned layer i, ascending:
        layers.{i}.attn_norm.weight, layers.{i}.attn.wq/wk/wv/wo.weight,
        layers.{i}.mlp_norm.weight, layers.{i}.mlp.w_gate/w_up/w_down.weight
    norm.weight, head.weight                       (last shard only; a tied head is embed.weight, listed once)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import blake3
import numpy as np
import torch
from torch import nn

from hetero_node.models.config import ModelConfig
from hetero_node.models.meta import on_meta
from hetero_node.models.stages import StageModule


def shard_parameter_names(cfg: ModelConfig, n_stages: int) -> list[list[str]]:
    """Global parameter names of each stage's shard, in the documented order (built on the meta device: no memory)."""
    with on_meta():
        stages = [StageModule(cfg, s, n_stages) for s in range(n_stages)]
    return [[name for name, _ in stage.named_parameters()] for stage in stages]


def shard_tensors(module: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """The named parameters of `module` (a full model or a stage) in the order of `names`; KeyError if one is absent."""
    params = dict(module.named_parameters())
    return [params[name] for name in names]


def fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """128-bit BLAKE3 hex digest of the dtype, shape and raw bytes of each tensor, in order.

    Peers compare it after every outer step to prove they hold bit-identical weights, and a joiner checks a donor's
    state against it, so it must stay a cryptographic hash. BLAKE3 on all cores hashes a shard of a 178M-parameter
    model in tens of milliseconds where BLAKE2b took most of a second; hashing the bytes in place (a uint8 view, no
    serialisation) keeps it at hash speed. A tensor on a GPU is hashed from its bytes on the host (`_host_bytes`),
    so the digest does not depend on the device.
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        for piece in _host_bytes(t.detach()):
            h.update(piece)
    return h.hexdigest(length=16)


STAGING_BYTES = 16 << 20
"""Size of each of the two pinned buffers a device tensor's bytes pass through on their way to the hash."""
_staging = threading.local()


def _host_bytes(t: torch.Tensor) -> Iterator[np.ndarray]:
    """The raw bytes of `t` on the host, in order, in pieces (streamed into a hash, pieces give the digest of the
    whole). A CPU tensor's bytes in place; a device tensor's through two pinned buffers of this thread, the next
    piece copying while the caller hashes this one (fingerprinting a 178m shard on an H200: 0.05 s; 0.24 s with a
    fresh pageable copy of every tensor)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cuda":
        yield flat.to("cpu").numpy()
        return
    if getattr(_staging, "buffers", None) is None:
        _staging.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    buffers, copied = _staging.buffers, [torch.cuda.Event(), torch.cuda.Event()]
    stream, starts = torch.cuda.current_stream(flat.device), range(0, flat.numel(), STAGING_BYTES)

    def copy(i: int) -> None:  # on the stream that wrote the tensor: after its pending writes
        piece = flat[starts[i] : starts[i] + STAGING_BYTES]
        buffers[i % 2][: piece.numel()].copy_(piece, non_blocking=True)
        copied[i % 2].record(stream)

    if starts:
        copy(0)
    for i, start in enumerate(starts):
        if i + 1 < len(starts):
            copy(i + 1)  # the other buffer: its last piece was hashed before this one was yielded
        copied[i % 2].synchronize()
        yield buffers[i % 2][: min(STAGING_BYTES, flat.numel() - start)].numpy()
