"""Leaving on a signal: Ctrl-C or SIGTERM (to the node or its whole process group) ends the node after its current
step, and what hivemind's threads say while the daemon goes down under them is not a traceback in the log."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

SHUTDOWN_ERRORS = (ConnectionError, FileNotFoundError, EOFError)
"""What hivemind's threads raise when a signal to the node's process group has taken p2pd down under them."""


def leave_on_signals(stop: threading.Event) -> None:
    """Ctrl-C / SIGTERM: leave after the current step, shutting the DHT and p2pd down (killing only the main process
    would orphan them). Forked DHT processes inherit the handler: there it only quiets the shutdown (they end with
    the main process)."""
    main = os.getpid()

    def request_stop(signum: int, _frame: Any) -> None:
        quiet_shutdown_errors()
        if os.getpid() == main:
            logger.warning("signal %d: leaving the swarm", signum)
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def quiet_shutdown_errors() -> None:
    """Once the node is leaving, hivemind's background threads (here and in the forked DHT process) fail on the
    daemon that the same signal ended: a traceback per thread in an operator's log for a normal stop. Such errors
    are logged at DEBUG from then on; any other exception still prints as before."""
    if getattr(threading.excepthook, "quiet_shutdown", False):
        return
    thread_hook, process_hook = threading.excepthook, sys.excepthook

    def on_thread_error(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, SHUTDOWN_ERRORS):
            logger.debug("%s ended while leaving: %r", args.thread.name if args.thread else "a thread", args.exc_value)
        else:
            thread_hook(args)

    def on_error(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        if issubclass(kind, SHUTDOWN_ERRORS):  # multiprocessing's resource sharer reports through sys.excepthook
            logger.debug("a background task ended while leaving: %r", value)
        else:
            process_hook(kind, value, trace)

    on_thread_error.quiet_shutdown = True  # type: ignore[attr-defined]
    threading.excepthook, sys.excepthook = on_thread_error, on_error
