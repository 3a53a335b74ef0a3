"""What keeps a peer's bytes per round flat as the swarm grows: which messages a round aggregates, and from whom
each member fetches each of them.

* **A bounded subset of contributors.** A SparseLoCo shard's round aggregates at most K messages
  (`--max-contributors`), chosen by hashing the run, shard, round and start fingerprint with each contributor's peer
  id. Every member computes the same subset from the group's gathered metadata (no extra message, nothing to
  trust), nobody knows the subset before θ(t) exists, and it changes every round, even one that left θ unchanged.
  A contributor left out keeps its Δ in its error feedback and sends it in a later round, as SparseLoCo already does
  with everything top-k leaves out (DiLoCo has no error feedback: there every contributor is aggregated).
* **A relay tree per message.** Each selected message spreads down a binary tree over the group's members,
  rooted at its author: a member fetches it from its parent, which re-serves the bytes once it has verified them
  against the digest the group agreed on (a relay cannot alter a message, only delay it; a member whose parent
  fails fetches from the author). Each member downloads a message once and, while the tree holds, uploads it at
  most twice, so a peer moves at most K messages down and 2K up per round whatever R is (a parent that fails sends
  its subtree to the author instead), and a message reaches everyone after ⌊log2 R⌋ hops instead of its author
  uploading R − 1 copies. Members on slow uplinks (a home volunteer among datacenter nodes) are the trees' leaves,
  and a slow author uploads one copy: they never relay, and their own upload is paid once.

Pure functions of the group's view: every member builds the same subset, and the same trees as far as the records
it read agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence

from hetero_node.protocol.outer_specs import outer_spec
from hetero_node.protocol.run_config import OuterConfig

FANOUT = 2
"""Children per member in a message's relay tree: what each member uploads per selected message (a fast member
takes more where slow ones are most of the group, `relay_parent`)."""
SLOW_UPLINK_SHARE = 0.25
"""A member whose advertised upload is below this share of the group's upper quartile is a leaf of every relay
tree."""


def contributor_limit(outer: OuterConfig) -> int:
    """K for this run's rounds (0: every contributor): only a method with error feedback can keep a left-out Δ
    owed."""
    return outer.max_contributors if outer_spec(outer.outer).error_feedback else 0


def aggregated(contributors: int, limit: int) -> int:
    """Messages a round aggregates: at most `limit` (K; 0: no limit) of the contributors'."""
    return min(contributors, limit) if limit > 0 else contributors


def selection_seed(run_id: str, shard: int, round_: int, start_fp: str) -> str:
    """What a round's subset is drawn from: θ(t) (unknown before the round) and where the round is (so a round that
    left θ unchanged, e.g. because every selected message was dropped, still draws another subset)."""
    return f"{run_id}/{shard}/{round_}/{start_fp}"


def selected_contributors(names: Sequence[str], limit: int, seed: str) -> list[str]:
    """The contributors (peer ids) whose messages this round aggregates, in canonical (sorted) order: all of them
    when `limit` is 0 or not exceeded, else the `limit` with the smallest hash of (seed, peer id)."""
    if aggregated(len(names), limit) == len(names):
        return sorted(names)

    def ticket(name: str) -> bytes:
        return hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest()

    return sorted(sorted(names, key=ticket)[:limit])


def slow_uplinks(uplinks: Mapping[str, float], members: Sequence[str]) -> frozenset[str]:
    """The members whose advertised upload is below `SLOW_UPLINK_SHARE` of the members' upper quartile (home
    volunteers beside datacenter nodes): leaves of every relay tree, never relays. The upper quartile, not the
    median: home volunteers may be most of a group, and a median among them made them relay for each other (the
    cost model: 40 RTX 3090 pipelines beside 175 replicas turned their 40 Mbit/s neighbours into relays and the round
    from 85 to 105 s); it still takes a quarter of the members to move it. Members without a known figure are not
    slow; members that read other figures build other trees, which costs time, never correctness (a parent that
    does not relay a message still fetches it for itself, and a child that waits too long asks the author)."""
    below = slow_uplink_below(uplinks, members)
    return frozenset(m for m in members if m in uplinks and uplinks[m] < below)


def slow_uplink_below(uplinks: Mapping[str, float], members: Sequence[str]) -> float:
    """The upload below which a member of this group is slow (`slow_uplinks`); 0 when no figure is known."""
    known = sorted(uplinks[m] for m in members if m in uplinks)
    return SLOW_UPLINK_SHARE * known[3 * len(known) // 4] if known else 0.0


def relay_parent(members: Sequence[str], author: str, me: str, slow: Collection[str] = ()) -> str:
    """The member `me` fetches `author`'s message from: its parent in a FANOUT-ary tree over the members in
    canonical order, rotated so the author is the root (a different tree per author spreads the upload). `slow`
    members (`slow_uplinks`) go last, so they are leaves; a slow author uploads one copy, to the first other member,
    which heads the tree of the rest (on the netlab a 5 Mbit/s member relaying beside 1 Gbit/s ones lengthened their
    fetches sevenfold). Where the slow are more than about half the group, those the tree would hang under another
    slow member hang under the fast ones in turn instead, which then upload more than FANOUT copies."""
    ordered = sorted(members)
    if author not in ordered or me not in ordered:
        raise ValueError("the author and the fetching member must both be in the group")
    start = ordered.index(author)
    others = ordered[start + 1 :] + ordered[:start]
    tree = [author, *(m for m in others if m not in slow), *(m for m in others if m in slow)]
    position = tree.index(me)
    if position == 0:
        raise ValueError("the author does not fetch its own message")
    head = 1 if author in slow and position > 1 else 0  # a slow author's message: a tree under its first child
    relays = [m for m in tree[head:] if m not in slow]
    parent = head + (position - head - 1) // FANOUT
    if me in slow and tree[parent] in slow and relays:
        return relays[(position - head - len(relays)) % len(relays)]
    return tree[parent]
