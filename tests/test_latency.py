"""Latency in the netlab without `netem`: each node's delaying proxy holds its connections' bytes for the summed
one-way latency of both ends, keeps them intact and in order, passes a half-close on, and leaves addresses alone.
Needs root, network namespaces and iptables (`sudo make test`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm_helpers import join_args, run_args

from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import NetLab, nat_unavailable_reason

UNAVAILABLE = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"lab latency unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(180),
]
CLI = [sys.executable, "-m", "hetero_node.client.cli"]

SERVER = """
import hashlib, socket, sys
server = socket.create_server((sys.argv[1], 5000))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if conn.recv(1) == b"e":  # echo single bytes
        while ping := conn.recv(1):
            conn.sendall(ping)
    else:  # read to the end of the stream, then say what arrived and from whom
        digest = hashlib.sha256()
        while chunk := conn.recv(1 << 16):
            digest.update(chunk)
        conn.sendall(f"{digest.hexdigest()} {peer[0]}".encode())
    conn.close()
"""

CLIENT = """
import hashlib, json, os, socket, sys, time
address, pings = sys.argv[1], int(sys.argv[2])
conn = socket.create_connection((address, 5000))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.sendall(b"e")
rtt_ms = []
for _ in range(pings):
    start = time.perf_counter()
    conn.sendall(b"x")
    assert conn.recv(1) == b"x"
    rtt_ms.append((time.perf_counter() - start) * 1000)
conn.close()
data = os.urandom(2_000_000)
conn = socket.create_connection((address, 5000))
conn.sendall(b"d" + data)
conn.shutdown(socket.SHUT_WR)  # the server answers only once it has seen the end of the stream
reply = b""
while chunk := conn.recv(4096):
    reply += chunk
digest, peer = reply.decode().split()
print(json.dumps({"rtt_ms": rtt_ms, "intact": digest == hashlib.sha256(data).hexdigest(), "peer": peer}))
"""


def exchange(lab: NetLab, client: str, server: str, pings: int = 5) -> dict:
    node = lab.nodes[server]
    process = lab.popen(node, [sys.executable, "-c", SERVER, node.address], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "listening"
    out = lab.run(lab.nodes[client], [sys.executable, "-c", CLIENT, node.address, str(pings)],
                  capture_output=True, text=True, timeout=60)  # fmt: skip
    process.kill()
    process.stdout.close()
    return json.loads(out.stdout)


def test_a_round_trip_takes_twice_the_summed_latency_of_both_ends_and_bytes_arrive_intact() -> None:
    with NetLab() as lab:
        lab.add_node("home", 100, latency_ms=20)
        lab.add_node("far", 100, latency_ms=30)
        lab.add_node("near", 100)
        lab.start_delays()
        far, near = exchange(lab, "home", "far"), exchange(lab, "home", "near")
        back = exchange(lab, "far", "near")  # dialed from the other side: its own proxy delays it
        home = lab.nodes["home"].address
    assert min(far["rtt_ms"]) >= 99, far  # 2 × (20 + 30) ms
    assert statistics.median(far["rtt_ms"]) < 180, far
    assert min(near["rtt_ms"]) >= 39 and statistics.median(near["rtt_ms"]) < 120, near  # 2 × (20 + 0)
    assert min(back["rtt_ms"]) >= 59 and statistics.median(back["rtt_ms"]) < 140, back  # 2 × (30 + 0)
    assert far["intact"] and near["intact"] and back["intact"]
    assert far["peer"] == near["peer"] == home, "the far end must see the dialer's own address"


@pytest.mark.multipeer
def test_a_joined_node_records_its_round_trip_to_the_bootstrap(tmp_path: Path) -> None:
    """What the planner prices pipelines with (`cost_model.Latency`): a node 35 ms from the core times pings to a
    bootstrap 5 ms from it, 2 × (35 + 5) ms, and publishes the figure in its record; a node beside the core, 10 ms."""
    with LabSwarm(tmp_path, 1000) as swarm:
        assert swarm.lab is not None
        for name, latency in (("bootstrap", 5), ("r0", 35), ("r1", 0)):
            swarm.lab.add_node(name, 1000, latency_ms=latency)
        swarm.lab.start_delays()
        peers = swarm.start_bootstrap(run_args(200, inner_steps=4, round_s=2))
        for index in (0, 1):
            swarm.start(f"r{index}", join_args(peers, index, tmp_path, min_peers=1))
        deadline, measured = time.monotonic() + 90, {}
        while len(measured) < 2:
            assert time.monotonic() < deadline, swarm.log_path("r0").read_text()[-3000:]
            time.sleep(2)
            status = swarm.lab.run(swarm.lab.nodes["bootstrap"], [*CLI, "status", "--peers", peers, "--json"],
                                   capture_output=True, text=True, timeout=60)  # fmt: skip
            records = json.loads(status.stdout)["peers"]
            measured = {name: r["rtt_ms"] for name in ("r0", "r1") for r in records
                        if any(a.startswith(f"/ip4/{swarm.host(name)}/") for a in r["addrs"])}  # fmt: skip
    print(f"round trips recorded: {measured}")  # shown with pytest -s
    assert 79 <= measured["r0"] < 160, measured
    assert 9 <= measured["r1"] < 60, measured


def test_without_latency_no_proxy_is_started() -> None:
    with NetLab() as lab:
        lab.add_node("a", 100)
        lab.add_node("b", 100)
        lab.start_delays()
        result = exchange(lab, "a", "b", pings=20)
        rules = lab.run(lab.nodes["a"], ["iptables", "-t", "nat", "-S", "OUTPUT"], capture_output=True, text=True)
    assert "REDIRECT" not in rules.stdout
    assert result["intact"] and statistics.median(result["rtt_ms"]) < 20, result


def test_a_negative_latency_is_refused() -> None:
    with NetLab() as lab, pytest.raises(ValueError, match="latency"):
        lab.add_node("a", 100, latency_ms=-5)
