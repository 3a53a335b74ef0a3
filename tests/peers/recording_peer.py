"""A peer that trains and aggregates honestly and also records every aggregate it computes (for the tests).

Usage: python tests/peers/recording_peer.py <directory> <hetero-node args...>
It wraps the manifest step of the node's own shard sync, which sees exactly what the node aggregated: θ(t), each
used contribution (its weight and selected entries, decoded as the node decoded them) and θ(t+1). One file per
shard and round: `<directory>/shard<s>-round<t>.pt` (plain tensors and lists, loadable with weights_only=True).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hetero_node.client.cli import app
from hetero_node.client.outer.shard_sync import ShardSync
from hetero_node.protocol.sparseloco import dequantize

OUT = Path(sys.argv.pop(1))
OUT.mkdir(parents=True, exist_ok=True)
honest_serve = ShardSync._serve_manifest


def recording_serve(self: ShardSync, pending, used, new) -> None:  # type: ignore[no-untyped-def]
    contributions = []
    for received in used:
        msg = received.message
        parts = [(msg.plan(i).positions(part.indices), dequantize(part)) for i, part in enumerate(msg.tensors)]
        contributions.append({"name": received.name, "tokens": received.tokens, "parts": parts})
    record = {"start": pending.start, "new": new, "contributions": contributions}
    torch.save(record, OUT / f"shard{self.shard}-round{pending.round}.pt")
    honest_serve(self, pending, used, new)


ShardSync._serve_manifest = recording_serve  # the node's own aggregation path, recorded on the way out
app.main()
