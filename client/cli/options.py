"""Build Typer options from config dataclasses, so every knob is defined (with its help and default) once.

A command declares parameters annotated with config dataclasses; `expand_dataclass_options` replaces each of
them with one `--option` per field (help text from the field's ``metadata["help"]``) and rebuilds the
dataclass instances before calling the command. Configs stay the single source of truth; the CLI follows, and
so do the command lines the demo, the lab and the tests start processes with: `to_argv` turns configs back into
the options that rebuild them.

Every such option can also be set by an environment variable, `HETERO_NODE_<FIELD>` (`--round-timeout-s` is
`HETERO_NODE_ROUND_TIMEOUT_S`; a list takes whitespace-separated values; a flag takes 1/0 or true/false): what
Docker, compose files and systemd units configure a node with. A command-line value wins over the variable.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection
from typing import Any

import typer

ENV_PREFIX = "HETERO_NODE_"


def _option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """The environment variable that sets the option of `field_name`."""
    return ENV_PREFIX + field_name.upper()


def help_panel(config_type: type) -> str:
    """The heading `--help` lists a config's options under: its `help_panel`, else its name less the suffix
    ("SparseLoCoConfig" → "SparseLoCo options")."""
    name = config_type.__name__.removesuffix("Config").removesuffix("Options")
    return getattr(config_type, "help_panel", f"{name} options")


def _field_parameters(config_type: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(config_type)
    parameters = []
    for field in dataclasses.fields(config_type):
        if not field.init:
            continue
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise TypeError(f"{config_type.__name__}.{field.name} needs a default to become a CLI option")
        default = _default(field)
        names = [_option_name(field.name)]
        if hints[field.name] is bool:  # a flag that defaults to on needs its --no- form to be switched off
            names = [f"{names[0]}/--no-{names[0][2:]}"]
        option = typer.Option(
            default,
            *names,
            help=field.metadata.get("help", ""),
            envvar=env_name(field.name),
            show_envvar=False,
            rich_help_panel=help_panel(config_type),
        )
        parameters.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=hints[field.name])
        )
    return parameters


def expand_dataclass_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn each dataclass-typed parameter of `command` into per-field CLI options (see module docstring)."""
    hints = typing.get_type_hints(command)
    signature = inspect.signature(command)
    config_params: dict[str, type] = {}
    new_parameters: list[inspect.Parameter] = []
    seen: set[str] = set()
    for name, parameter in signature.parameters.items():
        annotation = hints.get(name)
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            config_params[name] = annotation
            expanded = _field_parameters(annotation)
        else:
            expanded = [parameter.replace(annotation=annotation, kind=inspect.Parameter.KEYWORD_ONLY)]
        for item in expanded:
            if item.name in seen:
                raise TypeError(f"option name {item.name!r} is defined twice in {command.__name__}")
            seen.add(item.name)
        new_parameters.extend(expanded)

    field_names = {
        name: [f.name for f in dataclasses.fields(config_type) if f.init] for name, config_type in config_params.items()
    }

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        call_args = {}
        for name, config_type in config_params.items():
            call_args[name] = config_type(**{f: kwargs.pop(f) for f in field_names[name]})
        return command(**call_args, **kwargs)

    del wrapper.__wrapped__  # Typer must read the expanded signature below, not the original one
    wrapper.__signature__ = signature.replace(parameters=new_parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in new_parameters}
    return wrapper


def explicit_options(context: typer.Context) -> set[str]:
    """Field names the user set on the command line (or via environment) for the running command, as opposed to
    defaults: a joiner's explicit run options must agree with the swarm's, its defaults simply yield to it."""
    given = {"COMMANDLINE", "ENVIRONMENT"}
    sources = {name: context.get_parameter_source(name) for name in context.params}
    return {name for name, source in sources.items() if source is not None and source.name in given}


def to_argv(*configs: Any, explicit: Collection[str] = ()) -> list[str]:
    """The options that make a command built by `expand_dataclass_options` rebuild `configs` (dataclass
    instances): the inverse of the above, for whoever starts a `hetero-node` process (the demo, the lab, tests).

    Only fields that differ from their default are given, so a command line stays short and a joiner passes no run
    option it did not mean (its explicit run options must agree with the swarm's); fields named in `explicit` are
    given even at their default, where being explicit matters (it wins over an environment variable and a
    `--config` file). A path becomes its string, a flag `--x` or `--no-x`, a list one `--x VALUE` per item, a
    whole float loses its `.0`; a value an option cannot say (None, or an empty list, over a default that is
    neither) is a ValueError."""
    argv: list[str] = []
    for config in configs:
        if not (dataclasses.is_dataclass(config) and not isinstance(config, type)):
            raise TypeError(f"to_argv takes config dataclass instances, got {config!r}")
        for field in dataclasses.fields(config):
            if not field.init:
                continue
            value = getattr(config, field.name)
            if value == _default(field) and field.name not in explicit:
                continue
            name = _option_name(field.name)
            if isinstance(value, bool):
                argv.append(name if value else f"--no-{name[2:]}")
            elif isinstance(value, list | tuple):
                if not value:
                    raise ValueError(f"{name}: an empty list cannot be given over the default {_default(field)}")
                argv += [token for item in value for token in (name, str(item))]
            elif value is None:
                if field.name in explicit and _default(field) is None:
                    continue  # None is the default, and no option says it
                raise ValueError(f"{name}: None cannot be given over the default {_default(field)!r}")
            else:
                argv += [name, _text(value)]
    return argv


def _text(value: Any) -> str:
    """An option's value as typed: 20.0 as "20" (the option parses it back to 20.0), any other float exactly."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
