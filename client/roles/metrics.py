"""One JSON object per round in a JSONL file: what the demo, the report and the benchmarks read."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RoundRecord:
    """The stable keys of a round's metrics (the report schema relies on them; add fields, never rename)."""

    round: int
    inner_steps: int
    tokens: int
    train_loss: float | None
    """None on pipeline stages other than the last (the loss is computed there)."""
    eval_loss: float | None
    bytes_sent: int
    bytes_received: int
    compute_s: float
    comm_s: float
    fingerprints: dict[str, str]
    group_size: int = 0
    contributors: int = 0
    dropped: list[str] = field(default_factory=list)
    resynced: bool = False
    dense_allreduce_bytes: int = 0
    """What a dense fp32 butterfly all-reduce of the same weights would send per peer in this group."""
    boundary_bytes_sent: int = 0
    """Pipeline stages: bytes of the training messages this stage sent to its neighbours (as streamed)."""
    boundary_bytes_received: int = 0
    boundary_tokens: int = 0
    """Tokens carried by the training messages this stage sent."""


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
