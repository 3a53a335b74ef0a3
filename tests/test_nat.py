"""Volunteers behind NAT: a lab node behind a router doing source NAT dials out but cannot be dialed; such a node
detects it (the bootstrap's dial-back fails), joins through a circuit relay on the bootstrap, and takes part fully:
its SparseLoCo message is fetched by the public replica through the relay, and as a pipeline stage it exchanges
activations with its neighbour. Needs root, network namespaces and iptables (`sudo make test`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from swarm_helpers import join_args, rounds_of, run_args, wait_for_round

from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.nat_relay import render_markdown, summarise
from hetero_node.bench.netns import NetLab, nat_unavailable_reason
from hetero_node.bootstrap.config import RelayConfig
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.swarm.runtime import (
    MIN_PIECE_BYTES,
    RELAYED_PIECE_BYTES,
    STATE_REQUESTS_PER_MINUTE,
    PartialBlob,
    PeerRuntime,
    wire,
)
from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.reachability import lend_relay, reserve_on_trusted_relays_only

UNAVAILABLE = nat_unavailable_reason()
needs_nat_lab = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"NAT lab unavailable: {UNAVAILABLE}")

LINK_MBIT = 100.0
RELAY_CIRCUIT_BYTES = 128 << 10
"""What a relayed connection carries each way before hivemind's p2pd relay resets it (measured, whatever its flags)."""
LISTEN = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 5555)); s.listen(); time.sleep(30)"
CONNECT = (
    "import socket, sys; s = socket.socket(); s.settimeout(2)\n"
    "try:\n    s.connect((sys.argv[1], 5555)); print('connected')\nexcept OSError as e:\n    print('refused', e)"
)


@needs_nat_lab
def test_a_node_behind_nat_dials_out_and_cannot_be_dialed() -> None:
    with NetLab() as lab:
        public, home = lab.add_node("public", LINK_MBIT), lab.add_nat_node("home", LINK_MBIT)
        lab.popen(public, [sys.executable, "-c", LISTEN])
        lab.popen(home, [sys.executable, "-c", LISTEN])
        time.sleep(1.0)
        out = lab.run(home, [sys.executable, "-c", CONNECT, public.address], capture_output=True, text=True)
        assert out.stdout.startswith("connected"), out
        back = lab.run(public, [sys.executable, "-c", CONNECT, home.address], capture_output=True, text=True)
        assert back.stdout.startswith("refused"), back  # no route to the LAN
        router = lab.nodes["home-nat"].address
        mapped = lab.run(public, [sys.executable, "-c", CONNECT, router], capture_output=True, text=True)
        assert mapped.stdout.startswith("refused"), mapped  # the router has no inbound mapping


def node_args(swarm: LocalSwarm, peers: str, name: str, index: int, workdir: Path, **extra: Any) -> list[str]:
    return join_args(peers, index, workdir, host=swarm.host(name), **extra)


