"""`hetero-node-lab fuzz`: structure-aware malformed inputs against every parser a peer's bytes reach.

In one process, against the nodes' own functions: each entry point starts from a valid sample (a real SparseLoCo
message, a DiLoCo payload, boundary activations and gradients, group metadata, a manifest, a peer record, a run
announcement, a state blob, a stage piece) and is fed mutations of it: bit flips, truncations, extensions, random
spans, huge declared lengths, duplicated spans, other entry points' bytes (replays of the wrong kind), and for
structured inputs missing or extra fields, wrong types, huge, negative and non-finite numbers.

Every input must be either accepted (a mutation can be valid) or refused the way the caller expects (the entry
point's documented error, or None); anything else is a crash. Peak RSS is read after each entry point, so an
allocation driven by a declared size shows. Transport-level checks (frame caps, stream limits, signed records) are
tested against real peers in `tests/test_trust.py`; this bench covers what those bytes are parsed by.
"""

from __future__ import annotations

import copy
import math
import random
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from google.protobuf.message import DecodeError

from hetero_node.bench.results import write_report
from hetero_node.bench.samples import RECORD_EDGES, record_fields
from hetero_node.client.swarm import view
from hetero_node.client.swarm.auto_plan import MarginalGain, requirements
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.client.swarm.membership import plan_from_records
from hetero_node.client.swarm.work_ledger import WorkLedger
from hetero_node.protocol import boundary_codec, dense_codec, sparse_codec
from hetero_node.protocol.claims import RoundWindow, implausible_claims
from hetero_node.protocol.errors import ConfigError, PayloadError
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.records import PeerRecord, parse_peer_record, parse_run_announcement
from hetero_node.protocol.round_wire import GroupMeta, encode_manifest, parse_manifest
from hetero_node.protocol.run_config import PROTOCOL_VERSION, OuterConfig, RunConfig, SparseLoCoConfig
from hetero_node.protocol.sparseloco import ErrorFeedbackCompressor
from hetero_node.protocol.state_wire import from_bytes, to_bytes

wire = load_proto_module("wire")

SHAPES = [(64, 48), (300,)]
SPARSE = SparseLoCoConfig()
FMT = boundary_codec.BoundaryFormat(d_model=32, vocab_size=256, max_seq_len=64, rank=8)
BATCH, SEQ = 2, 16
PEER = "12D3KooWHa9cH8vUkHcsdSAKZc1bBnvPwoiTVCjz79SDJhGCe3Ty"
NASTY_VALUES: list[Any] = [None, True, -1, 0, 2**63, -(2**63), 10**30, 1.5, math.nan, math.inf, "", "x" * 10_000,
                           [], [1] * 10_000, {}, {"a": {"b": {"c": []}}}, b"\x00" * 64, "00" * 32]  # fmt: skip


@dataclass
class EntryResult:
    """What one entry point did with its inputs."""

    cases: int = 0
    accepted: int = 0
    refused: int = 0
    crashes: int = 0
    examples: list[str] = field(default_factory=list)
    """The first few crashes: the exception and the mutation that caused it."""
    peak_rss_mb: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class EntryPoint:
    name: str
    sample: Callable[[], Any]
    parse: Callable[[Any], Any]
    refusals: tuple[type[BaseException], ...]
    """Errors the caller catches as "refused"; a parse returning None is a refusal too."""
    mutate: Callable[[Any, random.Random], Any] | None = None
    """How a case is made from the sample (default: `mutate_bytes` or `mutate_structure`)."""


def _sparse_payload() -> bytes:
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s, generator=gen) for s in SHAPES]
    return sparse_codec.encode(ErrorFeedbackCompressor(SHAPES, SPARSE).compress(deltas))


