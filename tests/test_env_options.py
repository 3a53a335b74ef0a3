"""Every option built from a config dataclass can be set by a `HETERO_NODE_*` environment variable (Docker,
compose files and systemd units configure nodes that way); the command line wins over it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import typer
from typer.testing import CliRunner

from hetero_node.client.cli.options import env_name, expand_dataclass_options, explicit_options


@dataclass(frozen=True)
class Knobs:
    round_timeout_s: float = field(default=20.0, metadata={"help": "A float."})
    peers: list[str] = field(default_factory=list, metadata={"help": "A list."})
    overlap: bool = field(default=False, metadata={"help": "A flag."})


def app() -> typer.Typer:
    cli = typer.Typer()

    @cli.command()
    @expand_dataclass_options
    def show(context: typer.Context, knobs: Knobs) -> None:
        print(knobs, sorted(explicit_options(context)))

    return cli


def test_an_environment_variable_sets_an_option_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name("round_timeout_s") == "HETERO_NODE_ROUND_TIMEOUT_S"
    monkeypatch.setenv("HETERO_NODE_ROUND_TIMEOUT_S", "7.5")
    monkeypatch.setenv("HETERO_NODE_PEERS", "/ip4/10.0.0.1/tcp/1/p2p/QmA /ip4/10.0.0.2/tcp/2/p2p/QmB")
    monkeypatch.setenv("HETERO_NODE_OVERLAP", "1")
    out = CliRunner().invoke(app(), []).output
    assert "round_timeout_s=7.5" in out and "overlap=True" in out
    assert "peers=['/ip4/10.0.0.1/tcp/1/p2p/QmA', '/ip4/10.0.0.2/tcp/2/p2p/QmB']" in out
    assert "['overlap', 'peers', 'round_timeout_s']" in out, "set by the environment counts as chosen by the user"
    out = CliRunner().invoke(app(), ["--round-timeout-s", "3"]).output
    assert "round_timeout_s=3.0" in out


def test_the_products_commands_read_the_variables_and_name_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetero_node.client.cli.app import app as product

    monkeypatch.setenv("HETERO_NODE_INNER_STEPS", "thirty")
    result = CliRunner().invoke(product, ["bootstrap", "--port", "0"])
    assert result.exit_code == 2
    assert "Invalid value for '--inner-steps'" in result.output and "integer" in result.output
