"""Commit, then reveal: a round's messages are served only to peers that have committed their own.

A member's statement (`RosterRound.state`) carries the digest of its message for round t of a shard: once it is in
the DHT the member cannot send anything else that round. Serving our message (or a copy we re-serve) to anyone who
asks would let a liar read the honest messages first and then state the message that cancels them, at the rule's
full allowance (the trust review's negating attacker kept 52% of the clean progress beside two honest replicas).
So a round's messages go only to peers whose statement of that round we have read (a receive-only member states
an empty one), and to anyone once the round is decided (our certificate covers it: catch-up and heal read decided
rounds only). An honest member fetches only after it stated (`ShardSync._prefetch`, `_exchange`); if our last
read of the statements does not show it yet, we read them again until it does or `STATEMENT_WAIT_S` passed; a
refusal is a "not yet" the fetcher retries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hetero_node.client.outer.roster_round import RosterRound

REREAD_S = 0.25
"""Least time between two reads of one round's statements made because an unknown peer asked for a message."""
STATEMENT_WAIT_S = 5.0
"""How long a request from a peer whose statement we have not read yet waits for it to show: stores are asynchronous,
and a member fetches as soon as it has stored its own (on a far link a store takes seconds: `PeerRuntime.store_s`)."""
KEPT_ROUNDS = 8
"""Rounds whose stated authors are remembered (the runtime serves messages of the last 4)."""


class RevealGate:
    """Who may fetch this shard's messages of a round: see the module docstring."""

    def __init__(self, roster: Callable[[int], RosterRound], decided_through: Callable[[], int]) -> None:
        """`roster(t)`: round t's roster; `decided_through()`: the newest round our certificate covers (−1: none)."""
        self.roster, self.decided_through = roster, decided_through
        self._stated: dict[int, set[str]] = {}
        self._read_at: dict[int, float] = {}

    def note_statements(self, round_: int, authors: set[str]) -> None:
        """Authors whose statements of `round_` a read of ours showed (the round's own wait for them reads them)."""
        self._stated.setdefault(round_, set()).update(authors)
        for old in [r for r in self._stated if r <= round_ - KEPT_ROUNDS]:
            del self._stated[old]
            self._read_at.pop(old, None)

    async def allows(self, peer: str, round_: int) -> bool:
        """Whether `peer` may have our messages of `round_` (called on the runtime's event loop). A statement is
        stored in the background and may land after its author asks (within `STATEMENT_WAIT_S`): we read the
        round's statements again meanwhile, one read per `REREAD_S` however many ask."""
        deadline = time.monotonic() + STATEMENT_WAIT_S
        while True:
            if round_ <= self.decided_through() or peer in self._stated.get(round_, ()):
                return True
            if time.monotonic() >= deadline:
                return False
            if time.monotonic() - self._read_at.get(round_, -REREAD_S) >= REREAD_S:
                self._read_at[round_] = time.monotonic()
                found = await asyncio.get_running_loop().run_in_executor(None, self.roster(round_).statements)
                self.note_statements(round_, set(found or ()))
                continue
            await asyncio.sleep(REREAD_S)
