"""Debian's chromium, headless, for the dashboard test: the page's DOM after its scripts ran, and a screenshot."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No sandbox (tests run as root), and nothing that reaches for Google's hosts: the machines have no internet.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
    "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
]  # fmt: skip


def _chromium(url: str, *args: str, budget_ms: int) -> str:
    """Run chromium on `url` with `args`, letting the page's timers run for `budget_ms` of virtual time."""
    assert CHROMIUM is not None, "no chromium on this machine"
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *args, url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def rendered_dom(url: str, budget_ms: int = 5000) -> str:
    return _chromium(url, "--dump-dom", budget_ms=budget_ms)


def screenshot(url: str, path: Path, size: tuple[int, int] = (1280, 1100), budget_ms: int = 5000) -> Path:
    _chromium(url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}", budget_ms=budget_ms)
    assert path.exists() and path.stat().st_size > 10_000, f"no screenshot written to {path}"
    return path
