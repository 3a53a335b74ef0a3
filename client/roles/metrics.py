"""One JSON object per round in a JSONL file: what the demo, the report and the benchmarks read."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module: it must not load hivemind (protocol.records does)
    from hetero_node.protocol.records import RoundSummary


@dataclass
class RoundRecord:
    """The stable keys of a round's metrics (the report schema relies on them; add fields, never rename)."""

    round: int
    inner_steps: int
    """Inner steps this replica trained in the round (rounds are time-boxed: fewer on a slower machine)."""
    tokens: int
    """Tokens trained in the round: the weight of its contribution."""
    train_loss: float | None
    """None on pipeline stages other than the last (the loss is computed there)."""
    eval_loss: float | None
    bytes_sent: int
    """Blob bytes this peer served since its previous round record (its messages as others fetched them, state
    and manifests for those catching up), as streamed."""
    bytes_received: int
    """Bytes of the round's messages it downloaded, plus what catching up cost."""
    compute_s: float
    comm_s: float
    fingerprints: dict[str, str]
    group_size: int = 0
    contributors: int = 0
    """Messages in the round's aggregate (the fewest over its shards); for a shard rebuilt from messages, as many
    as the round's manifest lists."""
    dropped: list[str] = field(default_factory=list)
    resynced: bool = False
    """This replica trained, but its contribution is not in the round's aggregate (it missed the group)."""
    deferred: bool = False
    """Its valid message was left out by the round's selection (`--max-contributors`): the Δ stays owed in its error
    feedback for a later round (not a resync)."""
    messages_relayed: int = 0
    """Round messages it downloaded from a relay parent (a member that verified them first) instead of their author."""
    messages_prefetched: int = 0
    """Round messages whose download from their author started while the round's set was still being sealed."""
    dense_allreduce_bytes: int = 0
    """What a dense fp32 butterfly all-reduce of the same weights would send per peer in this group."""
    boundary_bytes_sent: int = 0
    """Pipeline stages: bytes of the training messages this stage sent to its neighbours (as streamed)."""
    boundary_bytes_received: int = 0
    boundary_tokens: int = 0
    """Tokens carried by the training messages this stage sent."""
    table_bytes_received: int = 0
    """Stages without the embedding: bytes downloaded to keep T_fixed current (E_S's changed entries each round,
    or both tables whole when it had no current copy of E_S)."""
    contributed: bool = False
    """Its message is part of the aggregate of a group of at least two (every shard it holds)."""
    sat_out: bool = False
    """It trained too little to contribute (late start, broken pipeline) and received the round's result."""
    caught_up: str = ""
    """How it got θ(t+1) when not from its group: "messages" (the round's manifest and messages), "state" (a
    peer's whole state), "void" (nobody completed the round: θ(t+1) = θ(t)), "behind" (it holds an earlier
    certified round's θ and rebuilds the rounds since from their messages before its next round), "failed" (nothing
    usable yet); "" from its group."""
    catch_up_bytes: int = 0
    """Bytes downloaded to catch up this round (messages or state)."""
    uncertified: bool = False
    """Its round's seals came from no majority of the quorum base (`protocol/quorum.py`): it did not apply its own
    result (a minority cut off from the others voids the round; a member that read too few seals catches up)."""
    wait_s: float = 0.0
    """Seconds training was blocked waiting for the round's exchange (with --overlap only what did not overlap)."""
    round_s: float = 0.0
    """The round length the deadline came from (0: not time-boxed)."""
    overhead_s: float = 0.0
    """What a round costs this replica outside training, as its clock estimates it (exchange, outer step,
    catch-up, planning: the time between the end of one round's training and the start of the next's)."""
    accumulation: int = 1
    """Batches each inner step accumulated (more than 1 in a round stretched for a fast device)."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Where the round's time outside training went, in seconds (the slowest shard's, where a phase is per shard):
    encode (error feedback, top-k, 2-bit coding, serving the message), agree (statements and seals in the DHT, and a
    heal), fetch (the selected messages), judge (under `--admission loss`: scoring them on the probe batches and
    agreeing the verdicts), outer (decode, combine, outer step, fingerprint, serving the manifest),
    apply (θ(t+1) into the model, start point, fingerprints, served state), eval, checkpoint. What to profile when
    utilisation is low: `overhead_s` is their sum plus waiting for the slowest member."""
    ended_at: float = 0.0
    """Wall-clock (Unix) time the record was written."""
    trained_at: float = 0.0
    """Wall-clock (Unix) time the round's training ended (0: it trained nothing). Compute utilisation is Σ
    compute_s over the time between two rounds' ends of training: under --overlap a record is written when its
    round settles, mid-way through the next round's training, so the records' own times differ by one round's
    exchange from the next's (the last round, settled with nothing training, looked 12% shorter than it was)."""


def round_summary(record: RoundRecord) -> RoundSummary:
    """The part of a round's record the swarm sees in our peer record (outer and boundary bytes together)."""
    from hetero_node.protocol.records import RoundSummary

    finite = record.eval_loss is not None and math.isfinite(record.eval_loss) and 0 <= record.eval_loss <= 1e4
    return RoundSummary(
        round=record.round,
        contributed=record.contributed,
        deferred=record.deferred,
        eval_loss=record.eval_loss if finite else None,
        bytes_sent=record.bytes_sent + record.boundary_bytes_sent,
        bytes_received=record.bytes_received + record.boundary_bytes_received,
    )


class MetricsWriter:
    """Appends records to a JSONL file, one line per round, flushed immediately so others can tail it."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps({"header": header}) + "\n")

    def write(self, record: RoundRecord) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(asdict(record)) + "\n")


def read_metrics(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(last header, round records) of a metrics file; partial trailing lines are ignored (file being written)."""
    header: dict[str, Any] = {}
    rounds: list[dict[str, Any]] = []
    if not path.exists():
        return header, rounds
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "header" in obj:
            header = obj["header"]
        else:
            rounds.append(obj)
    return header, rounds
