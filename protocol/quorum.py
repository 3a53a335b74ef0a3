"""When a round is final: more than half of the previous certificate's members sealed one set.

Round t of a shard is **certified** when the members that sealed one set (`protocol/roster.py`: a seal is a vote,
never changed) include more than half of the members of the shard's previous certificate (the quorum base):
torchft's split-brain rule, without its lighthouse. Two sets cannot both hold more than half of one base's votes,
so every member that certifies round t certifies the same set, and at most one side of a partition makes
progress; the other voids the round and keeps θ(t), and when the link heals its members start from a θ the
majority can rebuild forward from its messages.

The members of the new certificate are the authors of the round's set, which every member that certified it holds
alike, so the next round's base is the same for all of them (it was the sealers each member happened to read,
which differed under churn and let two sets each win a different base). A member that took round t's result from
others takes this certificate from what the deciders stored (in the DHT, `client/outer/roster_round.py`, or in their
manifests, `protocol/round_wire.py`), never from the seals it happens to read (the kill soak's last fork: a restarted
member's base from the DHT's seals certified a second set); knowing none, it seals but decides nothing (`follows`).

A joiner is admitted by stating in time for a round's set, though it does not count towards the quorum of the round
it joins. A round no certificate came before (a fresh swarm's first, or a follower's after a void round) has no base
all members share: each one's is the coming members its records show, so a majority rule could certify two sets
(it did, in the frozen-member test's round 0); such a round needs every member anyone names to seal one set
(`protocol/roster.py: unanimous`), and a member that follows (its base unknown) never certifies a round alone.

A member of the base that crashed still counts against the quorum, since a crash and a partition look the same
from inside; after `patience` rounds without a certificate, base members whose peer records are gone are
dropped from the base, so survivors of a crash (or of peers that left) go on. The price: a partition longer than
`patience` rounds lets both sides go on (each sees the other's records expire)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Certificate:
    """Round `round` of a shard as this member certified it: who sealed it, from which θ(t)."""

    round: int
    members: frozenset[str]
    """The authors of its set: the next round's quorum base."""
    start_fp: str

    def to_dict(self) -> dict[str, Any]:
        """As a checkpoint keeps it: a member restarted from it needs the same majority it needed before."""
        return {"round": self.round, "members": sorted(self.members), "start_fp": self.start_fp}

    @classmethod
    def from_dict(cls, raw: Any) -> Certificate | None:
        """The certificate `to_dict` wrote; None for anything else (a checkpoint that predates them)."""
        if not isinstance(raw, dict):
            return None
        round_, members, start_fp = raw.get("round"), raw.get("members"), raw.get("start_fp")
        if type(round_) is not int or not isinstance(start_fp, str) or not isinstance(members, list):
            return None
        if not all(isinstance(m, str) for m in members):
            return None
        return cls(round_, frozenset(members), start_fp)


def quorum_base(
    previous: Certificate | None, since: int, patience: int, live: Collection[str], expected: Collection[str]
) -> frozenset[str]:
    """Whose seals round t needs a majority of. `previous`: the shard's last certificate this member holds (None: it
    has none yet, a fresh run or a joiner: the members the records show coming, `expected`). `since`: rounds
    between that certificate and round t; once they reach `patience`, base members without a live record (`live`)
    no longer count."""
    if previous is None:
        return frozenset(expected)
    if since < patience:
        return previous.members
    return previous.members & frozenset(live) or previous.members


def certifies(sealers: Collection[str], base: frozenset[str]) -> bool:
    """More than half of `base` sealed (an empty base: anyone who sealed is a quorum)."""
    if not base:
        return bool(sealers)
    return 2 * len(base & frozenset(sealers)) > len(base)
