"""Trusted introduction: the peer a node joined through tells it whom it has seen running.

A fresh node trusts nothing it reads: at 10⁵ record-only ids its record cap (4,096) keeps each honest record with
odds of 4%, and its 64 challenges a read find none of them for minutes (`make bench-sybil`: blind). It already trusts
one peer, though: the one its join line names, which tells it the run (`RUN_KEY_HANDLER`) over a connection libp2p
authenticates. That peer answers this RPC with the peers it has seen running: a bootstrap the DHT nodes in its routing
table (each reached it over an authenticated connection; a record alone never does), a running node those it saw
working or answering its challenges (`WorkLedger.introduction`). The joiner challenges and keeps those first
(`WorkLedger.note_introduced`); the introduction orders, it does not vouch: an introduced peer still answers the
joiner's own challenge before its vote counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from hetero_node.protocol.keys import KEY_PREFIX
from hetero_node.protocol.proto_build import load_proto_module

wire = load_proto_module("wire")

INTRODUCE = f"{KEY_PREFIX}.introduce"
MAX_INTRODUCED = 256
"""Peers one introduction names at most (either side): a few times what a joiner challenges in one read."""
MAX_PEER_ID_CHARS = 64
"""Longer strings are no base58 peer id (RSA ids are 46 characters): dropped, never stored."""


async def register_introduction_handler(p2p: Any, running: Callable[[], Iterable[str]]) -> None:
    """Answer introductions on `p2p` (a hivemind P2P) with `running()`'s first `MAX_INTRODUCED` peer ids."""

    async def introduce(_request: Any, _context: Any) -> Any:
        peers = []
        for peer in running():
            if len(peers) == MAX_INTRODUCED:
                break
            peers.append(str(peer))
        return wire.IntroductionReply(peer_ids=peers)

    await p2p.add_protobuf_handler(INTRODUCE, introduce, wire.IntroductionRequest)


async def ask_introduction(p2p: Any, peer: Any, timeout: float) -> list[str]:
    """The peers `peer` (a hivemind PeerID) introduces; [] when it does not answer in `timeout` (a stock
    hivemind-dht has no such handler). A reply's excess or malformed entries are dropped."""
    try:
        reply = await asyncio.wait_for(
            p2p.call_protobuf_handler(peer, INTRODUCE, wire.IntroductionRequest(), wire.IntroductionReply), timeout
        )
    except Exception:
        return []
    return [p for p in reply.peer_ids[:MAX_INTRODUCED] if 0 < len(p) <= MAX_PEER_ID_CHARS]
