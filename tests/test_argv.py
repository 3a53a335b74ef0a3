"""`to_argv`, the inverse of the options `expand_dataclass_options` builds: the command line it writes for a config
parses back, through the same options, to an equal config. Every process the demo, the lab and the tests start
gets its command line from it, so a renamed option or a changed default cannot leave them behind."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
from command_lines import parse_argv
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetero_node.bench.config import DDPWorkerConfig
from hetero_node.bootstrap.config import BootstrapConfig, RelayConfig
from hetero_node.client.cli.demo import DemoConfig
from hetero_node.client.cli.options import ENV_PREFIX, expand_dataclass_options, to_argv
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts, TrainConfig
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

RUN = (RunOptions, OuterConfig, OptimConfig, SparseLoCoConfig, PipelineConfig)
COMMANDS: dict[str, tuple[type, ...]] = {
    "join": (NodeConfig, RelayConfig, SyncTimeouts, *RUN),
    "bootstrap": (BootstrapConfig, RelayConfig, *RUN),
    "train": (TrainConfig, OptimConfig),
    "demo": (DemoConfig,),
}
"""The product's commands and the configs their options are built from."""

WORDS = (
    "tiny", "small", "diloco", "sparseloco", "robust", "fp16", "none", "compress-all", "bf16", "fp32", "relay",
    "direct", "cpu", "cuda:1", "127.0.0.1", "-1", "--peers", "a b", "x=y", "",
)  # fmt: skip
"""Strings worth trying: the choices the configs accept, and ones that look like numbers, options or pairs."""


def no_environment() -> dict[str, str | None]:
    """CliRunner's `env` that unsets every HETERO_NODE_* variable: the command line alone must rebuild the config."""
    return {name: None for name in os.environ if name.startswith(ENV_PREFIX)}


