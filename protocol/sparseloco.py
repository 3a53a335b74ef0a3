"""SparseLoCo compression: error feedback, chunked top-k, 2-bit values (Sarfi et al. 2025, arXiv 2508.15706).

Every replica keeps a decayed error-feedback buffer per tensor. Each round it adds its pseudo-gradient, sends
only the largest-magnitude entries of every chunk (k of them, 2 bits per value plus a 12-bit in-chunk index)
and keeps the rest, quantization error included, for later rounds. The decayed buffer plays the role of
DiLoCo's outer momentum: nothing is lost, only delayed.

What peers must agree on bit for bit lives here: how a tensor is cut into chunks, how many entries a chunk
keeps, the order of transmitted entries, and how codes decode to values. The byte layout is in
`sparse_codec`; how contributions are combined is in `aggregation`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hetero_node.protocol.errors import CheckpointError, PayloadError
from hetero_node.protocol.run_config import MAX_CHUNK, SparseLoCoConfig

LEVELS = 4
"""Number of 2-bit codes; the quantizer is centred on code 2."""


# ------------------------------------------------------------------------------------------------- chunking


def chunk_k(length: int, chunk: int, topk: int) -> int:
    """Entries kept in a chunk of `length` entries.

    Every chunk, tails and odd-sized blocks included, keeps the density topk/chunk²: k is the even number
    nearest to length·topk/chunk² (even so that indices pack two per 3 bytes). A chunk still keeps at least
    2 entries (1 if it has only one), so short chunks are sent denser than full ones; at the defaults that
    only happens below 96 entries, and a 1-D tail costs at most one extra pair.
    """
    if length <= 1:
        return length
    k = 2 * max(1, math.floor(length * topk / (chunk * chunk) / 2 + 0.5))
    return min(k, length - length % 2)


def _largest_divisor_at_most(n: int, bound: int) -> int:
    return next(d for d in range(min(n, bound), 0, -1) if n % d == 0)


@dataclass(frozen=True)
class ChunkGroup:
    """`count` chunks of `length` entries each, `k` of which are sent per chunk."""

    count: int
    length: int
    k: int


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor shape is cut into chunks; every peer derives the same plan from (shape, chunk, topk).

    Matrices (and tensors of more dims, seen as first dim × the rest) are cut into h×w blocks, h and w the
    largest divisors of rows and cols that are ≤ chunk; an entry's in-chunk index is r·w + c inside its
    block, blocks numbered row-major. Vectors and scalars are cut into runs of chunk² entries, the last run
    possibly shorter. Transmitted entries are ordered by chunk, then by ascending in-chunk index.
    """

    shape: tuple[int, ...]
    groups: tuple[ChunkGroup, ...]
    block: tuple[int, int] | None
    """(h, w) for matrices, None for vectors."""
    cols: int
    """Columns of the matrix view (matrices) or the run length chunk² (vectors)."""

    @property
    def num_selected(self) -> int:
        return sum(g.count * g.k for g in self.groups)

    def chunk_rows(self, flat: Tensor) -> list[Tensor]:
        """The flat tensor as one (count, length) matrix per group, one chunk per row (a copy for matrices)."""
        if self.block is not None:
            (h, w), rows = self.block, flat.numel() // self.cols
            return [flat.view(rows // h, h, self.cols // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)]
        out, start = [], 0
        for g in self.groups:
            out.append(flat[start : start + g.count * g.length].view(g.count, g.length))
            start += g.count * g.length
        return out

    def _per_entry(self, per_chunk: list[Tensor]) -> Tensor:
        """Spread one int64 per chunk (a tensor per group) to one per transmitted entry, in transmission order."""
        parts = [values.repeat_interleave(g.k) for g, values in zip(self.groups, per_chunk, strict=True)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    @functools.cached_property
    def entry_origins(self) -> Tensor:
        """Flat position of the first entry (top-left corner) of each transmitted entry's chunk. Read-only."""
        if self.block is None:
            starts, origins = 0, []
            for g in self.groups:
                origins.append(starts + torch.arange(g.count, dtype=torch.int64) * g.length)
                starts += g.count * g.length
            return self._per_entry(origins)
        (h, w), chunk = self.block, torch.arange(self.groups[0].count, dtype=torch.int64)
        blocks_per_row = self.cols // w
        return self._per_entry([(chunk // blocks_per_row) * h * self.cols + (chunk % blocks_per_row) * w])

    def group_rows(self, entries: Tensor) -> list[tuple[ChunkGroup, Tensor]]:
        """One value per transmitted entry (in transmission order) as a (count, k) view per group, a chunk per row."""
        out, start = [], 0
        for g in self.groups:
            out.append((g, entries[start : start + g.count * g.k].view(g.count, g.k)))
            start += g.count * g.k
        return out

    def positions(self, indices: Tensor, device: torch.device | str = "cpu") -> Tensor:
        """Flat row-major positions in the tensor of the transmitted entries, given their in-chunk indices, computed
        on `device` (exact integer arithmetic: the same on every device; on a GPU the int16 indices travel instead of
        int64 positions, and the device does the arithmetic)."""
        idx = indices.to(device=device, dtype=torch.int64)
        origins = _entry_origins_on(self, idx.device)
        if self.block is None:
            return origins + idx
        w = self.block[1]
        return origins + (idx // w) * self.cols + idx % w


@functools.lru_cache(maxsize=256)
def _entry_origins_on(plan: ChunkPlan, device: torch.device) -> Tensor:
    """`plan.entry_origins` on `device`, uploaded once (a model has few distinct shapes)."""
    return plan.entry_origins.to(device)


@functools.lru_cache(maxsize=4096)
def chunk_plan(shape: tuple[int, ...], chunk: int, topk: int) -> ChunkPlan:
    """The chunk plan of a shape (cached: a model has few distinct shapes)."""
    numel = math.prod(shape)
    if len(shape) >= 2 and numel > 0:
        rows, cols = shape[0], numel // shape[0]
        h, w = _largest_divisor_at_most(rows, chunk), _largest_divisor_at_most(cols, chunk)
        group = ChunkGroup(count=(rows // h) * (cols // w), length=h * w, k=chunk_k(h * w, chunk, topk))
        return ChunkPlan(shape=shape, groups=(group,), block=(h, w), cols=cols)
    span = chunk * chunk
    full, tail = divmod(numel, span)
    groups = [ChunkGroup(full, span, chunk_k(span, chunk, topk))] if full else []
    if tail:
        groups.append(ChunkGroup(1, tail, chunk_k(tail, chunk, topk)))
    return ChunkPlan(shape=shape, groups=tuple(groups), block=None, cols=span)


# -------------------------------------------------------------------------------------------------- message


@dataclass(frozen=True, eq=False)
class CompressedTensor:
    """One tensor's transmitted part: which entry of each chunk, and its 2-bit code.

    `mean` and `lookup` are fp32 values (stored as Python floats); entry i decodes to
    fp32(lookup[codes[i]]) + fp32(mean), computed in fp32 by `dequantize`.
    """

    shape: tuple[int, ...]
    indices: Tensor
    """int16 in-chunk indices, in the plan's transmission order (chunk by chunk, ascending inside a chunk)."""
    codes: Tensor
    """uint8 codes in 0..3, one per index."""
    mean: float
    lookup: tuple[float, float, float, float]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompressedTensor):
            return NotImplemented
        return (
            self.shape == other.shape
            and _same_floats((self.mean, *self.lookup), (other.mean, *other.lookup))
            and torch.equal(self.indices, other.indices)
            and torch.equal(self.codes, other.codes)
        )


def _same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    """Equality that treats NaN as equal to NaN: a message holding NaN must still equal its own decode."""
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class SparseMessage:
    """What one replica sends for one parameter shard: one `CompressedTensor` per tensor, in shard order.

    It records the `chunk`/`topk` it was cut with, so a receiver can place its entries without its own config.
    """

    chunk: int
    topk: int
    tensors: tuple[CompressedTensor, ...]

    def plan(self, i: int) -> ChunkPlan:
        return chunk_plan(self.tensors[i].shape, self.chunk, self.topk)


def decode_table(part: CompressedTensor) -> Tensor:
    """The fp32 value each code decodes to: lookup + mean, added in fp32 so every peer gets the same bits."""
    return torch.tensor(part.lookup, dtype=torch.float32) + torch.tensor(part.mean, dtype=torch.float32)


def dequantize(part: CompressedTensor, device: torch.device | str = "cpu") -> Tensor:
    """The transmitted values of one tensor (fp32, on `device`), in transmission order: table lookups, the same bits
    on every device (on a GPU the uint8 codes travel, not fp32 values)."""
    table = decode_table(part).to(device)
    return table.index_select(0, part.codes.to(device=table.device, dtype=torch.int64))


def decompress(msg: SparseMessage) -> list[Tensor]:
    """Dense fp32 CPU tensors: the dequantized transmitted values in place, zeros elsewhere."""
    out = []
    for i, part in enumerate(msg.tensors):
        dense = torch.zeros(part.shape, dtype=torch.float32)
        dense.view(-1)[msg.plan(i).positions(part.indices)] = dequantize(part)
        out.append(dense)
    return out


@dataclass(frozen=True)
class ShardEntries:
    """Where every entry of a shard's messages lands, precomputed on one device for the whole shard, so placing a
    message costs one upload of its indices and codes and a few kernels (per tensor it was ~10 launches and 3
    small uploads: 82 tensors per 178m shard). Per transmitted entry, in message order (tensor by tensor):"""

    origins: Tensor
    """int64: position in the shard (its tensors flattened and laid end to end) of the entry's chunk's first entry."""
    widths: Tensor
    """int64: the block width w of a matrix's entry; for a vector's, a value above every index (so idx // w is 0)."""
    cols: Tensor
    """int64: the row length of a matrix's entry (0 for a vector's)."""
    table_base: Tensor
    """int64: 4 × the index of the entry's tensor, where its decode table starts in the message's stacked tables."""

    def place(self, msg: SparseMessage) -> tuple[Tensor, Tensor]:
        """Shard positions and fp32 values of every entry `msg` (validated for these shapes) transmits: the same
        integer arithmetic and table lookups as `ChunkPlan.positions` and `dequantize`, hence the same bits."""
        device = self.origins.device
        idx = torch.cat([p.indices for p in msg.tensors]).to(device=device).to(torch.int64)
        codes = torch.cat([p.codes for p in msg.tensors]).to(device=device).to(torch.int64)
        tables = torch.stack([decode_table(p) for p in msg.tensors]).view(-1).to(device)
        positions = self.origins + (idx // self.widths) * self.cols + idx % self.widths
        return positions, tables.index_select(0, self.table_base + codes)


def shard_views(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """A shard-long flat tensor (its tensors flattened and laid end to end, as `ShardEntries` places them) as one
    view per tensor."""
    numels = [math.prod(shape) for shape in shapes]
    return [part.view(tuple(shape)) for part, shape in zip(flat.split(numels), shapes, strict=True)]


@functools.lru_cache(maxsize=16)
def shard_entries(shapes: tuple[tuple[int, ...], ...], chunk: int, topk: int, device: torch.device) -> ShardEntries:
    """The `ShardEntries` of a shard of `shapes` on `device` (cached: a node has a few shards; ~32 bytes per sent
    entry, 44 MB for a 178m shard)."""
    origins, widths, cols, table_base, start = [], [], [], [], 0
    beyond_any_index = 1 << 16
    for t, shape in enumerate(shapes):
        plan = chunk_plan(shape, chunk, topk)
        n = plan.num_selected
        origins.append(plan.entry_origins + start)
        width, row = (plan.block[1], plan.cols) if plan.block is not None else (beyond_any_index, 0)
        widths.append(torch.full((n,), width, dtype=torch.int64))
        cols.append(torch.full((n,), row, dtype=torch.int64))
        table_base.append(torch.full((n,), LEVELS * t, dtype=torch.int64))
        start += math.prod(shape)

    def joined(parts: list[Tensor]) -> Tensor:
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    return ShardEntries(joined(origins), joined(widths), joined(cols), joined(table_base))


def validate_message(msg: SparseMessage, expected_shapes: Sequence[Sequence[int]]) -> None:
    """Raise `PayloadError` unless `msg` is well formed for `expected_shapes`.

    Checks everything a receiver relies on: the chunk settings, tensor count and shapes, that each chunk
    carries exactly its k indices, strictly ascending (no duplicates) and below the chunk length, codes in
    0..3, and finite decoded values. Cheap: it touches only the transmitted entries.
    """
    if not (1 <= msg.chunk <= MAX_CHUNK and 1 <= msg.topk <= msg.chunk * msg.chunk):
        raise PayloadError(f"invalid chunk settings chunk={msg.chunk} topk={msg.topk}")
    if len(msg.tensors) != len(expected_shapes):
        raise PayloadError(f"expected {len(expected_shapes)} tensors, got {len(msg.tensors)}")
    for i, (part, expected) in enumerate(zip(msg.tensors, expected_shapes, strict=True)):
        expected_shape = tuple(int(d) for d in expected)
        if part.shape != expected_shape:
            raise PayloadError(f"tensor {i}: shape {part.shape} differs from expected {expected_shape}")
        plan = msg.plan(i)
        if part.indices.shape != (plan.num_selected,) or part.codes.shape != (plan.num_selected,):
            raise PayloadError(f"tensor {i}: expected {plan.num_selected} indices and codes")
        if part.indices.dtype != torch.int16 or part.codes.dtype != torch.uint8:
            raise PayloadError(f"tensor {i}: indices must be int16 and codes uint8")
        for group, rows in plan.group_rows(part.indices):  # int16 compares, no int64 copy: a 178m shard has 1.4M
            if rows.numel() == 0:
                continue
            low, high = torch.aminmax(rows)
            if int(low) < 0 or int(high) >= group.length:
                raise PayloadError(f"tensor {i}: an index lies outside its chunk")
            if group.k > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all()):
                raise PayloadError(f"tensor {i}: indices inside a chunk must be strictly ascending")
        if part.codes.numel() and int(part.codes.max()) >= LEVELS:
            raise PayloadError(f"tensor {i}: a code is above {LEVELS - 1}")
        floats_ok = all(math.isfinite(x) for x in (part.mean, *part.lookup))
        if not floats_ok or not bool(decode_table(part).isfinite().all()):
            raise PayloadError(f"tensor {i}: non-finite mean, lookup table or decoded value")


# ---------------------------------------------------------------------------------------------- compression


def _all_finite(t: Tensor) -> bool:
    """No NaN or Inf in `t`; min/max propagate NaN and expose ±Inf, and are far cheaper than isfinite().all()."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _non_finite(tensors: Sequence[Tensor]) -> list[int]:
    """Which of `tensors` hold a NaN or an Inf, with one host sync for all (min/max propagate NaN, expose ±Inf)."""
    present = [i for i, t in enumerate(tensors) if t.numel()]
    if not present:
        return []
    extremes = torch.stack([torch.stack(torch.aminmax(tensors[i])) for i in present]).tolist()
    return [i for i, pair in zip(present, extremes, strict=True) if not all(math.isfinite(x) for x in pair)]


def _select(acc: Tensor, plan: ChunkPlan) -> tuple[Tensor, Tensor]:
    """In-chunk indices (ascending per chunk) and values of the k largest |acc| of each chunk."""
    indices, values = [], []
    for group, rows in zip(plan.groups, plan.chunk_rows(acc.reshape(-1)), strict=True):
        top = rows.abs().topk(group.k, dim=1, sorted=False).indices.sort(dim=1).values
        indices.append(top.reshape(-1))
        values.append(rows.gather(1, top).reshape(-1))
    if not indices:  # on acc's device: compress joins every tensor's picks
        return torch.zeros(0, dtype=torch.int64, device=acc.device), acc.new_zeros(0)
    return torch.cat(indices), torch.cat(values)


def _quantize(values: Tensor, range_sigmas: float) -> tuple[Tensor, float, tuple[float, float, float, float]]:
    """2-bit codes, fp32 mean and centroid table of one tensor's selected values (statistics in fp64).

    σ = 0 (one value, or all equal) gives step 0; every code is then 2 instead of 0/0 = NaN.
    """
    v = values.to(device="cpu", dtype=torch.float64)
    n = v.numel()
    mean = float(torch.tensor(v.mean().item() if n else 0.0, dtype=torch.float32))
    c = v - mean
    sigma = float(c.norm()) / math.sqrt(n - 1) if n > 1 else 0.0
    step = range_sigmas * sigma / LEVELS
    if step > 0:
        codes = (c / step + LEVELS // 2).round().clamp(0, LEVELS - 1).to(torch.int64)
    else:
        codes = torch.full((n,), LEVELS // 2, dtype=torch.int64)
    sums = torch.zeros(LEVELS, dtype=torch.float64).index_add_(0, codes, c)
    counts = torch.bincount(codes, minlength=LEVELS).to(torch.float64)
    centroids = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).to(torch.float32)
    lookup = tuple(float(x) for x in centroids)
    return codes.to(torch.uint8), mean, (lookup[0], lookup[1], lookup[2], lookup[3])


class ErrorFeedbackCompressor:
    """One replica's SparseLoCo state for one parameter shard: the error-feedback buffers e (fp32).

    `compress` computes a = β·e + Δ, sends Q(TopK_chunk(a)) and keeps e = a − dequant(sent), so after T
    rounds Σ_t β^(T−t)·sent_t + e_T = Σ_t β^(T−t)·Δ_t, up to fp32 rounding. The buffers live on
    `device`; quantization statistics and the message are on the CPU. A failed call leaves e unchanged,
    which costs one extra copy of the buffers at peak during `compress`. `compress` never writes the buffers
    it replaces, so the list `buffers` held before it is a snapshot of e (`SparseLoCoMethod.encode`).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        config: SparseLoCoConfig | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config or SparseLoCoConfig()
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self._buffers = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.shapes]

    def compress(self, deltas: Sequence[Tensor]) -> SparseMessage:
        """Fold this round's pseudo-gradients Δ into the buffers and return what to send.

        Raises `PayloadError` (state unchanged) if Δ or the accumulator is non-finite; `ValueError` if the
        tensors do not match the shapes this compressor was built for.
        """
        if [tuple(d.shape) for d in deltas] != self.shapes:
            raise ValueError(f"expected tensors of shapes {self.shapes}, got {[tuple(d.shape) for d in deltas]}")
        cfg = self.config
        device = self._buffers[0].device if self._buffers else torch.device("cpu")
        acc = torch.empty(sum(math.prod(s) for s in self.shapes), dtype=torch.float32, device=device)
        accs = shard_views(acc, self.shapes)  # one buffer: one index_add_ below
        plans = [chunk_plan(shape, cfg.chunk, cfg.topk) for shape in self.shapes]
        picks = []
        for out, buf, delta, plan in zip(accs, self._buffers, deltas, plans, strict=True):
            torch.mul(buf, cfg.ef_decay, out=out).add_(delta.to(device=device, dtype=torch.float32))
            picks.append(_select(out, plan))
        # nothing is committed yet; checked on acc, not Δ, to save a pass; one host sync for the whole shard
        for i in _non_finite(accs):
            what = "error-feedback accumulator overflowed" if _all_finite(deltas[i]) else "has NaN or Inf entries"
            raise PayloadError(f"pseudo-gradient tensor {i} {self.shapes[i]}: {what}")
        counts = [plan.num_selected for plan in plans]  # one copy each of indices and values to the host, not 82
        indices = torch.cat([i for i, _ in picks]).to(torch.int16).to("cpu").split(counts)
        values = torch.cat([v for _, v in picks]).to("cpu").split(counts)
        parts = []
        for shape, idx, vals in zip(self.shapes, indices, values, strict=True):
            codes, mean, lookup = _quantize(vals, cfg.range_sigmas)
            parts.append(CompressedTensor(shape, idx, codes, mean, lookup))
        message = SparseMessage(chunk=cfg.chunk, topk=cfg.topk, tensors=tuple(parts))
        positions, sent = shard_entries(tuple(self.shapes), cfg.chunk, cfg.topk, device).place(message)
        acc.index_add_(0, positions, -sent)
        self._buffers = accs
        return message

    def return_sent(self, message: SparseMessage) -> None:
        """Add back what `message` (this compressor's last one) took out of the buffers: the round did not aggregate
        it, so e = β·e_prev + Δ again (up to fp32 rounding) and top-k picks from all of it next round (it then decays
        by β per round like the rest of the buffer, and travels in a message weighted by that round's tokens)."""
        self.add_sent(self._buffers, message, 1.0)

    def add_sent(self, buffers: Sequence[Tensor], message: SparseMessage, scale: float) -> None:
        """buffers += scale · what `message` sent, in place (`buffers`: ours, or a snapshot of them)."""
        for i, part in enumerate(message.tensors):
            plan = chunk_plan(self.shapes[i], self.config.chunk, self.config.topk)
            buf = buffers[i]
            sent = dequantize(part, buf.device)
            positions = plan.positions(part.indices, buf.device)
            buf.view(-1).index_add_(0, positions, sent if scale == 1.0 else scale * sent)

    @property
    def buffers(self) -> list[Tensor]:
        """The live buffers (for `add_sent`)."""
        return self._buffers

    def state_dict(self) -> dict[str, list[Tensor]]:
        """The buffers, copied to the CPU, for a checkpoint."""
        return {"buffers": [b.detach().to("cpu", copy=True) for b in self._buffers]}

    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """Restore buffers from `state_dict`; raises `CheckpointError` (state unchanged) if they do not fit."""
        buffers = state.get("buffers") if isinstance(state, dict) else None
        if not isinstance(buffers, list) or len(buffers) != len(self.shapes):
            raise CheckpointError(f"error-feedback state must hold a list of {len(self.shapes)} buffers")
        for i, (b, shape) in enumerate(zip(buffers, self.shapes, strict=True)):
            if not isinstance(b, Tensor) or tuple(b.shape) != shape or not b.is_floating_point():
                raise CheckpointError(f"error-feedback buffer {i} is not a float tensor of shape {shape}")
            if not _all_finite(b):
                raise CheckpointError(f"error-feedback buffer {i} holds NaN or Inf")
        devices = [b.device for b in self._buffers]
        self._buffers = [b.to(device=d, dtype=torch.float32, copy=True) for b, d in zip(buffers, devices, strict=True)]
