"""Start a bootstrap and peers as separate `hetero-node` processes on 127.0.0.1, and always stop them all.

Used by `hetero-node demo`, the lab and the multi-peer tests, so all exercise exactly what a user runs. Each
process gets its own session (process group): stopping a peer kills the group, taking hivemind's DHT child and
p2pd with it (ARCHITECTURE.md, hivemind pitfall E: killing only the main process orphans
them). The lab's `LabSwarm` (bench/lab_swarm.py) places the same peers in network namespaces on shaped links by
overriding `host` and `placed`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.bootstrap.join_line import JOIN_LINE
from hetero_node.client.cli.options import env_name, to_argv
from hetero_node.protocol.errors import HeteroNodeError


def fresh_dir(path: Path) -> Path:
    """`path`, emptied: a bench's peers keep identities and checkpoints there, and a peer that found the last run's
    checkpoint would resume from it instead of starting with the others."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


LOOPBACK = "127.0.0.1"


class PeerStillRunning(TimeoutError):
    """A peer of a local swarm did not exit in the time given."""


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


class LocalSwarm:
    """A set of local peer processes with logs under `workdir`; use as a context manager."""

    def __init__(self, workdir: Path, threads_per_peer: int = 1) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.bootstrap_maddr: str | None = None
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads_per_peer),  # peers share the CPU; oversubscription slows all of them
            "PYTHONUNBUFFERED": "1",
            # loopback: nodes listen (and advertise) there only, not on the machine's interfaces
            env_name("host"): LOOPBACK,
        }

    def __enter__(self) -> LocalSwarm:
        """While the swarm runs, SIGTERM to this process ends it through `__exit__` (stopping every peer) instead
        of leaving the peers running; SIGINT too when it arrives ignored (background jobs inherit it so)."""
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        if self._previous[signal.SIGTERM] == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_signal)
        if self._previous[signal.SIGINT] == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    def host(self, name: str) -> str:
        """The address peer `name` listens on."""
        return LOOPBACK

    def placed(self, name: str, argv: list[str]) -> list[str]:
        """The command that runs `argv` where peer `name` lives: here, this machine itself."""
        return argv

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def start(
        self,
        name: str,
        args: list[str],
        program: list[str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Run `hetero-node ARGS` (or `PROGRAM ARGS`) as peer `name`, output to `<workdir>/<name>.log`;
        `preexec_fn` runs in the child first (e.g. to enter a CPU cgroup); `env` adds variables for this peer only
        (a deployment's HETERO_NODE_* configuration)."""
        argv = self.placed(name, [*(program or [sys.executable, "-m", "hetero_node.client.cli"]), *args])
        log = open(self.log_path(name), "w")  # noqa: SIM115 - the child owns it; closed when the child is reaped
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **(env or {})},
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        log.close()
        self.processes[name] = process
        return process

    def start_bootstrap(self, run_args: list[str], timeout: float = 90.0) -> str:
        """Start a bootstrap announcing the run `run_args` define, on a free loopback port; returns its multiaddr
        once it printed the join line."""
        where = BootstrapConfig(host=self.host("bootstrap"), port=0, identity=self.workdir / "bootstrap.id")
        self.start("bootstrap", ["bootstrap", *to_argv(where, explicit={"host"}), *run_args])
        self.bootstrap_maddr = self.join_line("bootstrap", timeout)
        return self.bootstrap_maddr

    def join_line(self, name: str, timeout: float = 90.0) -> str:
        """The multiaddr bootstrap `name` prints in its join line, once it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = JOIN_LINE.search(self.log_path(name).read_text())
            if match:
                return match.group(1)
            if self.processes[name].poll() is not None:
                break
            time.sleep(0.2)
        raise HeteroNodeError(f"{name} did not start; see {self.log_path(name)}")

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal a peer's whole process group, wait, and SIGKILL the group if it does not exit in time."""
        process = self.processes[name]
        if process.poll() is None:
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except ProcessLookupError:
                pass
        self._kill_group_leftovers(process.pid)
        return process.returncode

    @staticmethod
    def _kill_group_leftovers(pgid: int) -> None:
        """Children that outlive their parent (p2pd) stay in the group: make sure none survives."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def wait(self, name: str, timeout: float) -> int:
        """`name`'s exit code; one still running after `timeout` s fails with the end of every peer's log (what
        a CI report shows of a swarm that hung: which peer waited for which)."""
        try:
            return self.processes[name].wait(timeout)
        except subprocess.TimeoutExpired:
            tails = "\n".join(f"--- {peer}.log, last lines:\n{self.log_tail(peer)}" for peer in self.processes)
            raise PeerStillRunning(f"{name} still runs after {timeout:g} s\n{tails}") from None

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name, timeout=10.0)