@needs_nat_lab
@pytest.mark.multipeer
@pytest.mark.timeout(400)
def test_a_replica_behind_nat_is_told_so_by_doctor_joins_relayed_and_contributes_every_round(tmp_path: Path) -> None:
    """The NAT'd replica also dials the public one directly (outbound works), so their messages can take that
    connection; the relay is what makes it reachable at all."""
    with LabSwarm(tmp_path, LINK_MBIT, behind_nat=frozenset({"r1"})) as swarm:
        peers = swarm.start_bootstrap(run_args(4, inner_steps=6))
        doctor = swarm.lab.run(
            swarm.lab.add_nat_node("r1", LINK_MBIT),
            [sys.executable, "-m", "hetero_node.client.cli", "doctor", "--peers", peers, "--host", swarm.host("r1")],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
        assert doctor.returncode == 1 and "cannot connect to port" in doctor.stdout, doctor.stdout + doctor.stderr
        assert "what to do: nothing to do: join detects this and trains through a relay" in doctor.stdout
        public, nat = train_two_replicas(swarm, peers, tmp_path, rounds=4)
    assert "reachable from outside at" in (tmp_path / "r0.log").read_text()
    assert sum(r["bytes_sent"] for r in nat.values()) >= sum(public[t]["bytes_received"] for t in range(3))


def train_two_replicas(
    swarm: LocalSwarm, peers: str, workdir: Path, rounds: int
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """r0 and r1 train `rounds` rounds; the NAT'd one joined relayed, both contributed every round and agree."""
    for i in range(2):
        swarm.start(f"r{i}", node_args(swarm, peers, f"r{i}", i, workdir, min_peers=2))
    for i in range(2):
        assert swarm.wait(f"r{i}", 300) == 0, swarm.log_path(f"r{i}").read_text()[-3000:]
    for name in swarm.behind_nat:
        log = (workdir / f"{name}.log").read_text()
        assert "joining through a relay" in log and "relayed through" in log, log[-3000:]
    first, second = rounds_of(workdir, 0), rounds_of(workdir, 1)
    assert set(first) == set(second) == set(range(rounds))
    for t in range(rounds):
        assert first[t]["fingerprints"] == second[t]["fingerprints"], f"round {t} disagrees"
        assert first[t]["contributed"] and second[t]["contributed"], f"round {t}: a replica did not contribute"
        assert first[t]["contributors"] == second[t]["contributors"] == 2, (first[t], second[t])
        assert first[t]["bytes_received"] > 0 and second[t]["bytes_received"] > 0, "a message was not fetched"
    return first, second


# long: `make test` keeps one relayed replica (the doctor test above)
@pytest.mark.long
@needs_nat_lab
@pytest.mark.multipeer
@pytest.mark.timeout(400)
def test_two_replicas_both_behind_nat_form_groups_through_the_relay_and_contribute_every_round(tmp_path: Path) -> None:
    """Neither can dial the other: every byte between them crosses the bootstrap's relay. It needs a reservation
    on the relay from the start (static relays), statements and seals through the DHT from a client DHT, and
    fetches that resume over a fresh circuit: p2pd's relay resets each circuit after 128 KiB each way, and one
    `small` message (two shards of 142 KB) is larger than that."""
    with LabSwarm(tmp_path, LINK_MBIT, behind_nat=frozenset({"r0", "r1"})) as swarm:
        peers = swarm.start_bootstrap(run_args(3, inner_steps=1000, preset="small", round_s=8))
        first, second = train_two_replicas(swarm, peers, tmp_path, rounds=3)
    for t in range(3):  # each got the other's whole message, past two circuit resets
        assert first[t]["bytes_received"] > 2 * RELAY_CIRCUIT_BYTES < second[t]["bytes_received"], (first[t], second[t])
        if not (first[t]["caught_up"] or second[t]["caught_up"]):  # a member that missed its group's end rebuilt
            assert first[t]["bytes_received"] == second[t]["bytes_received"], (first[t], second[t])  # from messages


# long: `make test` keeps one relayed replica (the doctor test above)
@pytest.mark.long
@needs_nat_lab
@pytest.mark.multipeer
@pytest.mark.timeout(480)
def test_a_virtual_replica_whose_last_stage_is_behind_nat_trains_and_contributes(tmp_path: Path) -> None:
    with LabSwarm(tmp_path, LINK_MBIT, behind_nat=frozenset({"s1"})) as swarm:
        peers = swarm.start_bootstrap(run_args(200, inner_steps=6, round_s=4))
        swarm.start("r0", node_args(swarm, peers, "r0", 0, tmp_path, min_peers=2))
        for index, stage in ((10, 0), (11, 1)):
            args = node_args(swarm, peers, f"s{stage}", index, tmp_path, role="stage", stage=stage, stage_timeout_s=15)
            swarm.start(f"s{stage}", args)
        deadline = time.monotonic() + 300
        while len(vr_rounds(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        wait_for_round(tmp_path, 0, 0, timeout=5)
    assert "joining through a relay" in (tmp_path / "s1.log").read_text()
    together = vr_rounds(tmp_path)
    assert len(together) >= 2, (
        f"the VR did not contribute twice: {[(t, r['contributors']) for t, r in rounds_of(tmp_path, 0).items()]}"
    )
    full, s0, s1 = (rounds_of(tmp_path, i) for i in (0, 10, 11))
    for t in together:
        # shard 1 and T_fixed as the full replica holds them (and E_S, unless stage 1 loaded a state that round)
        assert {"1", "fixed"} <= s1[t]["fingerprints"].keys() <= {"1", "fixed", "embed"}
        assert s1[t]["fingerprints"].items() <= full[t]["fingerprints"].items()
        assert s1[t]["boundary_bytes_received"] == s0[t]["boundary_bytes_sent"] > 0, "activations reached s1"
        assert s0[t]["boundary_bytes_received"] == s1[t]["boundary_bytes_sent"] > 0, "gradients came back"


def vr_rounds(workdir: Path) -> list[int]:
    """Rounds in which both stages contributed and the full replica aggregated the virtual replica's message."""
    full, s0, s1 = (rounds_of(workdir, i) for i in (0, 10, 11))
    return [t for t in s1 if t in s0 and t in full and s1[t]["contributed"] and s0[t]["contributed"]
            and full[t]["contributors"] == 2]  # fmt: skip


def test_relay_flags_reach_the_daemon() -> None:
    """--relay / --no-relay reach the command line of the p2pd hivemind starts, and it runs: --no-relay takes the
    relay transport away too (p2pd's default relay service would answer otherwise), while a node behind NAT keeps
    it to be reached; a relayed node's daemon reserves on its trusted relays only (no 3-minute wait for discovered
    candidates), while a daemon without trusted relays keeps discovery (p2pd refuses auto-relay with neither)."""
    from hivemind.p2p import P2P

    async def daemon_command_line(**options: Any) -> list[str]:
        p2p = await P2P.create(**options)
        try:
            return psutil.Process(p2p._child.pid).cmdline()
        finally:
            await p2p.shutdown()

    async def relayed_command_lines() -> tuple[list[str], list[str]]:
        relay = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            address = f"{(await relay.get_visible_maddrs())[0]}/p2p/{relay.peer_id}"
            relayed = await daemon_command_line(use_auto_relay=True, trusted_relays=[address])
            return relayed, await daemon_command_line(use_auto_relay=True)
        finally:
            await relay.shutdown()

    try:
        lend_relay(True)
        lent = asyncio.run(daemon_command_line())
        lend_relay(False)
        off = asyncio.run(daemon_command_line())
        lend_relay(False, dial_circuits=True)
        behind_nat = asyncio.run(daemon_command_line())
        reserve_on_trusted_relays_only()
        relayed, discovering = asyncio.run(relayed_command_lines())
    finally:
        lend_relay(RelayConfig().relay)
        reserve_on_trusted_relays_only(enabled=False)
    assert {"-relayService=1", "-relay=1"} <= set(lent), lent
    assert {"-relayService=0", "-relay=0"} <= set(off), off
    assert {"-relayService=0", "-relay=1"} <= set(behind_nat), behind_nat
    assert "-relayDiscovery=0" in relayed and not any(a.startswith("-relayDiscovery") for a in discovering)


@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_doctor_passes_on_a_reachable_node_and_explains_a_wrong_join_line(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(run_args(1))
        ok = subprocess.run(
            [sys.executable, "-m", "hetero_node.client.cli", "doctor", "--peers", peers, "--host", "127.0.0.1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for check in ("p2p daemon", "join line", "bootstrap reachable", "run announced", "reachable from outside"):
        assert f"ok      {check}: " in ok.stdout, (check, ok.stdout)
    wrong = subprocess.run(
        [sys.executable, "-m", "hetero_node.client.cli", "doctor", "--peers", "/ip4/127.0.0.1/tcp/1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert wrong.returncode == 1 and "FAILED" in wrong.stdout and "copy the whole line" in wrong.stdout


def test_the_relay_bench_summarises_rounds_and_links() -> None:
    def record(comm_s: float, contributed: bool = True, fp: str = "a") -> dict[str, object]:
        return {"contributed": contributed, "comm_s": comm_s, "bytes_received": 1000, "fingerprints": {"0": fp}}

    run = {
        "records": {"r0": {0: record(1.0), 1: record(3.0)}, "r1": {0: record(2.0, False), 1: record(2.0)}},
        "link_bytes": {"bootstrap": 900, "r0": 400, "r1": 600},
        "wall_s": 30.0,
    }
    summary = summarise(run, rounds=2)
    assert summary["rounds_contributed"] == {"r0": 2, "r1": 1} and summary["comm_s"] == {"r0": 2.0, "r1": 2.0}
    assert summary["round_wall_s"] == 15.0 and summary["link_bytes_per_round"] == {
        "bootstrap": 450,
        "r0": 200,
        "r1": 300,
    }
    assert summary["agree"]
    run["records"]["r1"][1] = record(2.0, fp="b")
    report = {
        "config": {"preset": "tiny", "rounds": 2, "round_s": 4, "link_mbit": 20},
        "scenarios": {"relayed": summarise(run, 2)},
    }
    assert "| relayed | 2, 1 | 2.0, 2.0 | 1,000, 1,000 | 15.0 | 450, 200, 300 | NO |" in render_markdown(report)


def test_a_blob_resumes_at_an_offset_in_small_pieces_and_a_blob_that_changes_meanwhile_is_refused() -> None:
    """How a fetch through a relay survives the circuit's resets: it asks for the rest of the blob, in pieces
    small enough for one circuit, and never stitches two different blobs together."""
    server = PeerRuntime([])
    try:
        server.join_run("0123456789abcdef")
        blob = bytes(range(256)) * 400  # 102,400 bytes
        server.publish("payload", 0, 1, blob)

        async def pieces(offset: int, piece_bytes: int, kind: str = "payload") -> list[bytes]:
            request = wire.BlobRequest(kind=kind, shard=0, round=1, offset=offset, piece_bytes=piece_bytes)
            return [piece.data async for piece in server._serve_blob(request, SimpleNamespace(remote_id="asker"))]

        async def scenario() -> None:
            rest = await pieces(40_000, RELAYED_PIECE_BYTES)
            assert [len(p) for p in rest] == [RELAYED_PIECE_BYTES, 62_400 - RELAYED_PIECE_BYTES]
            assert b"".join(rest) == blob[40_000:]
            assert [len(p) for p in await pieces(0, 0)] == [len(blob)]  # a direct peer: the default pieces
            assert [len(p) for p in await pieces(0, 1)][:2] == [MIN_PIECE_BYTES] * 2  # 1-byte pieces: refused as such
            with pytest.raises(ValueError, match="past the"):
                await pieces(len(blob) + 1, 0)
            server.publish("state", 0, 1, blob)  # whole states are budgeted per peer; a resumed one pays its share
            for _ in range(STATE_REQUESTS_PER_MINUTE - 1):
                await pieces(0, 0, kind="state")
            for _ in range(2):
                assert len(b"".join(await pieces(len(blob) // 2, RELAYED_PIECE_BYTES, kind="state"))) == len(blob) // 2
            with pytest.raises(PayloadError, match="states in the last minute"):
                await pieces(len(blob) - 1, 0, kind="state")

        server.run(scenario(), timeout=60)
    finally:
        server.shutdown()
    partial = PartialBlob("peer", "payload", max_size=1000)
    partial.add(wire.BlobChunk(data=b"ab", total_size=4, round=7))
    with pytest.raises(ValueError, match="changed while"):
        partial.add(wire.BlobChunk(data=b"cd", total_size=4, round=8))  # the peer moved on to another round
    partial.add(wire.BlobChunk(data=b"cd", total_size=4, round=7))
    assert partial.complete and partial.data == b"abcd" and partial.round == 7
    with pytest.raises(ValueError, match="more than the 1000 expected"):
        PartialBlob("peer", "state", max_size=1000).add(wire.BlobChunk(data=b"", total_size=1001, round=1))
