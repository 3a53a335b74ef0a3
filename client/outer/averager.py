"""hivemind's DecentralizedAverager, with a per-round matchmaking key and group size.

Rounds must never mix: a peer still finishing round t must not match with one already in round t+1. The round
number therefore goes into the group bits of the matchmaking key. The expected group size changes as peers join
and leave; the averager forms a group as soon as that many peers are present, instead of always waiting the full
matchmaking window. Both settings live in the averager's background process, so they are sent through its
command pipe like hivemind's own `set_group_bits`.

A cancelled step is not over when its future says so: hivemind cancels its matchmaking task without awaiting it, and
that search still leads or joins groups with the old step's gathered metadata until its clean-up ends. Switching the
key during that window let a member's round-t metadata into round t+1's group (the others then left it out as
foreign). The key therefore changes only once no search is running.

This reaches into three attributes of hivemind 1.1.12's matchmaking (pinned exactly in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind import DecentralizedAverager
from hivemind.utils.mpfuture import MPFuture

ROUND_BITS = 16
"""Rounds are told apart modulo 2**16 in the matchmaking key; far more than peers can drift apart."""
SETTLE_POLL_S = 0.05


def round_group_bits(round_: int) -> str:
    return format(round_ % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


class ShardAverager(DecentralizedAverager):
    """One parameter shard's averaging group member (see module docstring)."""

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> dict[Any, Any]:
        """Return the gathered metadata and skip hivemind's all-reduce: payloads travel over our own verified
        streams. The all-reduce could fail for one member and succeed for another (a partial average reported
        as success: hivemind pitfall D in ARCHITECTURE.md), which would split the group's view of who took part;
        the leader's gathered list is the same for every member that got it."""
        gathered = {}
        for peer, item in zip(group_info.peer_ids, group_info.gathered, strict=True):
            _bandwidth, _mode, user_data = self.serializer.loads(item)
            gathered[peer] = self.serializer.loads(user_data)
        return gathered

    def prepare_round(self, round_: int, expected_group_size: int, settle_s: float) -> bool:
        """Match only with peers in the same round; stop waiting once `expected_group_size` peers are in. False when
        the previous step's search did not end within `settle_s` (the key is then left alone: skip this round's
        step)."""
        future = MPFuture()
        bits = round_group_bits(round_)
        self._outer_pipe.send(
            ("_prepare_round", [], dict(group_bits=bits, target=expected_group_size, settle_s=settle_s, future=future))
        )
        return future.result()

    async def _prepare_round(self, group_bits: str, target: int, settle_s: float, future: MPFuture) -> None:
        try:
            matchmaking: Any = self._matchmaking
            give_up = time.monotonic() + settle_s
            while matchmaking.is_looking_for_group:  # the previous step's search is still cleaning up
                if time.monotonic() > give_up:
                    future.set_result(False)
                    return
                await asyncio.sleep(SETTLE_POLL_S)
            matchmaking.group_key_manager.group_bits = group_bits
            matchmaking.target_group_size = target
            # the key manager re-keys after a group forms, sized by its own target: a group bigger than we expected
            # (another member counted one more) made it raise; our key is set anew each round anyway
            matchmaking.group_key_manager.target_group_size = None
            matchmaking.potential_leaders.target_group_size = target
            future.set_result(True)
        except Exception as e:
            if not future.done():
                future.set_exception(e)
