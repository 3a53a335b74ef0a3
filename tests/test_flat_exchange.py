"""The flat exchange's rules, in process: the same bounded subset of contributors on every member, rotating over
rounds; relay trees that reach every member with at most FANOUT uploads each; a left-out Δ kept owed."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection

import pytest
import torch
from factories import run_config

from hetero_node.protocol.flat_exchange import (
    FANOUT,
    contributor_limit,
    relay_parent,
    selected_contributors,
    selection_seed,
    slow_uplinks,
)
from hetero_node.protocol.outer_methods import SparseLoCoMethod
from hetero_node.protocol.run_config import OuterConfig

NAMES = [f"12D3KooW{i:04d}peer" for i in range(16)]


def test_every_member_selects_the_same_k_contributors_and_each_gets_its_turn() -> None:
    assert selected_contributors(NAMES[::-1], 0, "ab" * 8) == sorted(NAMES)  # 0: everyone
    assert selected_contributors(NAMES[:5], 8, "ab" * 8) == sorted(NAMES[:5])  # fewer than K: everyone
    picks: Counter[str] = Counter()
    subsets = set()
    for round_ in range(400):
        start_fp = f"{round_:032x}"
        chosen = selected_contributors(NAMES, 4, start_fp)
        assert len(chosen) == 4 and chosen == sorted(chosen) and set(chosen) <= set(NAMES)
        assert selected_contributors(list(reversed(NAMES)), 4, start_fp) == chosen  # arrival order is irrelevant
        picks.update(chosen)
        subsets.add(tuple(chosen))
    assert len(subsets) > 300  # a new subset nearly every round
    same_theta = {tuple(selected_contributors(NAMES, 4, selection_seed("run", 0, t, "ab" * 8))) for t in range(20)}
    assert len(same_theta) > 10  # θ unchanged (every selected message dropped): still another subset each round
    assert contributor_limit(OuterConfig(max_contributors=4)) == 4
    assert contributor_limit(OuterConfig(outer="diloco", max_contributors=4)) == 0  # no error feedback to owe Δ in
    assert set(picks) == set(NAMES) and 60 <= min(picks.values()) <= max(picks.values()) <= 140  # expected 100


def tree_children(members: list[str], author: str, slow: Collection[str], max_hops: int) -> Counter[str]:
    """Each relay parent's number of children in `author`'s tree, having followed every member up to the root in
    at most `max_hops` hops."""
    children: Counter[str] = Counter()
    for me in members:
        if me == author:
            continue
        node, hops = me, 0
        while node != author:
            parent = relay_parent(members, author, node, slow)
            assert parent != node
            node, hops = parent, hops + 1
            assert hops <= max_hops
        children[relay_parent(members, author, me, slow)] += 1
    return children


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 13, 16, 33, 100])
def test_each_relay_tree_reaches_every_member_in_log_hops_with_bounded_uploads(size: int) -> None:
    members = NAMES[:size] if size <= len(NAMES) else [f"peer-{i:05d}" for i in range(size)]
    uploads: Counter[str] = Counter()
    for author in members:
        children = tree_children(members, author, (), max_hops=math.floor(math.log2(size)))
        assert max(children.values()) <= FANOUT
        uploads.update(children)
    assert max(uploads.values()) <= FANOUT * size  # at most FANOUT per message, summed over every author
    with pytest.raises(ValueError):
        relay_parent(members, members[0], members[0])
    with pytest.raises(ValueError):
        relay_parent(members, members[0], "not-a-member")


@pytest.mark.parametrize(("size", "slow_count"), [(3, 1), (4, 1), (5, 2), (8, 3), (16, 7), (33, 5)])
def test_slow_uplinks_are_leaves_and_a_slow_author_uploads_one_copy(size: int, slow_count: int) -> None:
    members = NAMES[:size] if size <= len(NAMES) else [f"peer-{i:05d}" for i in range(size)]
    uplinks = {m: 1000.0 for m in members} | {m: 5.0 for m in members[1::2][:slow_count]}
    uplinks.pop(members[0])  # a member whose record we did not read: not slow
    slow = slow_uplinks(uplinks, members)
    assert slow == {m for m in members if uplinks.get(m) == 5.0} and len(slow) == slow_count
    for author in members:  # every member is still reached, in one hop more at most
        children = tree_children(members, author, slow, max_hops=math.floor(math.log2(size)) + 1)
        assert max(children.values()) <= FANOUT
        assert not (set(children) - {author}) & slow  # no slow member relays
        if author in slow:
            assert children[author] == 1  # a slow author uploads its message once
    fast = {m: 1000.0 for m in members}
    assert slow_uplinks(fast, members) == set() and slow_uplinks({}, members) == set()
    assert all(relay_parent(members, a, m, ()) == relay_parent(members, a, m) for a in members for m in members
               if m != a)  # fmt: skip


@pytest.mark.parametrize(("fast_count", "slow_count"), [(4, 12), (6, 17), (10, 13), (100, 135)])
def test_home_volunteers_that_are_most_of_the_group_stay_leaves_under_the_fast_members(
    fast_count: int, slow_count: int
) -> None:
    """More slow members than the fast can take FANOUT at a time: the slow still never relay, the fast take them in
    turn (at most ⌈slow / fast⌉ + FANOUT children each), and every member is still reached. The reference is the
    upper quartile, so this holds while the fast are a quarter of the group: with the median, 135 home members of
    235 would not have been slow at all."""
    members = [f"peer-{i:05d}" for i in range(fast_count + slow_count)]
    uplinks = {m: (10_000.0 if i % 4 == 0 else 1_000.0) for i, m in enumerate(members[:fast_count])}
    uplinks |= {m: (40.0 if i % 2 else 20.0) for i, m in enumerate(members[fast_count:])}
    slow = slow_uplinks(uplinks, members)
    assert slow == set(members[fast_count:])
    bound = FANOUT + math.ceil(slow_count / fast_count)
    for author in members[:: max(1, len(members) // 12)]:
        children = tree_children(members, author, slow, max_hops=math.floor(math.log2(fast_count + 1)) + 2)
        assert not (set(children) - {author}) & slow  # no slow member relays
        assert max(children.values()) <= bound
        assert sum(children.values()) == len(members) - 1  # everyone reached
        if author in slow:
            assert children[author] == 1  # a slow author still uploads its message once
    everyone_slow = {m: 20.0 for m in members}
    assert slow_uplinks(everyone_slow, members) == set()  # alike links: nobody is slow, the usual tree


SHAPES = [(64, 48), (300,)]


def deltas(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=gen) for s in SHAPES]


def test_a_left_out_message_keeps_its_whole_delta_owed_in_the_error_feedback() -> None:
    run = run_config()
    beta = run.sparseloco.ef_decay
    method = SparseLoCoMethod(SHAPES, run)
    method.encode(deltas(0))
    before = [b.clone() for b in method.private_tensors()]
    encoded = method.encode(deltas(1))
    sent_out = [b.clone() for b in method.private_tensors()]
    method.defer(encoded.snapshot, encoded.payload)
    owed = method.private_tensors()
    for e0, d, e1, e_sent in zip(before, deltas(1), owed, sent_out, strict=True):
        torch.testing.assert_close(e1, beta * e0 + d, rtol=0, atol=1e-6)  # nothing of Δ₁ was lost
        assert not torch.allclose(e_sent, beta * e0 + d)  # (encoding alone had taken the sent part out)