def _activations() -> bytes:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, FMT.vocab_size, (BATCH, SEQ + 1), generator=gen)
    x = torch.randn(BATCH, SEQ, FMT.d_model, generator=gen)
    U = torch.linalg.qr(torch.randn(FMT.d_model, FMT.rank, generator=gen)).Q
    table = torch.randn(FMT.vocab_size, FMT.d_model, generator=gen)
    return boundary_codec.encode_activations(FMT, x, ids[:, :-1], ids[:, 1:], U, table)


TINY_RUN = RunConfig(
    preset="tiny", vocab_size=256, batch_size=8, seq_len=64, seed=0, data_shards=4, data_identity="d" * 64,
    tokenizer_identity="t" * 64, outer=OuterConfig(stages=2),
)  # fmt: skip


def _run_config() -> dict[str, Any]:
    return TINY_RUN.to_dict()


def _announcement(raw: Any) -> Any:
    announcement = parse_run_announcement(raw)
    return None if announcement is None else RunConfig.from_dict(announcement.config)


def _state(data: bytes) -> Any:
    state = from_bytes(data)
    tensors = state.get("tensors")
    if not isinstance(tensors, list) or [tuple(getattr(t, "shape", ())) for t in tensors] != SHAPES:
        raise PayloadError("wrong shapes")
    return state


def _stage_piece(data: bytes) -> Any:
    piece = wire.StagePiece()
    piece.ParseFromString(data)
    return piece


def judge_records(records: dict[str, PeerRecord], shape: RunShape) -> Any:
    """What every node computes from the records it read: the live planner's plan (with the cost model's judge),
    every view function a round reads, the reader's ledger (cap, votes, slot dating, challenge order) and the
    claims judge (`protocol/claims.py`). Returns the plan."""
    plan = plan_from_records(records, requirements(shape), MarginalGain(shape))
    me, stages = next(iter(records)), shape.stages
    ledger = WorkLedger(salt=b"fuzz")
    ledger.note_records(records.values(), 1e9)
    ledger.keep(records, max(1, len(records) - 1), 1e9)
    ledger.voters(records, 1e9)
    ledger.running(records, 1e9)
    ledger.to_challenge(records, 1e9)
    window = RoundWindow(10.0, 2.0, 1, shape.inner_steps, shape.min_inner_steps, shape.tokens_per_step)
    implausible_claims({pid: 1 << 40 for pid in records}, records, window)
    dated = {pid: r.copy(update={"claimed_at": ledger.claimed_at(r)}) for pid, r in records.items()}
    for read in (records, dated):
        view.slot_holders(read, stages)
        view.virtual_replicas(read, stages, complete=False)
        view.replica_count(read, stages)
        for shard in range(stages):
            view.shard_members(read, shard, stages)
            view.coming_members(read, 1, shard, stages)
            view.shard_donors(read, shard)
            view.vouched_fingerprint(read, 1, str(shard), me)
            view.certified_fingerprint(read, 1, str(shard))
        view.swarm_round(read, me)
        view.swarm_round(read, me, certified=True)
    return plan


SWARM_SHAPE = RunShape.from_run(TINY_RUN)


def _swarm_records() -> dict[str, Any]:
    """A swarm as the DHT holds it: 2 full replicas, both stages of a virtual replica, a joiner."""
    kinds = [{"role": "full"}, {"role": "full"}, {"role": "stage", "vr": 0, "stage": 0, "claimed_at": 5.0},
             {"role": "stage", "vr": 0, "stage": 1, "claimed_at": 6.0}, {}]  # fmt: skip
    return {name: record_fields(f"{PEER[:-2]}{name}x", **kind) for name, kind in zip("abcde", kinds, strict=True)}


def _plan_swarm(raw: Any) -> Any:
    """The planner and views over the records that pass the schema (as a node reads them); refused (None) when
    any record did not, once they have run on the rest."""
    if not isinstance(raw, dict):
        return None
    parsed = [parse_peer_record(value) for value in raw.values()]
    records = {r.peer_id: r for r in parsed if r is not None}
    plan = judge_records(records, SWARM_SHAPE) if records else None
    return None if None in parsed else plan


