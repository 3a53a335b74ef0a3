"""Bandwidth measurement over a real shaped link: a node in a network namespace whose veth is limited by
`tc tbf` to 50 Mbit/s each way measures itself against a bootstrap on a 1 Gbit/s link, through hivemind P2P."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero_node.bench.netns import NetLab, netns_unavailable_reason
from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.client.cli.options import to_argv
from hetero_node.client.config import NodeConfig, RunOptions

UNAVAILABLE = netns_unavailable_reason()
pytestmark = [
    pytest.mark.multipeer,
    pytest.mark.timeout(300),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs network namespaces and tc as root: {UNAVAILABLE}"),
]
CLI = [sys.executable, "-m", "hetero_node.client.cli"]
RUN = to_argv(RunOptions(preset="tiny", batch_size=4, seq_len=64))


# long: a measurement on a shaped link (the probe's arithmetic has unit tests here)
@pytest.mark.long
def test_measured_bandwidth_of_a_50_mbit_link_lands_near_50(tmp_path: Path) -> None:
    with NetLab() as lab:
        hub = lab.add_node("boot", up_mbit=1000)
        edge = lab.add_node("edge", up_mbit=50)
        boot_log = (tmp_path / "bootstrap.log").open("w")
        where = BootstrapConfig(host=hub.address, port=31337, identity=tmp_path / "b.id")
        bootstrap = [*CLI, "bootstrap", *to_argv(where, explicit={"port"})]
        lab.popen(hub, [*bootstrap, *RUN], stdout=boot_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while not (found := re.search(r"--peers\s+(\S+)", (tmp_path / "bootstrap.log").read_text())):
            assert time.monotonic() < deadline, (tmp_path / "bootstrap.log").read_text()
            time.sleep(0.3)
        peers = found.group(1)
        node_log = (tmp_path / "edge.log").open("w")
        node = NodeConfig(peers=[peers], memory_gb=0.03, remeasure_bandwidth=True, record_refresh_s=2)
        lab.popen(edge, [*CLI, "--log-level", "INFO", "join", "--role", "stage", *to_argv(node), "--quiet"],
                  stdout=node_log, stderr=subprocess.STDOUT)  # fmt: skip
        record = None
        while record is None:
            assert time.monotonic() < deadline + 120, (tmp_path / "edge.log").read_text()[-3000:]
            time.sleep(2)
            status = lab.run(hub, [*CLI, "status", "--peers", peers, "--json"], capture_output=True, text=True)
            peers_seen = json.loads(status.stdout)["peers"]
            record = next((p for p in peers_seen if p["bandwidth_source"] == "measured"), None)
    up, down = record["upload_mbps"], record["download_mbps"]
    print(f"50 Mbit/s tbf link: measured {up} Mbit/s up, {down} Mbit/s down")  # shown with pytest -s
    assert 35 <= up <= 65, f"measured upload {up} Mbit/s on a 50 Mbit/s link"
    assert 35 <= down <= 65, f"measured download {down} Mbit/s on a 50 Mbit/s link"


def test_a_node_on_a_slow_uplink_joins_the_dht_as_a_client_by_its_flag_or_its_last_measurement(
    tmp_path: Path,
) -> None:
    import socket

    from hetero_node.client.node.bandwidth import cached_upload_mbps, joins_as_dht_client

    peers = ["/ip4/203.0.113.7/tcp/31337/p2p/QmBootstrap", "/ip4/203.0.113.8/tcp/31337/p2p/QmOther"]
    cache = tmp_path / "bandwidth.json"
    assert cached_upload_mbps(cache, peers) is None  # never measured: no figure, so a server
    assert not joins_as_dht_client(None, 20.0, cache, peers)
    host, now = socket.gethostname(), time.time()
    cache.write_text(json.dumps({
        f"{host}|10.0.0.2|QmBootstrap": {"upload_mbps": 40.0, "download_mbps": 90.0, "at": now - 3600},
        f"{host}|10.0.0.9|QmBootstrap": {"upload_mbps": 5.0, "download_mbps": 9.0, "at": now - 60},  # the latest
        f"{host}|10.0.0.2|QmSomeoneElse": {"upload_mbps": 1.0, "at": now},  # not one of our peers
        "another-host|10.0.0.2|QmOther": {"upload_mbps": 2.0, "at": now},  # not this host
        f"{host}|10.0.0.2|QmOther": {"upload_mbps": "fast", "at": now},  # garbage: skipped, no crash
    }))  # fmt: skip
    assert cached_upload_mbps(cache, peers) == 5.0
    assert joins_as_dht_client(None, 20.0, cache, peers)
    assert not joins_as_dht_client(100.0, 20.0, cache, peers)  # --bandwidth-mbps wins over the cache
    assert joins_as_dht_client(5.0, 20.0, tmp_path / "none.json", peers)
    assert not joins_as_dht_client(5.0, 0.0, cache, peers)  # 0: always a server
    cache.write_text("[1, 2")  # a corrupt cache is no figure
    assert cached_upload_mbps(cache, peers) is None
