"""Swarm membership with real processes on 127.0.0.1: the bootstrap's signed run announcement, signed and
schema-checked peer records, automatic roles, and interoperability with stock hivemind DHT nodes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import peer_record, record_fields

from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, RunOptions
from hetero_node.client.monitor.snapshot import read_snapshot
from hetero_node.client.node.run_definition import fetch_run_announcement
from hetero_node.client.roles.metrics import read_metrics
from hetero_node.client.swarm.membership import peer_info, relay_of, relay_shares
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.keys import peers_key
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.run_config import OuterConfig

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(300)]

RUN_OPTIONS = RunOptions(preset="tiny", batch_size=4, seq_len=64)
OUTER = OuterConfig(inner_steps=4, stages=2, target_utilisation=0)  # rounds of H steps: see swarm_helpers.run_args
RUN = to_argv(RUN_OPTIONS, OUTER)
NODE = NodeConfig(record_refresh_s=2, settle_s=2)
VENV_BIN = Path(sys.executable).parent


def join(peers: str, run: list[str] | None = None, role: str | None = None, **node: Any) -> list[str]:
    """A `join` command line: NODE with `node`'s changes, and the run options `run` if any."""
    place = ["--role", role] if role else []
    return ["join", *place, *to_argv(dataclasses.replace(NODE, peers=[peers], **node)), *(run or []), "--quiet"]


@contextlib.contextmanager
def observer(peers: str, run_id: str | None = None) -> Iterator[PeerRuntime]:
    """A client-mode DHT peer in this process, reading the run's records like `hetero-node status`."""
    runtime = PeerRuntime([peers], client_mode=True)
    try:
        if run_id is None:
            announcement = fetch_run_announcement(runtime)
            assert announcement is not None, "the bootstrap announces no run"
            run_id = announcement.run_id
        runtime.join_run(run_id, serve=False)
        yield runtime
    finally:
        runtime.shutdown()


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def valid_record(runtime: PeerRuntime, **changes: Any) -> dict[str, Any]:
    return record_fields(str(runtime.peer_id), **changes)


def test_a_relayed_peer_plans_with_its_share_of_the_relays_link() -> None:
    relay = peer_record("relay1", role="full", upload_mbps=100.0, download_mbps=80.0)
    circuit = [f"/ip4/10.0.0.1/tcp/1/p2p/{relay.peer_id}/p2p-circuit"]
    home = [peer_record(f"home{i}", upload_mbps=60.0, download_mbps=500.0, addrs=circuit) for i in range(2)]
    via_bootstrap = ["/ip4/10.0.0.9/tcp/1/p2p/QmBootstrapWithoutARecord1111111/p2p-circuit"]
    behind_bootstrap = peer_record("home9", upload_mbps=30.0, download_mbps=30.0, addrs=via_bootstrap)
    direct = peer_record("direct1", upload_mbps=60.0, download_mbps=60.0, addrs=["/ip4/10.0.0.2/tcp/5"])
    records = {r.peer_id: r for r in (relay, *home, behind_bootstrap, direct)}
    shares = relay_shares(records)
    assert shares[home[0].peer_id] == shares[home[1].peer_id] == (40.0, 40.0)  # 80 Mbit/s of the relay, halved
    assert shares[behind_bootstrap.peer_id] == (30.0, 30.0)  # a relay with no record: its own figures
    assert relay_of(direct) is None and direct.peer_id not in shares
    infos = {info.peer_id: info for info in (peer_info(r, shares.get(pid)) for pid, r in records.items())}
    assert infos[home[0].peer_id].relayed and infos[home[0].peer_id].link_mbps == 40.0
    assert not infos[direct.peer_id].relayed