def mutate_to_edges(swarm: dict[str, Any], rng: random.Random) -> Any:
    """1-3 fields of one record set to values at the edges of the schema (`RECORD_EDGES`): valid, extreme; a
    quarter of the cases also get one `mutate_structure` change (an invalid record the reader must drop)."""
    swarm = copy.deepcopy(swarm)
    record = swarm[rng.choice(list(swarm))]
    for name in rng.sample(list(RECORD_EDGES), rng.randint(1, 3)):
        record[name] = copy.deepcopy(rng.choice(RECORD_EDGES[name]))
    return mutate_structure(swarm, rng) if rng.random() < 0.25 else swarm


ENTRY_POINTS = [
    EntryPoint("SparseLoCo message (payload stream)", _sparse_payload,
               lambda d: sparse_codec.decode(d, SHAPES, SPARSE), (PayloadError,)),
    EntryPoint("DiLoCo message (payload stream)", lambda: dense_codec.encode([torch.ones(s) for s in SHAPES], "fp16"),
               lambda d: dense_codec.decode(d, SHAPES, "fp16"), (PayloadError,)),
    EntryPoint("stage activations (stage inbox)", _activations,
               lambda d: boundary_codec.parse_activations(FMT, d), (PayloadError,)),
    EntryPoint("stage gradients (stage inbox)",
               lambda: boundary_codec.encode_gradients(FMT, torch.ones(BATCH, SEQ, FMT.d_model), torch.eye(32)[:, :8]),
               lambda d: boundary_codec.parse_gradients(FMT, d, BATCH, SEQ), (PayloadError,)),
    EntryPoint("stage piece header (stage inbox)",
               lambda: wire.StagePiece(kind=0, vr=1, stage=1, round=3, total_size=10, data=b"x" * 10)
               .SerializeToString(), _stage_piece, (DecodeError,)),
    EntryPoint("round manifest (blob stream)",
               lambda: encode_manifest(3, "ab" * 16, "cd" * 16, [(PEER, "ef" * 16, 64)]),
               lambda d: parse_manifest(d, 3), (PayloadError,)),
    EntryPoint("state blob (blob stream)", lambda: to_bytes({"tensors": [torch.ones(s) for s in SHAPES]}), _state,
               (PayloadError,)),
    EntryPoint("group metadata (matchmaking)",
               lambda: {"round": 3, "start_fp": "ab" * 16, "size": 1200, "digest": "cd" * 16, "tokens": 64,
                        "proof": ""},
               lambda raw: GroupMeta.parse(raw, max_size=10**6), ()),
    EntryPoint("peer record (DHT)", lambda: record_fields(PEER), parse_peer_record, ()),
    EntryPoint("valid extreme records (planner, view, ledger)", _swarm_records, _plan_swarm, (), mutate_to_edges),
    EntryPoint("run announcement (DHT)",
               lambda: {"peer_id": PEER, "run_id": "0123456789abcdef", "software_version": "0.1.0",
                        "protocol_version": PROTOCOL_VERSION, "data_source": "bundled", "config": _run_config(),
                        "private": False},
               _announcement, (ConfigError,)),
]  # fmt: skip


