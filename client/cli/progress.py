"""Terminal display for the CLI: a live bar while training, tables for results.

The training code reports through plain callbacks and dataclasses; only this module and the CLI know about
`rich`, so the same jobs run silently inside tests and benchmarks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hetero_node.client.roles.local_train import ProgressCallback, TrainProgress, TrainSummary
from hetero_node.client.roles.metrics import RoundRecord

ROUND_LOG = logging.getLogger("hetero_node.rounds")


@contextmanager
def training_progress(console: Console, title: str) -> Iterator[ProgressCallback]:
    """A live bar (step/total, train and eval loss, tokens/s, ETA); yields the callback that advances it.

    The total stays unknown (a pulsing bar) until the job's first report, which covers data preparation. The bar
    is transient: once the job ends or fails, the summary table or the error line takes its place.
    """
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[train_loss]}"),
        TextColumn("eval {task.fields[eval_loss]}"),
        TextColumn("{task.fields[speed]} tok/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(title, total=None, train_loss="-", eval_loss="-", speed="-")

        def advance(state: TrainProgress) -> None:
            progress.update(
                task,
                total=state.total_steps,
                completed=state.step,
                train_loss="-" if state.train_loss is None else f"{state.train_loss:.3f}",
                eval_loss=f"{state.eval_loss:.3f}",
                speed=f"{state.tokens_per_s:,.0f}",
            )

        yield advance


def format_value(value: object) -> str:
    """Integers with thousands separators, floats to 4 significant digits, anything else as `str`."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(console: Console, title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A titled table, cells through `format_value`: one shape for run summaries and run-vs-run comparisons.

    All-empty column names (a label/value listing) hide the header row.
    """
    table = Table(title=title, title_justify="left", show_header=any(columns))
    for i, name in enumerate(columns):
        table.add_column(name, style="bold" if i == 0 else None, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(format_value(cell) for cell in row))
    console.print(table)


def train_summary_rows(summary: TrainSummary) -> list[tuple[str, object]]:
    """(label, value) rows describing a local run, for a two-column `print_table`."""
    return [
        ("preset", summary.preset),
        ("parameters", summary.n_params),
        ("device", summary.device),
        ("data identity", summary.data_identity[:16]),
        ("steps", summary.steps),
        ("tokens", summary.tokens),
        ("wall time", f"{summary.wall_s:.1f} s"),
        ("tokens/s (training)", f"{summary.tokens_per_s:,.0f}"),
        ("eval loss", f"{summary.initial_eval_loss:.3f} → {summary.final_eval_loss:.3f}"),
    ]


class RoundLog:
    """One plain log line per round and a summary when the node leaves: what a node without a terminal (Docker,
    systemd, nohup) shows instead of the live status line. Its lines are INFO, shown at the default --log-level
    (WARNING) too, since they are all an unattended node says; --log-level ERROR silences them."""

    def __init__(self) -> None:
        if logging.getLogger().getEffectiveLevel() < logging.ERROR:
            ROUND_LOG.setLevel(logging.INFO)
        self.rounds = self.contributed = self.steps = self.bytes_sent = self.bytes_received = 0
        self.loss: float | None = None

    def __call__(self, record: RoundRecord) -> None:
        self.rounds += 1
        self.contributed += record.contributed
        self.steps += record.inner_steps
        self.bytes_sent += record.bytes_sent
        self.bytes_received += record.bytes_received
        self.loss = record.train_loss if record.train_loss is not None else self.loss
        ROUND_LOG.info(
            "round %d: %d steps, loss %s, %d contributors%s, %s bytes sent, %s received, %.1f s",
            record.round, record.inner_steps, _loss(record.train_loss), record.contributors,
            f" (caught up from {record.caught_up})" if record.caught_up else "", format_value(record.bytes_sent),
            format_value(record.bytes_received), record.compute_s + record.comm_s,
        )  # fmt: skip

    def summary(self) -> None:
        ROUND_LOG.info(
            "left the swarm after %d rounds (%d contributed): %s steps, last loss %s, %s bytes sent, %s received",
            self.rounds, self.contributed, format_value(self.steps), _loss(self.loss), format_value(self.bytes_sent),
            format_value(self.bytes_received),
        )  # fmt: skip


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
