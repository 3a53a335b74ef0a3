"""The house's rules that keep it readable: the lab stands on the product, never the other way round."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from hetero_node.bench.cli import lab
from hetero_node.client.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("client", "protocol", "bootstrap", "models")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at load or inside a function."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_no_product_module_imports_the_lab() -> None:
    arrows = [
        f"{path.relative_to(ROOT)} -> {module}"
        for folder in PRODUCT
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in imported_modules(path)
        if module == "hetero_node.bench" or module.startswith("hetero_node.bench.")
    ]
    assert arrows == []


def test_the_product_cli_loads_no_lab_module() -> None:
    probe = "import sys, hetero_node.client.cli.app; print(sorted(m for m in sys.modules if 'hetero_node.bench' in m))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert loaded.stdout.strip() == "[]"


def test_each_cli_lists_its_own_commands_under_panels() -> None:
    product = CliRunner().invoke(app, ["--help"]).output
    assert "Join a swarm:" in product and "Run a swarm:" in product
    assert product.index("Join a swarm:") < product.index("Run a swarm:")
    for lab_command in ("sim", "kills", "fuzz", "soak", "bench", "ddp-rank"):
        assert f"  {lab_command} " not in product
    lab_help = CliRunner().invoke(lab, ["--help"]).output
    assert "  kills " in lab_help and "  join " not in lab_help
    assert "ddp-rank" not in lab_help  # hidden: the bench starts it, nobody types it


def test_join_help_puts_the_peers_option_first_and_groups_options_by_config() -> None:
    text = CliRunner().invoke(app, ["join", "--help"], terminal_width=120).output
    sections = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert sections[:2] == ["Node options:", "Options:"]
    assert {"Run options:", "Outer options:", "Timeouts:"} <= set(sections)
    assert text.index("--peers") < text.index("--round-s")