def test_bootstrap_announces_the_run_and_keeps_its_peer_id_across_restarts(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        first = swarm.start_bootstrap(RUN)
        with observer(first) as runtime:
            announcement = fetch_run_announcement(runtime)
            assert announcement is not None and announcement.config["preset"] == "tiny"
            assert announcement.peer_id == first.rsplit("/", 1)[1]
        swarm.stop("bootstrap")
        port = re.search(r"/tcp/(\d+)/", first).group(1)
        where = BootstrapConfig(host="127.0.0.1", port=int(port), identity=tmp_path / "bootstrap.id")
        swarm.start("bootstrap", ["bootstrap", *to_argv(where), *RUN])
        second = wait_for(lambda: re.search(r"--peers\s+(\S+)", swarm.log_path("bootstrap").read_text()), 60, "restart")
        assert second.group(1) == first  # same identity file and port: the same multiaddr
        with observer(first) as runtime:
            again = fetch_run_announcement(runtime)
            assert again is not None and again.run_id == announcement.run_id


def test_forged_schema_invalid_and_absurd_records_are_rejected(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(RUN)
        with observer(peers) as reader, contextlib.ExitStack() as stack:
            writer = PeerRuntime([peers])
            stack.callback(writer.shutdown)
            victim = PeerRuntime([peers])
            stack.callback(victim.shutdown)
            for runtime in (writer, victim):
                runtime.join_run(reader.run_id)
            key = peers_key(reader.run_id)
            victim.announce(PeerRecord(**valid_record(victim)), refresh_s=2.0)
            wait_for(lambda: str(victim.peer_id) in (reader.read_records() or {}), 30, "the honest record")

            def store(subkey: bytes, value: dict[str, Any], lifetime_s: float = 30.0) -> bool:
                from hivemind.utils import get_dht_time

                return writer.dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + lifetime_s)

            # another node's subkey: unsigned by its key, so every validating node refuses it
            assert not store(victim.signer.local_public_key, valid_record(victim, role="full", memory_gb=999.0))
            # our own key claiming the victim's peer id, outliving its record: the DHT stores it (the signature is
            # ours and valid), but no reader believes it, since the key that signed it is not the victim's
            assert store(writer.signer.local_public_key, valid_record(victim, role="full", memory_gb=999.0), 1e6)
            # our own subkey, but values the schema forbids
            bad_values = [
                {"upload_mbps": -5.0}, {"gpus": [{"name": "gpu", "memory_gb": 80.0}] * 100}, {"memory_gb": 1e9},
                {"cpu_cores": 4.0}, {"loss": float("nan")}, {"role": "king"}, {"extra": 1}, {"peer_id": "me"},
            ]  # fmt: skip
            for changes in bad_values:
                assert not store(writer.signer.local_public_key, valid_record(writer, **changes)), changes
            time.sleep(2)
            records = reader.read_records()
            assert records is not None and set(records) == {str(victim.peer_id)}
            assert records[str(victim.peer_id)].role == "joining" and records[str(victim.peer_id)].memory_gb == 4.0


@pytest.mark.long
def test_six_nodes_joining_at_once_settle_on_one_consistent_assignment(tmp_path: Path) -> None:
    """Two nodes can hold the model, four only a stage: 2 full replicas and 2 complete virtual replicas."""
    memory = [4, 4, 0.03, 0.03, 0.03, 0.03]
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(to_argv(RUN_OPTIONS, dataclasses.replace(OUTER, rounds=200)))
        for i, gb in enumerate(memory):
            swarm.start(f"n{i}", ["--log-level", "INFO", *join(peers, memory_gb=gb, bandwidth_mbps=1000)])
        with observer(peers) as runtime:

            def settled() -> dict[str, Any] | None:
                snapshot = read_snapshot(runtime.read_records_timed, runtime.run_id, None)
                if snapshot is None:
                    return None
                roles = [p["role"] for p in snapshot["peers"]]
                done = len(roles) == 6 and "joining" not in roles and snapshot["views_agree"]
                return snapshot if done else None

            snapshot = wait_for(settled, 180, "six settled records that all see the same plan")
        for name in swarm.processes:
            assert swarm.processes[name].poll() is None, f"{name} exited:\n{swarm.log_path(name).read_text()[-2000:]}"
    by_memory = {p["memory_gb"]: [] for p in snapshot["peers"]}
    for p in snapshot["peers"]:
        by_memory[p["memory_gb"]].append(p["role"])
    assert sorted(by_memory[4.0]) == ["full", "full"] and by_memory[0.03] == ["stage"] * 4
    slots = [(p["vr"], p["stage"]) for p in snapshot["peers"] if p["role"] == "stage"]
    assert len(set(slots)) == 4, f"a slot has two holders: {slots}"
    assert all(not info["missing"] for info in snapshot["virtual_replicas"].values())
    assert len(snapshot["virtual_replicas"]) == 2
    assert len({p["view"] for p in snapshot["peers"]}) == 1


# long: every `make test` swarm bootstraps through `hetero-node bootstrap` (and test_deploy.py through the image's);
# this checks that a stock `hivemind-dht` entry point works too
@pytest.mark.long
def test_stock_hivemind_dht_bootstraps_hetero_node_peers(tmp_path: Path) -> None:
    """A plain `hivemind-dht` announces no run: peers use their own run options (with a public swarm's default
    rule), find each other, and read each other's signed records through it."""
    with LocalSwarm(tmp_path) as swarm:
        log = (tmp_path / "stock.log").open("w")
        # it prints its address at INFO; in-process CLI tests may have left WARNING in this process's environment
        stock = subprocess.Popen(
            [str(VENV_BIN / "hivemind-dht"), "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
             "--identity_path", str(tmp_path / "stock.id")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "HIVEMIND_LOGLEVEL": "INFO"},
        )  # fmt: skip
        try:
            found = wait_for(
                lambda: re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", (tmp_path / "stock.log").read_text()),
                60,
                "hivemind-dht's address",
            )
            peers = found.group(1)
            for i in range(2):
                run = to_argv(RUN_OPTIONS, dataclasses.replace(OUTER, rounds=2))
                node = {"min_peers": 2, "bandwidth_mbps": 1000, "metrics": tmp_path / f"r{i}.jsonl"}
                swarm.start(f"r{i}", ["--log-level", "INFO", *join(peers, run, role="full", **node)])
            for i in range(2):
                code = swarm.wait(f"r{i}", 240)
                text = swarm.log_path(f"r{i}").read_text()
                assert code == 0, text[-3000:]
                assert "own run options (robust aggregation)" in text  # a public swarm's default, named by nobody
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(stock.pid, signal.SIGKILL)
            stock.wait()
    rounds = [read_metrics(tmp_path / f"r{i}.jsonl")[1] for i in range(2)]
    assert all(len(r) == 2 for r in rounds)
    assert rounds[0][-1]["fingerprints"] == rounds[1][-1]["fingerprints"]
    assert max(r[-1]["group_size"] for r in rounds) == 2  # they found each other through the stock node


def test_plain_hivemind_dht_client_joins_through_a_hetero_node_bootstrap(tmp_path: Path) -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(RUN)
        first = hivemind.DHT(initial_peers=[peers], start=True)
        second = hivemind.DHT(initial_peers=[peers], start=True)
        try:
            assert first.store("plain-key", "plain-value", get_dht_time() + 60)
            found = wait_for(lambda: second.get("plain-key", latest=True), 30, "the plain record")
            assert found.value == "plain-value"
        finally:
            first.shutdown()
            second.shutdown()


def test_a_joiner_whose_options_or_data_differ_from_the_run_gets_an_error_naming_the_difference(
    tmp_path: Path,
) -> None:
    other_text = tmp_path / "other.txt"
    other_text.write_text("Not the bundled corpus at all, just a few words repeated.\n" * 300)
    cases = [  # small is --preset's default: given explicitly, it must still agree with the swarm's
        (to_argv(RunOptions(preset="small"), explicit={"preset"}), "--preset small (the swarm's run uses tiny)"),
        (to_argv(OuterConfig(inner_steps=9)), "--inner-steps 9 (the swarm's run uses 4)"),
        (to_argv(RunOptions(data=other_text)), "your data does not match the swarm's run: data identity"),
    ]
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(RUN)
        for i, (options, _) in enumerate(cases):
            swarm.start(f"j{i}", join(peers, options))
        for i, (_, message) in enumerate(cases):
            assert swarm.wait(f"j{i}", 120) == 1
            log = swarm.log_path(f"j{i}").read_text()
            assert message in log and "Traceback" not in log, log[-2000:]


def test_a_vanished_stage_holder_expires_and_a_new_node_takes_its_slot(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peers = swarm.start_bootstrap(RUN)
        stage_node = join(peers, memory_gb=0.03, bandwidth_mbps=100)
        for name in ("s0", "s1"):
            swarm.start(name, stage_node)
        with observer(peers) as runtime:

            def slots_once(count: int) -> dict[str, tuple[int, int]] | None:
                records = runtime.read_records() or {}
                held = {pid: (r.vr, r.stage) for pid, r in records.items() if r.role == "stage"}
                return held if len(held) == count else None

            before = wait_for(lambda: slots_once(2), 120, "two stage peers")
            assert sorted(before.values()) == [(0, 0), (0, 1)]  # one complete virtual replica
            swarm.stop("s1", sig=signal.SIGKILL)  # no goodbye: its record must expire (3 × 2 s)
            survivors = wait_for(lambda: slots_once(1), 60, "the dead peer's record to expire")
            vacated = next(slot for pid, slot in before.items() if pid not in survivors)
            swarm.start("s2", stage_node)
            after = wait_for(lambda: slots_once(2), 120, "the replacement")
        newcomer = next(pid for pid in after if pid not in before)
        assert after[newcomer] == vacated  # it completed the virtual replica instead of opening a new one
