"""What every command line of the project shares: its consoles, logging, `--log-level`/`--version`, the error
rule (a `HeteroNodeError` is one red line and exit code 1, never a traceback) and help grouped into panels.

`hetero-node` (app.py) and the lab's `hetero-node-lab` (bench/cli.py) are both made by `command_line`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from enum import StrEnum
from importlib.metadata import version
from typing import Any

import click
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from hetero_node.protocol.errors import HeteroNodeError

DISTRIBUTION = "hetero-node"

console = Console()
err_console = Console(stderr=True)


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def configure_logging(level: LogLevel) -> None:
    """Rich log lines on stderr (they scroll above a live progress bar); hivemind reads its level from the
    environment when first imported, which no command does before this runs."""
    os.environ["HIVEMIND_LOGLEVEL"] = level.value
    if err_console.is_terminal:
        handler: logging.Handler = RichHandler(console=err_console, show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:  # a log file: one unwrapped line per record, greppable
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.value, handlers=[handler], force=True)


def _panels(items: list[tuple[str | None, Any]], default: str, order: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """Items grouped by their `rich_help_panel` (Typer keeps it on commands and options): the panels in `order`
    first, then the others as first seen."""
    panels: dict[str, list[Any]] = {name: [] for name in order}
    for panel, item in items:
        panels.setdefault(panel or default, []).append(item)
    return {name: entries for name, entries in panels.items() if entries}


class PanelGroup(TyperGroup):
    """Plain-text help (no rich markup: "[run]" in a help text must stay as written) with commands listed under
    their panels, as rich help would group them."""

    panel_order: tuple[str, ...] = ()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        shown = [(getattr(c, "rich_help_panel", None), (n, c)) for n, c in commands if c is not None and not c.hidden]
        for panel, entries in _panels(shown, "Commands", self.panel_order).items():
            limit = formatter.width - 6 - max(len(name) for name, _ in entries)
            with formatter.section(panel):
                formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in entries])


class PanelCommand(TyperCommand):
    """A command whose options are listed under their panels (`options.py` gives each config dataclass one)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = [(getattr(p, "rich_help_panel", None), p.get_help_record(ctx)) for p in self.get_params(ctx)]
        for panel, rows in _panels([(panel, row) for panel, row in records if row], "Options").items():
            with formatter.section(panel):
                formatter.write_dl(rows)


class CommandLine(typer.Typer):
    """A Typer app whose commands list their options by panel."""

    def command(self, *args: Any, cls: type[TyperCommand] = PanelCommand, **kwargs: Any) -> Callable:  # type: ignore[override]
        return super().command(*args, cls=cls, **kwargs)


def command_line(name: str, help: str, panels: tuple[str, ...] = ()) -> CommandLine:
    """A Typer app with the project's conventions and its global options; `panels`: the order its help lists
    its command panels in."""
    app = CommandLine(
        name=name,
        help=help,
        cls=type("Panels", (PanelGroup,), {"panel_order": panels}),
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,  # locals of a training loop are tensors: noise, and slow to render
        rich_markup_mode=None,  # help texts are plain: "[run] tables" must not be read as (and eaten by) rich markup
    )

    def show_version(value: bool) -> None:
        if value:
            typer.echo(f"{name} {version(DISTRIBUTION)}")
            raise typer.Exit()

    @app.callback()
    def global_options(
        log_level: LogLevel = typer.Option(
            LogLevel.WARNING, "--log-level", case_sensitive=False, help="Log verbosity (hivemind's included)."
        ),
        _version: bool = typer.Option(
            False, "--version", callback=show_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        configure_logging(log_level)

    return app


def run(app: typer.Typer) -> None:
    """Console-script entry point: a `HeteroNodeError` becomes `error: ...` and exit code 1, never a traceback."""
    try:
        app(prog_name=app.info.name)
    except HeteroNodeError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
        sys.exit(1)


def print_plain(text: str) -> None:
    """Text (a report's Markdown, a path) on stdout exactly as given: no markup, highlighting or wrapping."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def run_with_progress(run: Callable[[Any, Any], dict], render: Callable[[dict], str], cfg: Any) -> None:
    """A long run with a progress bar on stderr, then its report's Markdown on stdout."""
    from rich.progress import Progress

    with Progress(console=err_console) as progress:
        report = run(cfg, progress)
    print_plain(render(report))


def format_value(value: object) -> str:
    """A summary's value for a table: thousands separated, floats to 3 decimals below 1,000."""
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
