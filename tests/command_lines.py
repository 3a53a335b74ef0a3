"""What a process started with a `hetero-node` (or `hetero-node-lab`) command line gets: the command line parsed
by the real command, nothing run. The tests of the command lines the demo and the lab write check these values,
not how the options are spelled."""

from __future__ import annotations

import sys
from typing import Any

import typer

PROGRAMS = {"hetero_node.client.cli": "product", "hetero_node.bench": "lab"}


def parse_argv(argv: list[str]) -> tuple[str, dict[str, Any], set[str]]:
    """(command, its parameters, those the command line gave) of `argv`: a `[python, -m, module, ...]` command
    line (the product's unless the module is the lab's) or one without the program, global options first."""
    from hetero_node.bench.cli import lab
    from hetero_node.client.cli.app import app

    program = "product"
    if argv and argv[0] == sys.executable:
        program, argv = PROGRAMS[argv[2]], argv[3:]
    while argv and argv[0].startswith("--"):  # the program's own options (--log-level X)
        argv = argv[2:]
    group = typer.main.get_command(lab if program == "lab" else app)
    command = group.commands[argv[0]]  # type: ignore[attr-defined]
    context = command.make_context(argv[0], list(argv[1:]))
    given = {n for n in context.params if getattr(context.get_parameter_source(n), "name", None) == "COMMANDLINE"}
    return argv[0], context.params, given
