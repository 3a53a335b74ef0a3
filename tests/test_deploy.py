"""The unattended deployments (deploy/compose.yaml, deploy/hetero-node.service with deploy/hetero-node.env, the
Dockerfile's HEALTHCHECK), without docker or systemd: every HETERO_NODE_* variable they set is an option of the
command they run, and the command lines they describe run as real processes on loopback: the compose file's
bootstrap, a volunteer from the unit's ExecStart with its environment, the image's health check against both, and
SIGTERM to the main process (what `docker stop` and the unit's KillMode=mixed send) ends each with exit code 0.
The same live pair shows that a second bootstrap on a taken port and a second node with a live identity are refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from swarm_helpers import probe, run_args

from hetero_node.bench.commands import CLI
from hetero_node.bench.kill_soak import wait_until
from hetero_node.client.cli.app import app
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import ENV_PREFIX, to_argv
from hetero_node.client.config import NodeConfig
from hetero_node.models.paths import CACHE_ENV_VAR

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
LOOPBACK = "127.0.0.1"


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def unit() -> dict[str, list[tuple[str, str]]]:
    """The systemd unit's sections as (key, value) lists: keys such as Environment= repeat, which configparser
    refuses."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in (DEPLOY / "hetero-node.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def unit_values(key: str) -> list[str]:
    return [value for k, value in unit()["Service"] if k == key]


def env_file(path: Path) -> dict[str, str]:
    """A systemd EnvironmentFile's KEY=value lines."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and line[0] not in "#;")
    return {key.strip(): value.strip() for key, value in pairs}


def command_env_vars(name: str) -> set[str]:
    """The variables `hetero-node NAME` reads: its options' (`options.env_name`) and the cache directory's."""
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.envvar for p in command.params if isinstance(p.envvar, str)} | {CACHE_ENV_VAR}


def subcommand(argv: list[str]) -> str:
    """The subcommand of a `hetero-node [--log-level L] COMMAND ...` command line."""
    words = [w for i, w in enumerate(argv) if not w.startswith("-") and (i == 0 or argv[i - 1] != "--log-level")]
    return words[0]


def unit_exec_start() -> list[str]:
    (line,) = unit_values("ExecStart")
    argv = shlex.split(line)
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "hetero-node", argv  # no ExecStart prefixes
    return argv[1:]


def expand_specifiers(value: str, state: Path, cache: Path) -> str:
    """systemd's %S (state) and %C (cache) directories; any other specifier fails the test."""
    value = value.replace("%S", str(state)).replace("%C", str(cache))
    assert "%" not in value, value
    return value


def unit_environment(state: Path, cache: Path) -> dict[str, str]:
    pairs = (expand_specifiers(v, state, cache).split("=", 1) for v in unit_values("Environment"))
    return dict(pairs)


def test_deployments_set_only_options_of_the_commands_they_run() -> None:
    services = compose()["services"]
    for service in ("bootstrap", "volunteer"):
        command = subcommand(services[service]["command"])
        set_here = {k for k in services[service]["environment"] if k.startswith(ENV_PREFIX)}
        assert set_here and set_here <= command_env_vars(command), (service, set_here - command_env_vars(command))
    assert subcommand(unit_exec_start()) == "join"
    unit_set = set(unit_environment(Path("/var/lib"), Path("/var/cache"))) - {"HOME"}
    file_set = set(env_file(DEPLOY / "hetero-node.env"))
    assert unit_set and file_set and (unit_set | file_set) <= command_env_vars("join"), unit_set | file_set
    assert unit_values("EnvironmentFile") == ["/etc/hetero-node/env"]
    assert unit_values("Restart") == ["on-failure"] and unit_values("KillSignal") == ["SIGTERM"]
    assert unit_values("StateDirectory") == ["hetero-node"] and unit_values("TimeoutStopSec")
    assert all(s["restart"] == "unless-stopped" and "healthcheck" in s for s in services.values())
    assert set(compose()["volumes"]) >= {"bootstrap-state", "cache"}


