"""The algorithm lab's report: mean ± std over seeds per cell, the paper's three findings as tables, and plots.

Pure functions of `report.json`'s content, so the arithmetic is tested on synthetic runs.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero_node.bench import results
from hetero_node.bench.config import SIM_METHODS
from hetero_node.bench.sim_traffic import messages_moved

WITHIN = 0.03
"""Finding 1's tolerance: SparseLoCo "reaches" DiLoCo's eval loss when within 3% of it."""


@dataclass(frozen=True)
class CellSummary:
    """A cell over its seeds."""

    cell: str
    method: str
    replicas: int
    inner_steps: int
    topk: int | None
    rank_divisor: int | None
    finals: list[float]
    """Eval loss after the last round, per seed."""
    curve: list[float]
    """Eval loss after each round, mean over seeds."""
    tokens: list[int]
    """Tokens trained by the swarm after each round."""
    bytes_sent: list[float]
    """Bytes one replica sent so far after each round, mean over seeds."""
    traffic: dict[str, float]
    """Bytes per replica per round by kind (outer, boundary, table), mean over rounds and seeds."""
    contributors: int = 0
    """K: messages a round aggregated (0: every replica's)."""
    slow: int = 0
    slow_factor: int = 1
    window: int = 1
    """Slow replicas' contributions: once per `window` rounds (0: they sat out); see `sim_cadence`."""
    slow_rule: str = ""
    accumulation: int = 1
    slow_steps: str = "fewer"

    @property
    def setting(self) -> tuple:
        """Everything but the slow replicas' window, stale rule and step shape (the first seven: every replica's)."""
        return (self.method, self.replicas, self.inner_steps, self.topk, self.rank_divisor, self.contributors,
                self.accumulation, self.slow, self.slow_factor)  # fmt: skip

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def std(self) -> float:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else 0.0

    @property
    def bytes_per_round(self) -> float:
        return sum(self.traffic.values())

    @property
    def message_bytes(self) -> float:
        """One replica's outer message (ddp: one step's gradient buffer), from what its exchange moved."""
        return self.traffic["outer"] / messages_moved(self.method, self.replicas, self.inner_steps, self.contributors)


def _columns(rows: list[list[float]]) -> list[float]:
    return [statistics.fmean(col) for col in zip(*rows, strict=True)]


def _grid_position(run: dict[str, Any]) -> tuple:
    known = run["method"] in SIM_METHODS
    return (SIM_METHODS.index(run["method"]) if known else len(SIM_METHODS), run["method"], run["replicas"],
            run["inner_steps"], run["topk"] or 0, run["rank_divisor"] or 0, run.get("contributors", 0),
            run.get("accumulation", 1), run.get("slow", 0), run.get("window", 1), run.get("slow_rule", ""),
            run.get("slow_steps", "fewer"))  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, CellSummary]:
    """Group runs by cell and average over seeds; cells in the grid's order (method, then the swept values), whatever
    order the runs came in (a sweep split across processes is merged by concatenating their runs)."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_cell[run["cell"]].append(run)
    out = {}
    for name, group in sorted(by_cell.items(), key=lambda item: _grid_position(item[1][0])):
        group = sorted(group, key=lambda run: run["seed"])  # seed by seed, so that gaps pair like with like
        first = group[0]
        rounds = [r["rounds"] for r in group]
        kinds = first["rounds"][0]["traffic"].keys()
        out[name] = CellSummary(
            cell=name, method=first["method"], replicas=first["replicas"], inner_steps=first["inner_steps"],
            topk=first["topk"], rank_divisor=first["rank_divisor"], finals=[r[-1]["eval_loss"] for r in rounds],
            curve=_columns([[p["eval_loss"] for p in r] for r in rounds]), tokens=[p["tokens"] for p in rounds[0]],
            bytes_sent=_columns([[p["bytes_per_replica"] for p in r] for r in rounds]),
            traffic={k: statistics.fmean(p["traffic"][k] for r in rounds for p in r) for k in kinds},
            contributors=first.get("contributors", 0), slow=first.get("slow", 0),
            slow_factor=first.get("slow_factor", 1), window=first.get("window", 1),
            slow_rule=first.get("slow_rule", ""), accumulation=first.get("accumulation", 1),
            slow_steps=first.get("slow_steps", "fewer"),
        )  # fmt: skip
    return out


def gap(value: float, reference: float) -> float:
    """Relative excess of `value` over `reference` (0.05: 5% higher loss)."""
    return value / reference - 1


def paired_gap(cell: CellSummary, reference: CellSummary) -> str:
    """Seed by seed (same weights and data order), `cell`'s final loss over `reference`'s: mean ± std of the
    relative gaps, which removes most of the run-to-run noise both share."""
    gaps = [gap(c, r) for c, r in zip(cell.finals, reference.finals, strict=True)]
    spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return f"{statistics.fmean(gaps):+.1%} ± {spread:.1%}"


def rounds_to_reach(curve: list[float], reference: list[float], within: float = WITHIN) -> int | None:
    """First round (1-based) from which `curve` stays within `within` of `reference` to the end; None if never."""
    for t in range(len(curve)):
        if all(gap(c, r) <= within for c, r in zip(curve[t:], reference[t:], strict=True)):
            return t + 1
    return None


def _loss(s: CellSummary) -> str:
    return f"{s.mean:.3f} ± {s.std:.3f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _setting(s: CellSummary) -> tuple[int, int, int | None]:
    return s.replicas, s.inner_steps, s.topk


def finding_outer(cells: dict[str, CellSummary]) -> list[str]:
    """1. SparseLoCo against DiLoCo (and DDP) at equal tokens: loss gap, when it closes, message and exchange bytes."""
    rows = []
    for dl in (c for c in cells.values() if c.method == "diloco"):
        for c in cells.values():
            if c.method in ("sparseloco", "ddp") and (c.replicas, c.inner_steps) == (dl.replicas, dl.inner_steps):
                reach = rounds_to_reach(c.curve, dl.curve)
                rows.append([c.cell, _loss(c), _loss(dl), paired_gap(c, dl),
                             "never" if reach is None else str(reach), _bytes(c.message_bytes),
                             f"{dl.message_bytes / c.message_bytes:.1f}×", _bytes(c.bytes_per_round),
                             f"{dl.bytes_per_round / c.bytes_per_round:.1f}×"])  # fmt: skip
    header = ["cell", "eval loss", "DiLoCo's", "gap", f"within {WITHIN:.0%} from round", "message",
              "DiLoCo's ÷ this", "bytes/replica/round", "DiLoCo's ÷ this"]  # fmt: skip
    return _table(header, rows) if rows else []


def finding_composes(cells: dict[str, CellSummary]) -> list[str]:
    """2. Compressed virtual replicas (hetero) against uncompressed ones (none): what compression costs."""
    rows = []
    for dense in (c for c in cells.values() if c.method == "none"):
        for c in cells.values():
            if c.method == "hetero" and _setting(c) == _setting(dense):
                rows.append([c.cell, _loss(c), _loss(dense), paired_gap(c, dense),
                             _bytes(c.traffic["boundary"]), _bytes(dense.traffic["boundary"]),
                             _bytes(c.traffic["table"])])  # fmt: skip
    header = ["cell", "eval loss", "uncompressed VRs'", "cost", "boundary bytes/replica/round", "uncompressed",
              "T_fixed bytes/replica/round"]  # fmt: skip
    return _table(header, rows) if rows else []


def finding_selective(cells: dict[str, CellSummary]) -> list[str]:
    """3. Selective compression (hetero) against compress-all, rank by rank: does the gap grow with compression?"""
    rows = []
    for c in cells.values():
        if c.method != "hetero":
            continue
        for a in cells.values():
            if a.method == "compress-all" and (_setting(a), a.rank_divisor) == (_setting(c), c.rank_divisor):
                rows.append([f"d/{c.rank_divisor}", c.cell, _loss(c), _loss(a), paired_gap(a, c),
                             _bytes(c.bytes_per_round), _bytes(a.bytes_per_round)])  # fmt: skip
    header = ["rank", "cell", "hetero eval loss", "compress-all's", "compress-all's excess",
              "hetero bytes/replica/round", "compress-all's"]  # fmt: skip
    return _table(header, rows) if rows else []


def slow_token_value(cell: CellSummary, sit_out: CellSummary, all_fast: CellSummary) -> float:
    """What a slow replica's token was worth in `cell`, a fast replica's being 1: the share of the loss that
    `all_fast` (every replica fast) gains over `sit_out` (the slow ones idle) which `cell` gains, over the share of
    `all_fast`'s extra tokens which `cell` adds (loss linear in tokens between the two: a first estimate)."""
    gained = (sit_out.mean - cell.mean) / (sit_out.mean - all_fast.mean)
    added = (cell.tokens[-1] - sit_out.tokens[-1]) / (all_fast.tokens[-1] - sit_out.tokens[-1])
    return gained / added


