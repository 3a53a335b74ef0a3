"""NetLab: tbf shaping is in force at the rate asked for, and a lab never outlives the process that opened it.

Needs root, iproute2 and a kernel that lets this process create network namespaces; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from hetero_node.bench.netns import NetLab, cleanup_stale, netns_unavailable_reason

UNAVAILABLE = netns_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(120),
]

PAYLOAD = 6_000_000
WARMUP = 1_000_000  # not timed: the tbf bucket starts full and TCP starts slow

RECEIVER = """
import json, socket, sys, time
address, warmup = sys.argv[1], int(sys.argv[2])
server = socket.create_server((address, 5000))
print("listening", flush=True)
conn, _ = server.accept()
received, start = 0, None
while chunk := conn.recv(1 << 16):
    received += len(chunk)
    if start is None and received >= warmup:
        start, at_start = time.perf_counter(), received
mbit = (received - at_start) * 8 / (time.perf_counter() - start) / 1e6
print(json.dumps({"received": received, "mbit": mbit}), flush=True)
"""

SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], 5000)) as conn:
    conn.sendall(bytes(int(sys.argv[2])))
"""

# Opens a lab without `with`, so only NetLab's signal handlers (and atexit) can tear it down.
LAB_OWNER = """
import signal, time
from hetero_node.bench.netns import NetLab
# like an interactive program: a shell that starts jobs in the background (CI runners do) leaves SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
lab = NetLab()
sleeper = lab.popen(lab.add_node("a", 10), ["sleep", "600"])
print(lab.tag, sleeper.pid, flush=True)
time.sleep(600)
"""


def namespaces_of(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{tag}-")]


def gone(pid: int) -> bool:
    """Exited; a zombie counts, since nothing may reap orphans in a container."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def lab_owner() -> Iterator[subprocess.Popen]:
    """A child process holding a lab with a `sleep` in it; killed and its lab removed if the test fails."""
    child = subprocess.Popen([sys.executable, "-c", LAB_OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        yield child
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        cleanup_stale()
        child.stdout.close()


def test_tcp_transfer_runs_at_the_shaped_rate_and_counters_see_it() -> None:
    with NetLab() as lab:
        sender, receiver = lab.add_node("sender", 50), lab.add_node("receiver", 50)
        server = lab.popen(receiver, [sys.executable, "-c", RECEIVER, receiver.address, str(WARMUP)],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert server.stdout.readline().strip() == "listening"
        sent_before, received_before = lab.counters(sender)[0], lab.counters(receiver)[1]
        lab.run(sender, [sys.executable, "-c", SENDER, receiver.address, str(PAYLOAD)], timeout=60)
        result = json.loads(server.stdout.readline())
        assert server.wait(timeout=10) == 0
        sent = lab.counters(sender)[0] - sent_before
        received = lab.counters(receiver)[1] - received_before
        server.stdout.close()
    assert result["received"] == PAYLOAD
    assert 35 <= result["mbit"] <= 65, f"measured {result['mbit']:.1f} Mbit/s through a 50 Mbit/s shaped link"
    assert PAYLOAD <= sent < 1.2 * PAYLOAD
    assert PAYLOAD <= received < 1.2 * PAYLOAD


class BodyFailed(Exception):
    pass


@pytest.mark.parametrize("body_raises", [False, True])
def test_leaving_the_lab_removes_its_namespaces_and_processes(body_raises: bool) -> None:
    with pytest.raises(BodyFailed) if body_raises else contextlib.nullcontext(), NetLab() as lab:
        a, b = lab.add_node("a", 10), lab.add_node("b", 10, down_mbit=20)
        sleeper = lab.popen(b, ["sleep", "600"])
        assert sorted(namespaces_of(lab.tag)) == sorted([lab.hub, a.namespace, b.namespace])
        assert "UP" in lab.run(a, ["ip", "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        if body_raises:
            raise BodyFailed
    assert namespaces_of(lab.tag) == []
    assert sleeper.returncode == -signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_tears_the_lab_down_and_still_ends_the_process(sig: signal.Signals) -> None:
    with lab_owner() as child:
        tag, sleeper_pid = child.stdout.readline().split()
        assert len(namespaces_of(tag)) == 2
        os.kill(child.pid, sig)
        assert child.wait(timeout=60) == -sig  # the previous handler still ran: KeyboardInterrupt / default exit
        assert namespaces_of(tag) == []
        assert gone(int(sleeper_pid))


def test_cleanup_stale_removes_a_killed_labs_leftovers_but_not_a_live_lab() -> None:
    with NetLab() as live, lab_owner() as child:
        tag, sleeper_pid = child.stdout.readline().split()
        os.kill(child.pid, signal.SIGKILL)  # no handler can run: the lab's namespaces and sleep stay behind
        child.wait()
        assert len(namespaces_of(tag)) == 2
        assert {f"{tag}-hub", f"{tag}-a"} <= set(cleanup_stale())
        assert namespaces_of(tag) == []
        assert gone(int(sleeper_pid))
        assert namespaces_of(live.tag) == [live.hub]
