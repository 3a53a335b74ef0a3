"""The outer methods as strategies, in process: every member that combines the same messages, in whatever order
they arrive, gets the same bits; encoding can be undone; the transport's checks on what peers send."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from factories import run_config

from hetero_node.models.shards import fingerprint
from hetero_node.protocol.errors import ConfigError, PayloadError
from hetero_node.protocol.outer_methods import (
    CLIP_GRID,
    DiLoCoMethod,
    SparseLoCoMethod,
    dense_norm,
    norm_clip,
    outer_method,
)
from hetero_node.protocol.outer_specs import outer_names, outer_spec
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.round_wire import GroupMeta, encode_manifest, manifest_certificate, parse_manifest
from hetero_node.protocol.run_config import OuterConfig

SHAPES = [(64, 48), (300,)]
START = [torch.full(s, 0.5) for s in SHAPES]


def deltas(seed: int, scale: float = 1e-2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize(
    ("outer", "aggregation"), [("sparseloco", "mean"), ("sparseloco", "robust"), ("diloco", "mean")]
)
def test_combining_the_same_messages_in_any_order_gives_the_same_bits(outer: str, aggregation: str) -> None:
    run = run_config(outer=OuterConfig(outer=outer, aggregation=aggregation))
    senders = [outer_method(run, SHAPES) for _ in range(3)]
    payloads = [m.encode(deltas(i)).payload for i, m in enumerate(senders)]
    names, weights = ["peer-b", "peer-a", "peer-c"], [512.0, 2048.0, 1024.0]
    results = set()
    for order in itertools.permutations(range(3)):
        member = outer_method(run, SHAPES)  # a fresh member: same shared state as the others
        messages = [member.decode(payloads[i]) for i in order]
        combined = member.combine(messages, [weights[i] for i in order], [names[i] for i in order])
        assert sorted(combined.used) == [0, 1, 2]
        results.add(fingerprint(member.update(START, combined)))
    assert len(results) == 1


def test_sparseloco_encoding_can_be_undone_and_rejects_what_is_not_finite() -> None:
    method = SparseLoCoMethod(SHAPES, run_config())
    first = method.encode(deltas(0))
    before = fingerprint(method.private_tensors())
    second = method.encode(deltas(1))
    assert fingerprint(method.private_tensors()) != before
    method.restore(second.snapshot)  # the round failed: as if Δ₂ was never encoded
    assert fingerprint(method.private_tensors()) == before
    assert first.payload != second.payload and len(second.payload) == method.max_message_bytes
    with pytest.raises(PayloadError):
        method.encode([torch.full(s, float("nan")) for s in SHAPES])
    assert fingerprint(method.private_tensors()) == before
    assert method.shared_state() is None


def test_diloco_weights_its_mean_by_tokens_and_keeps_shared_momentum() -> None:
    run = run_config(outer=OuterConfig(outer="diloco"))
    member = DiLoCoMethod(SHAPES, run)
    a, b = deltas(0), deltas(1)
    messages = [member.decode(DiLoCoMethod(SHAPES, run).encode(d).payload) for d in (a, b)]
    combined = member.combine(messages, [3.0, 1.0], ["x", "y"])
    for got, da, db in zip(combined.tensors, a, b, strict=True):
        torch.testing.assert_close(got, 0.75 * da + 0.25 * db)
    new = member.update(START, combined)
    momentum = [m.clone() for m in member.shared_state()]
    assert all(torch.equal(m, d) for m, d in zip(momentum, combined.tensors, strict=True))  # m = 0.9·0 + Δ̄
    lr, mu = run.outer.diloco_lr, run.outer.diloco_momentum
    torch.testing.assert_close(new[0], START[0] - lr * (combined.tensors[0] + mu * momentum[0]))
    late = DiLoCoMethod(SHAPES, run)
    late.load_shared_state(momentum)  # a joiner adopts the swarm's momentum from a donor's state
    assert fingerprint(late.shared_state()) == fingerprint(momentum)
    with pytest.raises(PayloadError):
        late.load_shared_state([torch.full(s, float("inf")) for s in SHAPES])


def test_diloco_bounds_a_member_claiming_huge_weight_and_sending_a_huge_step() -> None:
    """Review M1: 2 honest members + 1 claiming 2⁴⁰ tokens with its step flipped and scaled by 10⁶ took θ to
    1.3·10³⁰. Its weight now counts as 4 lower-median members and its norm as 2 median norms."""
    run = run_config(outer=OuterConfig(outer="diloco"))
    member = DiLoCoMethod(SHAPES, run)
    honest = [deltas(0), deltas(1)]
    liar = [-1e6 * d for d in deltas(2)]
    messages = [member.decode(DiLoCoMethod(SHAPES, run).encode(d).payload) for d in (*honest, liar)]
    combined = member.combine(messages, [1000.0, 1000.0, 2.0**40], ["a", "b", "c"])
    honest_norm = max(dense_norm(d) for d in honest)
    assert dense_norm(combined.tensors) <= 2 * honest_norm  # (1 + 1 + 4·2) / 6 median norms at the very most
    new = member.update(START, combined)
    assert max(float((n - s).abs().max()) for n, s in zip(new, START, strict=True)) < 1.0
    assert norm_clip([1.0, 1.0, 3.0], 2.0) == [1.0, 1.0, math.floor(2 / 3 / CLIP_GRID) * CLIP_GRID]


META = {"round": 3, "start_fp": "ab" * 16, "size": 1200, "digest": "cd" * 16, "tokens": 4096, "proof": ""}


@pytest.mark.parametrize(
    "change",
    [
        {"start_fp": ["ab" * 16]},  # a list where a string belongs: once an unhandled TypeError in every member
        {"round": "3"},
        {"round": True},
        {"size": 10**12},
        {"size": -1},
        {"tokens": 3.5},
        {"digest": "not hex"},
        {"size": 0},  # a receiver announces no size, no digest and no tokens, all together
        {"extra": 1},
        {"proof": "00"},
        {"proof": None},
    ],
)
def test_malformed_gathered_metadata_leaves_its_member_out(change: dict) -> None:
    assert GroupMeta.parse(META, max_size=10**6) == GroupMeta(**META)
    assert GroupMeta.parse({**META, **change}, max_size=10**6) is None
    assert GroupMeta.parse("not a dict", max_size=10**6) is None
    receiver = {**META, "size": 0, "digest": "", "tokens": 0}
    assert GroupMeta.parse(receiver, max_size=10**6) == GroupMeta(**receiver)


def test_manifests_round_trip_and_malformed_ones_are_refused() -> None:
    members = [("peer-a", "cd" * 16, 4096), ("peer-b", "ef" * 16, 1024)]
    certificate = Certificate(7, frozenset({"peer-a", "peer-b", "peer-c"}), "ab" * 16)  # peer-c only received
    data = encode_manifest(7, "ab" * 16, "12" * 16, members, certificate)
    body = parse_manifest(data, 7)
    assert body["members"] == [list(m) for m in members] and manifest_certificate(body) == certificate
    void = parse_manifest(encode_manifest(7, "ab" * 16, "12" * 16, []), 7)  # a void round, by a member with no base
    assert void["members"] == [] and manifest_certificate(void) is None
    for bad in (
        data.replace(b'"round":7', b'"round":8'),
        data[:-5],
        json.dumps({**body, "members": [["peer-a", "cd" * 16, 0]]}).encode(),
        json.dumps({**body, "result_fp": 5}).encode(),
        json.dumps({**body, "certificate": {**body["certificate"], "round": 8}}).encode(),  # after the round
        json.dumps({**body, "certificate": {**body["certificate"], "members": ["x" * 500]}}).encode(),
        json.dumps({**body, "certificate": {**body["certificate"], "extra": 1}}).encode(),
        json.dumps({k: v for k, v in body.items() if k != "certificate"}).encode(),
        b"\xff" * 10,
    ):
        with pytest.raises(PayloadError):
            parse_manifest(bad, 7)


def test_every_registered_method_is_built_from_its_spec_which_sizes_its_messages() -> None:
    assert outer_names() == ("sparseloco", "diloco")  # the --outer values runs already name
    for name in outer_names():
        run = run_config(outer=OuterConfig(outer=name))
        method = outer_method(run, SHAPES)
        assert method.spec is outer_spec(name)
        assert method.max_message_bytes == method.spec.message_bytes(run, SHAPES)
        assert len(method.encode(deltas(0)).payload) <= method.max_message_bytes
    with pytest.raises(ConfigError, match="--outer must be one of sparseloco, diloco"):
        OuterConfig(outer="adam")
