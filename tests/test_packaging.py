"""Packaging stays consistent: the Dockerfile, the README, pyproject, the Makefile and CI describe one install."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import typer

from hetero_node.client.cli.app import app
from hetero_node.models.paths import CACHE_ENV_VAR

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("client", "protocol", "bootstrap", "models", "bench")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every Dockerfile instruction, line continuations joined, comments dropped."""
    lines = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text()).splitlines()
    pairs = [line.strip().partition(" ") for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return [(instruction.upper(), args.strip()) for instruction, _, args in pairs]


def docker_runs() -> list[str]:
    """Every shell command of every RUN (`a && b` counts as two)."""
    return [cmd.strip() for i, args in dockerfile() if i == "RUN" for cmd in args.split("&&")]


def readme_docker_section() -> str:
    """The README's Docker section, shell line continuations joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "README.md").read_text())
    match = re.search(r"^## [^\n]*Docker[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, "README.md needs a '## ... (Docker)' section for datacenter participants"
    return match.group(1)


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_docker_install_command_is_the_readme_one() -> None:
    installs = [cmd for cmd in docker_runs() if "pip install" in cmd]
    assert installs == ["pip install ."]  # torch comes from the CUDA base image
    assert installs[0] in (line.strip() for line in readme_docker_section().splitlines())


def test_docker_entrypoint_is_the_console_script_the_readme_runs() -> None:
    assert console_scripts() == {
        "hetero-node": "hetero_node.client.cli.app:main",
        "hetero-node-lab": "hetero_node.bench.cli:main",  # the lab's: not the image's entry point
    }
    entrypoints = [json.loads(args) for i, args in dockerfile() if i == "ENTRYPOINT"]
    assert entrypoints == [["hetero-node"]]

    section = readme_docker_section()
    tag = re.search(r"docker build -t (\S+) \.", section).group(1)
    run = shlex.split(next(line for line in section.splitlines() if line.strip().startswith("docker run")))
    command = run[run.index(tag) + 1]  # what follows the image is handed to the entrypoint
    assert command in typer.main.get_command(app).commands

    exposed = {args for i, args in dockerfile() if i == "EXPOSE"}
    assert exposed == {"31337 9100"} and "-p 31337:31337" in section  # p2p, and metrics with /healthz


def test_docker_bakes_the_corpus_where_the_cache_variable_points() -> None:
    env = dict(item.split("=", 1) for i, args in dockerfile() if i == "ENV" for item in shlex.split(args))
    assert f"hetero-node data fetch --cache-dir {env[CACHE_ENV_VAR]}" in docker_runs()
    volumes = [args for i, args in dockerfile() if i == "VOLUME"]
    assert any(env[CACHE_ENV_VAR].startswith(v.rstrip("/") + "/") for v in volumes)
    assert any("load_proto_module('wire')" in cmd for cmd in docker_runs())
    assert any(i == "USER" and args not in ("root", "0") for i, args in dockerfile())


def test_ci_runs_lint_and_tests() -> None:
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK)
    lines = [line.strip() for line in script.read_text().splitlines()]
    assert "set -euo pipefail" in lines and "run make lint" in lines and "run make test" in lines


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_makefile_installs_pinned_torch_before_the_project() -> None:
    recipe = subprocess.run(
        ["make", "-n", "-B", "venv"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    torch_line = next(i for i, line in enumerate(recipe) if "pip install torch==2.13.0" in line)
    project_line = next(i for i, line in enumerate(recipe) if 'pip install -e ".[dev]"' in line)
    assert torch_line < project_line


def test_wheel_ships_proto_sources_and_console_script(tmp_path: Path) -> None:
    """A non-editable install (the Docker image's) compiles `.proto` files at import, so it must contain them."""
    src = tmp_path / "src"  # a copy, so the build's scratch directories never land in the working tree
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "_generated"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=src,
        capture_output=True,
        check=True,
    )
    (wheel,) = tmp_path.glob("hetero_node-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    protos = sorted(p.name for p in (ROOT / "protocol").glob("*.proto"))
    assert protos and all(f"hetero_node/protocol/{p}" in names for p in protos)
    inits = [init for folder in PACKAGE_DIRS for init in (ROOT / folder).rglob("__init__.py")]
    packages = [init.parent.relative_to(ROOT) for init in inits]
    missing = [str(p) for p in packages if f"hetero_node/{p}/__init__.py" not in names and "_generated" not in p.parts]
    assert not missing, f"packages the wheel leaves out (pyproject.toml's list): {missing}"  # client/local once was
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hetero-node = hetero_node.client.cli.app:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
