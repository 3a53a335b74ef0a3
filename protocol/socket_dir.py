"""Where hivemind's unix sockets live: one directory per node process, removed when the process ends.

hivemind puts its sockets in /tmp (`hivemind-p2pd-*.sock`, `hivemind-p2pclient-*.sock`) and removes only those of
P2P objects shut down in the process that made them. The DHT's child process replicates the
daemon and leave their client sockets behind (the trust review counted 7 files after a clean 3-replica demo, 152
after a test suite and a few runs).
Pointing hivemind at a directory of our own lets the node remove every one of them on exit; a node that was
SIGKILLed leaves a directory named after its pid, which the next node started on the machine removes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "hetero-node-sockets-"
_created: Path | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(base: Path) -> list[Path]:
    """Remove the socket directories of processes that are gone; returns what was removed."""
    removed = []
    for path in base.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def use_private_socket_dir() -> Path:
    """Point hivemind's sockets at this process's directory (made once; forked children inherit the setting)."""
    global _created
    from hivemind.p2p import P2P

    if _created is None or not _created.is_dir():
        base = Path(tempfile.gettempdir())
        remove_stale(base)
        _created = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        atexit.register(_remove, _created, os.getpid())
    P2P._UNIX_SOCKET_PREFIX = f"/unix{_created}/hivemind-"
    return _created


def _remove(path: Path, owner: int) -> None:
    """At exit of the process that made `path` (forked children inherit atexit hooks: they must not remove it)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