def dockerfile_healthcheck() -> list[str]:
    """The image's HEALTHCHECK command (exec form), run by this test's Python instead of the image's."""
    (line,) = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("HEALTHCHECK")]
    argv = json.loads(line.split(" CMD ", 1)[1])
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@dataclass
class Deployed:
    swarm: LocalSwarm
    workdir: Path
    peers: str
    metrics: dict[str, int]
    """Metrics port of each process, by name."""
    identity: Path
    """The volunteer's key, in the unit's state directory."""


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, bundled_cache_dir: Path) -> Iterator[Deployed]:
    """The compose file's bootstrap and the unit's volunteer, configured as they say, but on loopback, with temporary
    state, free ports, the tests' corpus cache and the tests' short run."""
    workdir = tmp_path_factory.mktemp("deployed")
    state, cache = workdir / "state", workdir / "cache"
    metrics = {"bootstrap": free_port(), "volunteer": free_port()}
    loopback = {"HETERO_NODE_HOST": LOOPBACK, CACHE_ENV_VAR: str(bundled_cache_dir)}
    with LocalSwarm(workdir) as swarm:
        service = compose()["services"]["bootstrap"]
        env = {k: str(v) for k, v in service["environment"].items() if k != "HETERO_NODE_ANNOUNCE"}  # a docker name
        env |= loopback | {
            "HETERO_NODE_PORT": str(free_port()),
            "HETERO_NODE_IDENTITY": str(workdir / "bootstrap.id"),
            "HETERO_NODE_METRICS_PORT": str(metrics["bootstrap"]),
        }
        swarm.start("bootstrap", [*service["command"], *run_args(rounds=200, inner_steps=4)], env=env)
        peers = swarm.join_line("bootstrap")
        (state / "hetero-node").mkdir(parents=True)  # systemd makes StateDirectory= before it starts the service
        env = unit_environment(state, cache) | env_file(DEPLOY / "hetero-node.env")
        env |= loopback | {
            "HETERO_NODE_PEERS": peers,
            "HETERO_NODE_PORT": "0",
            "HETERO_NODE_METRICS_PORT": str(metrics["volunteer"]),
        }
        program = [str(Path(sys.executable).parent / "hetero-node")]
        swarm.start("volunteer", unit_exec_start(), program=program, env=env)
        identity = Path(env["HETERO_NODE_CHECKPOINT_DIR"]) / "identity"
        yield Deployed(swarm, workdir, peers, metrics, identity)


def url(deployed: Deployed, name: str, path: str) -> str:
    return f"http://{LOOPBACK}:{deployed.metrics[name]}/{path}"


def bootstrap_roles(deployed: Deployed) -> list[str]:
    swarm = json.loads(urllib.request.urlopen(url(deployed, "bootstrap", "api/swarm"), timeout=10).read())
    return [peer["role"] for peer in swarm["snapshot"]["peers"]]


def log(deployed: Deployed, name: str) -> str:
    return deployed.swarm.log_path(name).read_text()[-3000:]


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_the_volunteer_joins_trains_and_both_pass_the_images_health_check(deployed: Deployed) -> None:
    ready = wait_until(
        lambda: (answer := probe(url(deployed, "volunteer", "readyz")))[0] == 200 and answer,
        90, "the volunteer's /readyz",
    )  # fmt: skip
    assert re.fullmatch(r"full: round \d+ finished\n", ready[1]), ready
    assert deployed.identity.is_file()  # its key is in the unit's state directory, so a restart keeps its peer id
    # the bootstrap's view follows the volunteer's record, republished after its role is given: poll, not peek
    roles = wait_until(
        lambda: (seen := bootstrap_roles(deployed)) == ["full"] and seen, 60, "the bootstrap seeing a full replica",
    )  # fmt: skip
    assert roles == ["full"]
    for name, port in deployed.metrics.items():
        check = subprocess.run(
            dockerfile_healthcheck(), env={**os.environ, "HETERO_NODE_METRICS_PORT": str(port)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert check.returncode == 0, (name, check.stderr, log(deployed, name))


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_second_bootstrap_on_a_taken_port_is_refused(deployed: Deployed) -> None:
    port = re.search(r"/tcp/(\d+)/", deployed.peers).group(1)  # type: ignore[union-attr]
    identity = deployed.workdir / "second-bootstrap.id"
    second = subprocess.run(
        [*CLI, "bootstrap", *run_args(rounds=2, host=LOOPBACK, port=int(port), identity=identity)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert second.returncode == 1, second.stderr
    assert second.stderr.strip() == (
        f"error: port {port} on {LOOPBACK} is already in use by another process (another bootstrap?): "
        "stop it or give this one another --port"
    )
    assert not identity.exists()  # refused before anything was made
    assert probe(url(deployed, "bootstrap", "readyz"))[0] == 200  # the first one goes on


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_second_node_with_a_live_identity_is_refused(deployed: Deployed) -> None:
    wait_until(lambda: probe(url(deployed, "volunteer", "readyz"))[0] == 200, 90, "the volunteer's /readyz")
    key = deployed.identity.read_bytes()
    twin_dir = deployed.workdir / "twin"
    node = NodeConfig(peers=[deployed.peers], host=LOOPBACK, identity=deployed.identity, checkpoint_dir=twin_dir,
                      metrics=twin_dir / "twin.jsonl")  # fmt: skip
    twin = subprocess.run([*CLI, "join", *to_argv(node), "--quiet"], capture_output=True, text=True, timeout=100)
    assert twin.returncode == 1, twin.stderr
    error = [line for line in twin.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "is already live in the swarm" in error[0], twin.stderr
    assert deployed.identity.read_bytes() == key and not twin_dir.exists()
    assert probe(url(deployed, "volunteer", "readyz"))[0] == 200  # the live one goes on


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_sigterm_ends_the_bootstrap_and_the_volunteer_with_exit_code_0(deployed: Deployed) -> None:
    wait_until(lambda: probe(url(deployed, "volunteer", "readyz"))[0] == 200, 90, "the volunteer's /readyz")
    for name in ("volunteer", "bootstrap"):  # to the main process alone, as `docker stop` and KillMode=mixed do
        process = deployed.swarm.processes[name]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log(deployed, name)
