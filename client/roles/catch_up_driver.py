"""Catching up: θ of a round this replica missed, rebuilt from the round's messages while peers still serve them and
that is cheaper than a state, else loaded from a peer's state. The round loop needs it in two places: at the top
of a round, when the swarm is ahead (we joined late, restarted, or missed rounds: `catch_up`), and at the end of a
round whose group did not give us θ(t+1) (`obtain`). One shard's rebuild from its messages is `outer/catch_up.py`.

`CatchingUp` is a part of `Replica` (`roles/replica.py`), written apart: it reads the replica's records, held
shards and start point, loads states with `Replica.load_state`, and applies and records a rebuilt round as the
loop does (`Replica.apply`, `Replica.record_round`).
"""

from __future__ import annotations

import logging
import random

from hetero_node.client.outer.catch_up import CaughtUp, catch_up_shard
from hetero_node.client.roles.round_record import InFlight, Settled
from hetero_node.client.swarm import view
from hetero_node.client.swarm.runtime import KEPT_ROUNDS
from hetero_node.protocol.flat_exchange import aggregated, contributor_limit
from hetero_node.protocol.records import PeerRecord

logger = logging.getLogger(__name__)


class CatchingUp:
    """The catch-up part of `Replica` (see the module docstring)."""

    def catch_up(self) -> None:
        """If the swarm is ahead (we joined late, restarted, missed rounds, or voided rounds the others certified:
        cut off from them), reach its round: from the rounds' messages while they are still served, else from a
        peer's state. Counted from our certified round: the rounds we voided since left θ where it was."""
        records = self.records()
        voters = self.runtime.voters(records)
        ahead = max(  # a full replica where only virtual replicas went on (a VR-only swarm) follows them too
            view.swarm_round(self.donors(voters), self.me, certified=True),
            view.swarm_round(self.holders(voters), self.me, certified=True),
        )
        behind_from = self.certified
        while self.messages_cheaper(ahead - self.certified, records) and not self.stop.is_set():
            got = self.rebuild_round(self.certified, list(self.start))
            if got is None:
                break
            rebuilt, size = got
            void = frozenset(s for s, r in rebuilt.items() if not r.digests)  # its members served a void round
            new = {s: r.tensors for s, r in rebuilt.items()}
            self.apply(new, self.certified + 1, caught_up=("messages", size), void=void)
            if self.upkeep_fallback is not None:  # its upkeep failed: a state came instead, or the next try is later
                break
        if ahead > self.certified and not self.stop.is_set():
            size = self.load_state(min_round=ahead, wait_s=0.0)
            if size is not None:
                self.record_round(self.round - 1, None, None, Settled(caught_up="state", catch_up_bytes=size))
        if self.certified > behind_from:
            self.failed_settles = 0

    def obtain(self, flight: InFlight, shards: list[int]) -> tuple[str, int, dict[int, CaughtUp]]:
        """θ(t+1) of `shards` when our group did not give it: (how, bytes, tensors). Waits while another member
        may still complete round t, then rebuilds it from the round's messages ("messages"), or loads a peer's
        state ("state", all shards at once), or, when nobody completed it, keeps θ(t) ("void"). "behind": we hold
        the θ of an earlier certified round (we voided rounds the others certified, cut off from them), so round
        t's messages do not apply to it; `catch_up` rebuilds the rounds in between before the next round, each with
        its upkeep. Told at once when others hold the certified θ(t) we lack: rebuilt, we rejoin round t while its
        members may still be waiting for our seal (a restarted member's base may be us alone). "failed": others are
        ahead but served nothing usable (the next round's catch-up tries again)."""
        from hivemind.utils import get_dht_time

        t = flight.round
        ours = flight.plan.deadline or get_dht_time()
        patience = flight.plan.grace_s + self.timeouts.round_timeout_s
        outcomes = {s: future.result() for s, future in flight.futures.items()}
        # members that sealed a round we could not certify read the seals we did: they will not certify it either
        stuck = {pid for outcome in outcomes.values() for pid in outcome.sealed_by}
        if self.membership.record.train_round == t:  # not the next round's, training meanwhile (--overlap)
            self.announce(train_round=-1, deadline=0.0)  # we bring nothing more to round t: nobody waits for us
        while not self.stop.is_set():
            records = self.records()
            donors = {pid: r for s in shards for pid, r in view.shard_donors(records, s).items()}  # any shard's holders
            if any(pid != self.me and r.certified > t for pid, r in donors.items()):
                got = self.rebuild_round(t, shards) if self.messages_cheaper(1, records) else None
                if got is not None:
                    return "messages", got[1], got[0]
                if self.certified < t and self.messages_cheaper(t + 1 - self.certified, records):
                    return "behind", 0, {}
                size = self.load_state(min_round=t + 1, wait_s=0.0)
                return ("state", size, {}) if size is not None else ("failed", 0, {})
            ahead_of_us = any(pid != self.me and r.round == r.certified == t for pid, r in donors.items())
            if ahead_of_us and self.certified < t and self.messages_cheaper(t - self.certified, records):
                return "behind", 0, {}  # they start t from a certified θ(t) we lack: rebuild it, rejoin t
            still = [pid for pid, r in donors.items() if pid not in stuck | {self.me} and view.coming(r, t)]
            # the round ends at the latest deadline its members announced (one late to it planned it later), within
            # one more round timeout of ours
            latest = max([ours, *(donors[pid].deadline for pid in still if donors[pid].train_round == t)])
            # before our deadline a round is not over for lack of members in it: a stage that gave round t up at its
            # start read the full replicas' records while they still took round t−1's result (train_round −1) and
            # voided t, which they certified seconds later (the kill soak's last disagreeing round)
            nobody = not still and get_dht_time() > ours
            if nobody or get_dht_time() > min(latest, ours + self.timeouts.round_timeout_s) + patience:
                break
            self.stop.wait(0.5)
        if self.stop.is_set():
            return "failed", 0, {}
        logger.warning("round %d: nobody completed it; going on from round %d's weights", t, t)
        fps = self.fingerprints()
        owed = {s: p.payload for s, p in flight.pendings.items() if s in outcomes and outcomes[s].deferred}
        for shard in shards:
            self.syncs[shard].serve_void(t, self.start[shard], fps[str(shard)], owed.get(shard))
        return "void", 0, {s: CaughtUp(self.start[s], 0, self.me, {}, self.syncs[s].certificate) for s in shards}

    def messages_cheaper(self, behind: int, records: dict[str, PeerRecord]) -> bool:
        """Whether rebuilding `behind` rounds from their messages beats loading the state: the messages are still
        served (KEPT_ROUNDS) and all of them together weigh less than half the state."""
        if not 0 < behind <= KEPT_ROUNDS or not all(sync.small_messages for sync in self.syncs.values()):
            return False
        replicas = max(1, view.replica_count(records, self.run_cfg.outer.stages))
        per_round = aggregated(replicas, contributor_limit(self.run_cfg.outer))  # a manifest lists at most K
        messages = sum(sync.method.max_message_bytes for sync in self.syncs.values()) * per_round * behind
        return 2 * messages < sum(sync.state_bytes for sync in self.syncs.values())

    def rebuild_round(self, round_: int, shards: list[int]) -> tuple[dict[int, CaughtUp], int] | None:
        """θ(t+1) of `shards` from round t's messages, served by peers that completed it; None if any failed."""
        records = self.records()
        voters = self.runtime.voters(records)
        fps = self.fingerprints()
        rebuilt = {}
        for shard in shards:  # a round's messages are served by whoever held the shard: stage peers too
            holders = view.shard_donors(records, shard)
            order = [pid for pid, r in holders.items() if r.certified > round_ and pid != self.me]
            random.shuffle(order)  # never an order a peer can choose (ids can be ground low)
            order.sort(key=lambda pid: pid not in voters)  # voters first: a record alone is no donor to trust
            vouched = view.vouched_fingerprint(voters, round_ + 1, str(shard), self.me)
            got = catch_up_shard(
                self.syncs[shard],
                round_,
                self.start[shard],
                fps[str(shard)],
                order,
                self.timeouts.fetch_timeout_s,
                vouched,
            )
            if got is None:
                return None
            self.syncs[shard].adopt(got.certificate)
            rebuilt[shard] = got
        return rebuilt, sum(got.bytes_received for got in rebuilt.values())
