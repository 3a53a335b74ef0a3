"""Slow machines on demand: a CPU cgroup (v1 `cpu` controller) capping a process tree at a fraction of a core.

The lab and the multi-peer tests mix fast and slow nodes on one machine this way: every process started with
`CpuQuota.enter` as its pre-exec hook (p2pd and hivemind's children included, they inherit it) shares `quota`
cores' worth of CPU time per scheduling period. Needs root and the v1 controller mounted at /sys/fs/cgroup/cpu;
`unavailable_reason()` says why not otherwise. Leaving the context removes the cgroup once its processes are gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable_reason() -> str | None:
    """Why CPU quotas cannot be used here, or None when they can."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    if not os.access(CPU_ROOT, os.W_OK):
        return f"{CPU_ROOT} is not writable (needs root)"
    return None


class CpuQuota:
    """A cgroup named `name` that limits its processes to `quota` cores (0.3: 30% of one core)."""

    def __init__(self, name: str, quota: float) -> None:
        cores = os.cpu_count() or 1
        if not 0 < quota <= cores:
            raise ValueError(f"a CPU quota must be in (0, {cores}] cores, got {quota}")
        self.path = CPU_ROOT / f"hetero-node-{os.getpid()}-{name}"
        self.quota = quota

    def __enter__(self) -> CpuQuota:
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(self.quota * PERIOD_US)))
        return self

    def enter(self) -> None:
        """Move the calling process into the cgroup (a `preexec_fn`: runs in the child before it executes)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # busy: a cgroup with live processes cannot be removed
                pass
            with contextlib.suppress(OSError):
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            time.sleep(0.2)