def mutate_bytes(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    """One structure-unaware-but-informed mutation of `data` (see the module docstring)."""
    buf = bytearray(data)
    kind = rng.randrange(9)
    if kind == 0 and buf:  # flip 1-8 bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del buf[rng.randrange(len(buf) + 1) :]
    elif kind == 2:  # extend
        buf += rng.randbytes(rng.choice([1, 7, 64, 4096]))
    elif kind == 3 and buf:  # overwrite a span with random bytes
        i = rng.randrange(len(buf))
        buf[i : i + rng.randint(1, 32)] = rng.randbytes(rng.randint(1, 32))
    elif kind == 4 and len(buf) >= 8:  # a huge declared length or count somewhere
        i = rng.randrange(len(buf) - 7)
        buf[i : i + rng.choice([2, 4, 8])] = rng.choice([b"\xff" * 8, b"\xff\xff\xff\x7f" * 2, b"\x80" * 7 + b"\x01"])
    elif kind == 5 and buf:  # duplicate a span
        i = rng.randrange(len(buf))
        buf[i:i] = buf[i : i + rng.randint(1, 256)]
    elif kind == 6:  # another entry point's bytes: a replay of the wrong kind
        return rng.choice(others)
    elif kind == 7:
        return b""
    else:  # random bytes of the same length
        return rng.randbytes(len(buf))
    return bytes(buf[: 1 << 22])


def mutate_structure(value: Any, rng: random.Random) -> Any:
    """One mutation of a dict (or list) sample: a field dropped, added, or replaced, anywhere in the tree."""
    value = copy.deepcopy(value)
    node = value
    while isinstance(node, dict) and node and rng.random() < 0.4:  # sometimes go deeper
        child = node[rng.choice(list(node))]
        if not isinstance(child, dict) or not child:
            break
        node = child
    if not isinstance(node, dict) or not node:
        return rng.choice(NASTY_VALUES)
    key = rng.choice(list(node))
    kind = rng.randrange(5)
    if kind == 0:
        del node[key]
    elif kind == 1:
        node[rng.choice(["extra", "x" * 100, 7])] = rng.choice(NASTY_VALUES)
    elif kind == 2 and isinstance(node[key], int | float) and not isinstance(node[key], bool):
        node[key] = node[key] + rng.choice([1, -1, 10**9, -(10**9), 0.5])
    else:
        node[key] = rng.choice(NASTY_VALUES)
    return value


def fuzz(cases_per_entry: int, seed: int = 0) -> dict[str, EntryResult]:
    """Run `cases_per_entry` mutations against every entry point."""
    rng = random.Random(seed)
    warnings.simplefilter("ignore")  # libraries warn about odd inputs (torch: "pickle protocol 1"): not our figure
    samples = {e.name: e.sample() for e in ENTRY_POINTS}
    blobs = [s for s in samples.values() if isinstance(s, bytes)]
    results = {}
    for entry in ENTRY_POINTS:
        result, start = EntryResult(), time.perf_counter()
        sample = samples[entry.name]
        if entry.parse(sample) is None:
            raise AssertionError(f"{entry.name}: the valid sample is refused")
        for _ in range(cases_per_entry):
            if entry.mutate is not None:
                case = entry.mutate(sample, rng)
            elif isinstance(sample, bytes):
                case = mutate_bytes(sample, rng, blobs)
            else:
                case = mutate_structure(sample, rng)
            result.cases += 1
            try:
                parsed = entry.parse(case)
            except entry.refusals:
                result.refused += 1
                continue
            except Exception as e:  # anything the caller does not expect is a crash
                result.crashes += 1
                if len(result.examples) < 5:
                    result.examples.append(f"{type(e).__name__}: {e} (input {repr(case)[:120]})")
                continue
            if parsed is None:
                result.refused += 1
            else:
                result.accepted += 1
        result.seconds = time.perf_counter() - start
        result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results[entry.name] = result
    return results


def render_markdown(results: dict[str, EntryResult]) -> str:
    lines = ["| entry point | inputs | accepted | refused | crashes | peak RSS MB after | s |", "|---" * 7 + "|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.cases:,} | {r.accepted:,} | {r.refused:,} | {r.crashes} | {r.peak_rss_mb:.0f} "
                     f"| {r.seconds:.1f} |")  # fmt: skip
    for name, r in results.items():
        lines += [f"\n{name}: {example}" for example in r.examples]
    return "\n".join(lines) + "\n"


def run_fuzz(cases: int, seed: int, out: Path) -> dict[str, EntryResult]:
    """`cases` inputs in all, split evenly over the entry points; writes report.json and report.md under `out`."""
    results = fuzz(max(1, cases // len(ENTRY_POINTS)), seed)
    write_report(out, {k: v.__dict__ for k, v in results.items()}, render_markdown(results))
    return results