def values_of(hint: Any) -> st.SearchStrategy[Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return st.one_of(*(values_of(arg) for arg in typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return st.lists(values_of(typing.get_args(hint)[0]), max_size=3)
    strategies: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(-2, 5000),
        float: st.one_of(st.floats(-1e9, 1e9, allow_nan=False), st.sampled_from([0.0, 0.5, 1e-5, 3e-3, 7.0])),
        str: st.one_of(st.sampled_from(WORDS), st.text(st.characters(codec="ascii", exclude_categories=["Cc"]))),
        Path: st.sampled_from([Path("a.id"), Path("/tmp/r0.ckpt"), Path("dir with space/x.jsonl")]),
    }
    return strategies[hint]


@st.composite
def configs(draw: st.DrawFn, config_type: type) -> Any:
    """A valid config of `config_type` with some fields away from their defaults: each drawn value is kept if the
    config still validates (so no draw is thrown away)."""
    config = config_type()
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        if field.init and draw(st.booleans()):
            with contextlib.suppress(ConfigError, ValueError):
                config = dataclasses.replace(config, **{field.name: draw(values_of(hints[field.name]))})
    return config


def tiny_app(config_types: tuple[type, ...], seen: list[tuple[Any, ...]]) -> typer.Typer:
    """One command with the options of `config_types`, that records the configs it was called with."""

    def command(**configs: Any) -> None:
        seen.append(tuple(configs.values()))

    parameters = [
        inspect.Parameter(f"c{i}", inspect.Parameter.KEYWORD_ONLY, annotation=t) for i, t in enumerate(config_types)
    ]
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    cli = typer.Typer()
    cli.command()(expand_dataclass_options(command))
    return cli


@pytest.mark.parametrize("command", sorted(COMMANDS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_config_written_as_options_parses_back_to_itself(command: str, data: st.DataObject) -> None:
    config_types = COMMANDS[command]
    given_configs = tuple(data.draw(configs(t)) for t in config_types)
    seen: list[tuple[Any, ...]] = []
    argv = to_argv(*given_configs)
    result = CliRunner().invoke(tiny_app(config_types, seen), argv, env=no_environment())
    assert result.exit_code == 0, (argv, result.output, result.exception)
    assert seen == [given_configs], argv


def test_the_products_commands_take_the_options_to_argv_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in no_environment():
        monkeypatch.delenv(name)
    node = NodeConfig(peers=["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.4/tcp/6/p2p/QmB"], host="127.0.0.1", port=7,
                      metrics=Path("r0.jsonl"), remeasure_bandwidth=True, compile=False, memory_gb=2.5)  # fmt: skip
    run = (RunOptions(preset="tiny", seq_len=64), OuterConfig(inner_steps=4, round_s=2.5, overlap=True),
           OptimConfig(lr=3e-3), SparseLoCoConfig(topk=32), PipelineConfig(drift_transfer=False))  # fmt: skip
    cases = {
        "join": (node, RelayConfig(relay=False), SyncTimeouts(round_timeout_s=20), *run),
        "bootstrap": (BootstrapConfig(host="127.0.0.1", port=0, identity=Path("b.id"), metrics_port=0), *run),
        "train": (TrainConfig(preset="tiny", data=Path("corpus.txt"), compile=False), OptimConfig(warmup_steps=5)),
        "demo": (DemoConfig(full=3, virtual=0, overlap=True, report=Path("demo.json")),),
    }
    for command, given_configs in cases.items():
        parsed, params, given = parse_argv([command, *to_argv(*given_configs)])
        assert parsed == command
        for config in given_configs:
            names = [f.name for f in dataclasses.fields(config)]
            assert type(config)(**{n: params[n] for n in names}) == config, command
        assert given == {name for config in given_configs for name in changed(config)}, command


def changed(config: Any) -> set[str]:
    """The fields of `config` away from their defaults."""
    default = type(config)()
    return {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)}


def test_only_fields_away_from_their_defaults_are_written_unless_named_explicit() -> None:
    assert to_argv(OuterConfig(), RunOptions()) == []
    assert to_argv(OuterConfig(inner_steps=4, overlap=True), RunOptions(preset="tiny")) == [
        "--inner-steps", "4", "--overlap", "--preset", "tiny",
    ]  # fmt: skip
    assert to_argv(OuterConfig(inner_steps=4), explicit={"inner_steps", "stages"}) == [
        "--inner-steps", "4", "--stages", "2",
    ]  # fmt: skip
    assert to_argv(RelayConfig(relay=False), PipelineConfig(project_start=False)) == [
        "--no-relay",
        "--no-project-start",
    ]
    assert to_argv(NodeConfig(peers=["/a", "/b"], checkpoint_dir=Path("r0.ckpt"), metrics_port=0)) == [
        "--peers", "/a", "--peers", "/b", "--checkpoint-dir", "r0.ckpt", "--metrics-port", "0",
    ]  # fmt: skip
    assert to_argv(NodeConfig(), explicit={"metrics_port"}) == [], "None is the default, and no option says it"
    assert to_argv(OuterConfig(round_s=20.0, target_utilisation=0.5)) == [
        "--round-s",
        "20",
        "--target-utilisation",
        "0.5",
    ]


def test_what_no_option_can_say_is_refused() -> None:
    with pytest.raises(ValueError, match="--identity: None"):
        to_argv(dataclasses.replace(BootstrapConfig(), identity=None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config dataclass instances"):
        to_argv(OuterConfig)
    with pytest.raises(TypeError, match="config dataclass instances"):
        to_argv(["--inner-steps", "4"])


def test_the_lab_worker_config_round_trips_too() -> None:
    seen: list[tuple[Any, ...]] = []
    worker = DDPWorkerConfig(rank=1, world_size=2, master="10.0.0.1:29500", metrics=Path("m.jsonl"), eval_batches=2)
    result = CliRunner().invoke(tiny_app((*RUN[:3], DDPWorkerConfig), seen), to_argv(worker), env=no_environment())
    assert result.exit_code == 0, result.output
    assert seen == [(RunOptions(), OuterConfig(), OptimConfig(), worker)]