def finding_slow(cells: dict[str, CellSummary]) -> list[str]:
    """4. Slow replicas: every round or once per window, by rule, against sitting out and against every replica fast."""
    rows = []
    for c in cells.values():
        if not c.slow or not c.window:
            continue
        same = [r for r in cells.values() if r.setting == c.setting]
        sit_out = next((r for r in same if r.window == 0), None)
        fresh = next((r for r in same if r.window == 1 and r.slow_rule == "plain" and r.slow_steps == "fewer"), None)
        fast = next((r for r in cells.values() if not r.slow and r.setting[:7] == c.setting[:7]), None)
        value = slow_token_value(c, sit_out, fast) if sit_out and fast and fast.mean < sit_out.mean else None
        rows.append([c.cell, _loss(c), paired_gap(c, sit_out) if sit_out else "n/a",
                     paired_gap(c, fresh) if fresh and fresh is not c else "", f"{c.tokens[-1]:,}",
                     "n/a" if value is None else f"{value:.2f}"])  # fmt: skip
    header = ["cell", "eval loss", "against the slow ones sitting out", "against w1 plain", "tokens contributed",
              "a slow token's value (a fast one's = 1)"]  # fmt: skip
    return _table(header, rows) if rows else []


NOTE = (
    "Eval loss: mean ± std over seeds of θ after the last round, on the held-out batches; gaps are paired by seed "
    "(mean ± std of the per-seed relative differences). Bytes: per replica per round, from the encoded payloads "
    "(SparseLoCo: R−1 messages downloaded, K(R−1)/R with K of R contributors; DiLoCo: 2(R−1)/R of the dense buffer; "
    "ddp: the same per step; message: one replica's own, ddp's one step's gradients; boundaries: every activation "
    "and gradient message; T_fixed: the entries of E_S each later stage of a VR downloads to rebuild it, 8 bytes each)."
)


