"""Where every bench leaves its figures: `report.json` (the numbers) and `report.md` (the table) under `--out`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path, report: Any, markdown: str) -> None:
    """`report` as JSON and its rendered table, side by side in `out` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown)
