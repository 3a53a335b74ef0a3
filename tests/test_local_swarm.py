"""LocalSwarm, the demo's and the benchmarks' process manager: SIGTERM to its owner stops every peer it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