def render_markdown(report: dict[str, Any]) -> str:
    cells = summarize(report["runs"])
    config = report["config"]
    lines = [f"# Algorithm lab: `{config['preset']}`, {config['rounds']} rounds, {config['seeds']} seed(s)", ""]
    for title, table in (
        ("1. SparseLoCo reaches DiLoCo's loss with far fewer bytes", finding_outer(cells)),
        ("2. Activation compression composes with SparseLoCo", finding_composes(cells)),
        ("3. Selective compression beats compressing everyone", finding_selective(cells)),
        (
            "4. Slow replicas: every round or once per window, against sitting out",
            finding_slow(cells),
        ),
    ):
        if table:
            lines += [f"## {title}", "", *table, ""]
    rows = [[c.cell, str(len(c.finals)), _loss(c), *(_bytes(c.traffic[k]) for k in ("outer", "boundary", "table"))]
            for c in cells.values()]  # fmt: skip
    lines += ["## Every cell", "", *_table(["cell", "seeds", "final eval loss", "outer", "boundary", "T_fixed"], rows)]
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """report.json (as given), report.md and the plots under `out`."""
    results.write_report(out, report, render_markdown(report))
    write_plots(report, out)
    return report


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Eval loss against tokens and against bytes sent per replica, one line per cell (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    cells = summarize(report["runs"])
    paths = []
    for x_name, x_label, log in (("tokens", "tokens trained by the swarm", False),
                                 ("bytes_sent", "bytes sent per replica", True)):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 5))
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # a grid has more cells than the default 10 colours
        for c in cells.values():
            ax.plot(getattr(c, x_name), c.curve, label=c.cell, marker=".")
        ax.set(xlabel=x_label, ylabel="eval loss", xscale="log" if log else "linear")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = out / f"loss_vs_{x_name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
