"""LocalSwarm, the demo's and the benchmarks' process manager: SIGTERM to its owner stops every peer it started, and a
peer that does not exit in time fails with the end of every peer's log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero_node.client.cli.local_swarm import LocalSwarm, PeerStillRunning

OWNER = """
import sys, time
from pathlib import Path
from hetero_node.client.cli.local_swarm import LocalSwarm
with LocalSwarm(Path(sys.argv[1])) as swarm:
    peer = swarm.start("sleeper", ["-c", "import time; time.sleep(600)"], program=[sys.executable])
    print(peer.pid, flush=True)
    time.sleep(600)
"""


def test_sigterm_to_the_owner_stops_the_peers_it_started(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    peer = int(owner.stdout.readline())
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(peer, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError("the peer outlived the swarm's owner")


def test_a_peer_still_running_at_the_deadline_fails_with_every_peers_last_log_lines(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        swarm.start("done", ["-c", "print('finished round 3')"], program=[sys.executable])
        swarm.start("stuck", ["-c", "import time; print('waiting for 2 peers', flush=True); time.sleep(60)"],
                    program=[sys.executable])  # fmt: skip
        assert swarm.wait("done", 30) == 0
        deadline = time.monotonic() + 30
        while "waiting" not in swarm.log_path("stuck").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(PeerStillRunning) as failed:
            swarm.wait("stuck", 0.5)
    message = str(failed.value)
    assert message.startswith("stuck still runs after 0.5 s")
    assert "--- done.log" in message and "finished round 3" in message
    assert "--- stuck.log" in message and "waiting for 2 peers" in message
