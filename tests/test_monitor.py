"""What operators watch: a node's Prometheus metrics over HTTP, the dashboard's history and swarm gauges, and a
live local swarm scraped by a real Prometheus server and rendered in a real headless browser."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, rendered_dom, screenshot
from factories import peer_id, peer_record
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from swarm_helpers import join_args, probe, rounds_of, run_args

from hetero_node.bench.commands import CLI
from hetero_node.bench.kill_soak import wait_until
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import to_argv
from hetero_node.client.cli.plan import PlanConfig
from hetero_node.client.monitor.health import DAEMON_GONE, Health
from hetero_node.client.monitor.http_server import MonitorServer, open_dashboard
from hetero_node.client.monitor.node_metrics import NodeMetrics
from hetero_node.client.monitor.snapshot import swarm_snapshot
from hetero_node.client.monitor.swarm_watch import SwarmWatcher, round_rows
from hetero_node.client.roles.metrics import RoundRecord, round_summary
from hetero_node.protocol.errors import ConfigError

FIGURES = Path(__file__).resolve().parent.parent / "bench" / "figures"
PROMETHEUS = shutil.which("prometheus")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) → value, parsed by prometheus_client's own parser (so the format is valid)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def record(round_: int, **changes: Any) -> RoundRecord:
    fields: dict[str, Any] = {
        "round": round_, "inner_steps": 10, "tokens": 640, "train_loss": 4.5, "eval_loss": 4.25, "bytes_sent": 1000,
        "bytes_received": 3000, "compute_s": 2.0, "comm_s": 0.5, "fingerprints": {}, "group_size": 3,
        "contributors": 3, "contributed": True,
    }  # fmt: skip
    return RoundRecord(**{**fields, **changes})


# -------------------------------------------------------------------------------------- a node's metrics


def test_node_metrics_are_served_in_prometheus_format_with_conventional_names() -> None:
    metrics = NodeMetrics("ab" * 8, "0.1.0")
    metrics.watch_peers(lambda: 5)
    metrics.set_role("full")
    metrics.observe_round(record(0, boundary_bytes_sent=70, dropped=["peerX"]))
    metrics.observe_round(record(1, eval_loss=None, contributed=False, resynced=True, tokens=320, train_loss=4.0))
    server = MonitorServer("127.0.0.1", 0, metrics.registry)
    try:
        text = get(server.url + "metrics")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(server.url)  # a training node serves metrics only, no dashboard
    finally:
        server.close()
    values = samples(text)

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted(labels.items())))]

    assert value("hetero_node_round") == 1
    assert value("hetero_node_tokens_total") == 960 and value("hetero_node_inner_steps_total") == 20
    assert value("hetero_node_train_loss") == 4.0 and value("hetero_node_eval_loss") == 4.25  # last evaluated
    assert value("hetero_node_tokens_per_second") == pytest.approx(320 / 2.5)
    assert value("hetero_node_sent_bytes_total", traffic="outer") == 2000
    assert value("hetero_node_sent_bytes_total", traffic="boundary") == 70
    assert value("hetero_node_received_bytes_total", traffic="outer") == 6000
    assert value("hetero_node_compute_seconds_total") == 4.0 and value("hetero_node_communication_seconds_total") == 1.0
    assert value("hetero_node_contributed_rounds_total") == 1 and value("hetero_node_resyncs_total") == 1
    assert value("hetero_node_deferred_rounds_total") == 0
    metrics.observe_round(record(2, contributed=False, deferred=True))  # left out by the selection: owed, no resync
    assert samples(generate_latest(metrics.registry).decode())[("hetero_node_deferred_rounds_total", ())] == 1
    assert value("hetero_node_dropped_contributions_total") == 1
    assert value("hetero_node_group_size") == 3 and value("hetero_node_peers_seen") == 5
    assert value("hetero_node_node_info", role="full", run_id="ab" * 8, version="0.1.0") == 1
    assert value("hetero_node_process_resident_memory_bytes") > 10e6
    counters = [
        family for family in text_string_to_metric_families(text) if family.type == "counter"
    ]  # every counter is exposed as <name>_total, and every name carries the project's prefix
    assert counters and all(s.name.endswith(("_total", "_created")) for f in counters for s in f.samples)
    assert all(name.startswith("hetero_node_") for name, _ in values)


def test_a_fresh_node_reports_unknown_losses_as_nan_and_a_busy_port_is_a_clear_error() -> None:
    metrics = NodeMetrics("ab" * 8, "0.1.0")
    server = MonitorServer("127.0.0.1", 0, metrics.registry)
    try:
        values = samples(get(server.url + "metrics"))
        assert math.isnan(values[("hetero_node_eval_loss", ())]) and values[("hetero_node_tokens_total", ())] == 0
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(ConfigError, match=f"could not serve metrics on 127.0.0.1:{port}"):
            MonitorServer("127.0.0.1", port, metrics.registry)
    finally:
        server.close()


def test_idle_connections_are_dropped_and_capped_and_the_server_keeps_answering() -> None:
    """Idle clients held one thread each, for ever (the review's 300 connections): now each is dropped after the
    request timeout, and past the cap a new connection is closed unanswered while the server stays up."""
    import socket
    import time

    from hetero_node.client.config import NodeConfig

    assert NodeConfig().metrics_host == "127.0.0.1"  # loopback unless the operator exposes it
    metrics = NodeMetrics("ab" * 8, "0.1.0")
    server = MonitorServer("127.0.0.1", 0, metrics.registry, request_timeout_s=1.0, max_connections=2)
    host, port = server.httpd.server_address[:2]
    try:
        idle = [socket.create_connection((host, port)) for _ in range(2)]
        time.sleep(0.3)  # both are being served (and say nothing)
        extra = socket.create_connection((host, port))
        extra.settimeout(5)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b"", "a connection past the cap was answered"
        for sock in idle:  # dropped by the server after the timeout: the peer sees the end of the stream
            sock.settimeout(5)
            assert sock.recv(100) == b""
        assert "hetero_node_tokens_total" in get(server.url + "metrics")  # slots freed: served again
    finally:
        for sock in [*idle, extra]:
            sock.close()
        server.close()


def test_healthz_follows_the_daemon_and_readyz_waits_for_a_role_and_a_round() -> None:
    metrics = NodeMetrics("ab" * 8, "0.1.0")
    daemon = {"alive": True}
    server = MonitorServer("127.0.0.1", 0, metrics.registry, health=Health(lambda: daemon["alive"], metrics.readiness))
    try:
        assert probe(server.url + "healthz") == (200, "alive\n")
        assert probe(server.url + "readyz") == (503, "joining: measuring this node and choosing a role\n")
        metrics.set_role("full")
        assert probe(server.url + "readyz") == (503, "full: no round finished yet\n")
        metrics.observe_round(record(4))
        assert probe(server.url + "readyz?verbose") == (200, "full: round 4 finished\n")
        daemon["alive"] = False  # p2pd died: not alive, and not ready however many rounds it finished
        assert probe(server.url + "healthz") == (503, DAEMON_GONE + "\n")
        assert probe(server.url + "readyz") == (503, DAEMON_GONE + "\n")
    finally:
        server.close()
    plain = MonitorServer("127.0.0.1", 0, metrics.registry)  # a server told nothing of health has no such routes
    try:
        assert probe(plain.url + "healthz")[0] == 404
    finally:
        plain.close()


# -------------------------------------------------------------------------------- the dashboard's data


def snapshot_of(*records: Any) -> dict[str, Any]:
    return swarm_snapshot({r.peer_id: (r, 100.0 + 3 * r.refresh_s) for r in records}, 104.0, "ab" * 8, None)


def test_round_rows_average_eval_losses_and_add_bytes() -> None:
    seen = {
        4: {"a": {"eval_loss": 3.0, "bytes_sent": 10, "bytes_received": 30, "contributed": True},
            "b": {"eval_loss": None, "bytes_sent": 5, "bytes_received": 7, "contributed": False, "deferred": True}},
        3: {"a": {"eval_loss": 4.0, "bytes_sent": 1, "bytes_received": 2, "contributed": True},
            "c": {"eval_loss": 5.0, "bytes_sent": 2, "bytes_received": 3, "contributed": True}},
        5: {"b": {"eval_loss": None, "bytes_sent": 0, "bytes_received": 0, "contributed": False}},
    }  # fmt: skip
    rows = round_rows(seen)
    assert [r["round"] for r in rows] == [3, 4, 5]
    assert [r["eval_loss"] for r in rows] == [4.5, 3.0, None]
    assert [(r["bytes_sent"], r["bytes_received"]) for r in rows] == [(3, 5), (15, 37), (0, 0)]
    assert rows[1]["contributed"] == {"a": True, "b": False} and rows[1]["deferred"] == ["b"]
    assert rows[0]["deferred"] == []


def test_the_watcher_keeps_rounds_as_polls_see_them_and_exports_swarm_gauges() -> None:
    summary = round_summary(record(7, eval_loss=3.5, bytes_sent=100, boundary_bytes_sent=20))
    full = peer_record("full1", role="full", round=8, tokens_per_s=50.0, last_round=summary)
    stage = peer_record("stage1", role="stage", vr=0, stage=1, claimed_at=1.0, tokens_per_s=20.0)
    polls: list[dict[str, Any] | None] = [snapshot_of(full, stage), None]
    watcher = SwarmWatcher(lambda: polls.pop(0))
    watcher.poll()
    watcher.poll()  # the DHT did not answer: the last snapshot and the history stay
    state = watcher.state()
    assert [p["peer_id"] for p in state["snapshot"]["peers"]] == sorted([peer_id("full1"), peer_id("stage1")])
    assert state["rounds"] == [
        {"round": 7, "eval_loss": 3.5, "bytes_sent": 120, "bytes_received": 3000,
         "contributed": {peer_id("full1"): True}, "deferred": []},
    ]  # fmt: skip
    assert state["snapshot"]["virtual_replicas"] == {"0": {"stages": {"1": peer_id("stage1")}, "missing": [0]}}
    gauges = {(s.name, tuple(s.labels.values())): s.value for family in watcher.collect() for s in family.samples}
    assert gauges[("hetero_node_swarm_peers", ("full",))] == 1 and gauges[("hetero_node_swarm_peers", ("stage",))] == 1
    assert gauges[("hetero_node_swarm_round", ())] == 8
    assert gauges[("hetero_node_swarm_tokens_per_second", ())] == 70
    assert gauges[("hetero_node_swarm_virtual_replicas", ("false",))] == 1


def test_the_watcher_forgets_the_oldest_rounds_beyond_its_bound() -> None:
    polls = [snapshot_of(peer_record("full1", role="full", last_round=round_summary(record(r)))) for r in range(6)]
    watcher = SwarmWatcher(lambda: polls.pop(0), max_rounds=4)
    for _ in range(6):
        watcher.poll()
    assert [row["round"] for row in watcher.state()["rounds"]] == [2, 3, 4, 5]


def test_the_dashboard_page_and_its_json_are_served() -> None:
    snapshot = snapshot_of(peer_record("full1", role="full", gpus=[{"name": "<b>evil</b>", "memory_gb": 8.0}]))
    with open_dashboard("127.0.0.1", 0, lambda: snapshot) as server:
        page = get(server.url)
        state = read_until(lambda: _json(server.url + "api/swarm"), lambda s: s["snapshot"] is not None, 10)
        metrics = samples(get(server.url + "metrics"))
    assert 'id="peers"' in page and 'id="loss-plot"' in page and ".innerHTML" not in page
    assert state["snapshot"]["peers"][0]["gpus"][0]["name"] == "<b>evil</b>"  # served as data, rendered as text
    assert metrics[("hetero_node_swarm_peers", (("role", "full"),))] == 1
    assert metrics[("hetero_node_process_resident_memory_bytes", ())] > 0


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
def test_a_peers_text_is_shown_as_text_not_markup() -> None:
    evil = peer_record("full1", role="full", gpus=[{"name": "<b id=injected>x</b>", "memory_gb": 8.0}])
    with open_dashboard("127.0.0.1", 0, lambda: snapshot_of(evil)) as server:
        read_until(lambda: _json(server.url + "api/swarm"), lambda s: s["snapshot"] is not None, 10)
        dom = rendered_dom(server.url)
    assert "&lt;b id=injected&gt;x&lt;/b&gt;" in dom and 'id="injected"' not in dom


def _json(url: str) -> dict[str, Any]:
    return json.loads(get(url))


def read_until(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float, what: str = "it") -> Any:
    """What `read()` returns once `done` holds for it, polled by the benches' `wait_until`."""
    return wait_until(lambda: value if done(value := read()) else None, timeout, what)


# ------------------------------------------------------------------------------------- a live swarm

URL_LINE = re.compile(r"(?:dashboard: |Prometheus metrics at )(http://[\d.]+:\d+/)")
PEERS = ("r0", "r1")


class LiveSwarm:
    """A bootstrap serving the dashboard and two full replicas serving /metrics, training `tiny`."""

    def __init__(self, swarm: LocalSwarm, workdir: Path) -> None:
        self.swarm, self.workdir = swarm, workdir
        self.peers = peers = swarm.start_bootstrap(run_args(rounds=200, inner_steps=4, metrics_port=0))
        for i, name in enumerate(PEERS):
            swarm.start(name, join_args(peers, i, workdir, min_peers=2, metrics_port=0))
        self.urls = {name: self.url_of(name) for name in ("bootstrap", *PEERS)}

    def url_of(self, name: str) -> str:
        found = read_until(
            lambda: URL_LINE.search(self.swarm.log_path(name).read_text()), bool, 120, f"{name}'s metrics URL"
        )
        return found.group(1)

    def alive(self) -> None:
        for name, process in self.swarm.processes.items():
            assert process.poll() is None, f"{name} exited:\n{self.swarm.log_path(name).read_text()[-3000:]}"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSwarm]:
    workdir = tmp_path_factory.mktemp("monitored")
    with LocalSwarm(workdir) as swarm:
        live = LiveSwarm(swarm, workdir)
        for i in range(len(PEERS)):
            read_until(lambda i=i: rounds_of(workdir, i), lambda r: len(r) >= 3, 240, f"r{i}'s third round")
        yield live


@pytest.mark.multipeer
@pytest.mark.timeout(400)
def test_live_nodes_export_their_rounds_and_the_bootstrap_the_swarm(live: LiveSwarm) -> None:
    live.alive()
    run_id = read_until(lambda: _json(live.urls["bootstrap"] + "api/swarm")["snapshot"], bool, 30, "a snapshot")[
        "run_id"
    ]
    for i, name in enumerate(PEERS):
        recorded = rounds_of(live.workdir, i)  # read first: the metrics are updated right after each line
        values = samples(get(live.urls[name] + "metrics"))
        assert values[("hetero_node_round", ())] >= max(recorded)
        assert values[("hetero_node_tokens_total", ())] >= sum(r["tokens"] for r in recorded.values()) > 0
        assert values[("hetero_node_sent_bytes_total", (("traffic", "outer"),))] > 0
        assert values[("hetero_node_contributed_rounds_total", ())] >= 1
        assert values[("hetero_node_peers_seen", ())] >= 2
        info = [dict(labels) for name, labels in values if name == "hetero_node_node_info"]
        assert [(i["role"], i["run_id"]) for i in info] == [("full", run_id)]
        assert probe(live.urls[name] + "healthz") == (200, "alive\n")  # its real p2pd, found by process
        status, why = probe(live.urls[name] + "readyz")
        assert status == 200 and re.fullmatch(r"full: round \d+ finished\n", why), (status, why)
    assert probe(live.urls["bootstrap"] + "healthz") == (200, "alive\n")
    assert probe(live.urls["bootstrap"] + "readyz") == (200, f"bootstrap: announcing run {run_id}\n")
    state = read_until(
        lambda: _json(live.urls["bootstrap"] + "api/swarm"),
        lambda s: (
            s["snapshot"] and len(s["snapshot"]["peers"]) == 2 and any(len(r["contributed"]) == 2 for r in s["rounds"])
        ),
        60,
        "the dashboard seeing both replicas contribute to a round",
    )
    both = [r for r in state["rounds"] if len(r["contributed"]) == 2]
    assert all(r["contributed"] == dict.fromkeys(r["contributed"], True) for r in both)
    assert any(r["eval_loss"] is not None for r in state["rounds"])
    swarm_values = samples(get(live.urls["bootstrap"] + "metrics"))
    assert swarm_values[("hetero_node_swarm_peers", (("role", "full"),))] == 2
    assert swarm_values[("hetero_node_swarm_round", ())] >= 1


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_plan_reads_the_live_swarm_and_predicts_its_round(live: LiveSwarm, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    plan = PlanConfig(peers=[live.peers], h_choices="4", json_out=out)
    done = subprocess.run([*CLI, "plan", *to_argv(plan)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert "now" in done.stdout and "optimised" in done.stdout
    plan = json.loads(out.read_text())
    now = plan["live"]  # the second column: the swarm's own assignment, as its records say
    assert now["full_replicas"] == 2 and now["virtual_replicas"] == 0 and now["inner_steps"] == 4
    assert now["round_s"] > 0 and now["tokens_per_s"] > 0  # speeds and links from the records
    assert plan["best"]["tokens_per_s"] >= 0.98 * now["tokens_per_s"]
    assert len(plan["full"]) + sum(len(vr) for vr in plan["virtual"]) + len(plan["idle"]) == 2  # both records


@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus)")
def test_a_real_prometheus_server_scrapes_the_swarm(live: LiveSwarm, tmp_path: Path) -> None:
    targets = ", ".join(f"'{url.removeprefix('http://').rstrip('/')}'" for url in live.urls.values())
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: hetero-node\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed in the finally
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         "--web.listen-address=127.0.0.1:0"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        address = read_until(
            lambda: re.search(r'Listening on.*address=(127\.0\.0\.1:\d+)', (tmp_path / "prometheus.log").read_text()),
            bool, 60, "prometheus to listen",
        )  # fmt: skip
        api = f"http://{address.group(1)}/api/v1/query?query="

        def query(expression: str) -> list[dict[str, Any]]:
            answer = _json(api + urllib.request.quote(expression))
            assert answer["status"] == "success", answer
            return answer["data"]["result"]

        up = read_until(lambda: query("sum(up)"), lambda r: r and float(r[0]["value"][1]) == 3, 60, "3 targets up")
        assert float(up[0]["value"][1]) == 3
        tokens = read_until(
            lambda: query("sum(hetero_node_tokens_total)"), lambda r: r and float(r[0]["value"][1]) > 0, 60, "tokens"
        )
        peers = query('hetero_node_swarm_peers{role="full"}')
        assert float(tokens[0]["value"][1]) > 0 and [float(p["value"][1]) for p in peers] == [2.0]
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    live.alive()


@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
def test_the_dashboard_renders_peers_and_plots_in_a_headless_browser(live: LiveSwarm, tmp_path: Path) -> None:
    url = live.urls["bootstrap"]
    read_until(
        lambda: _json(url + "api/swarm")["rounds"], lambda rows: sum(r["eval_loss"] is not None for r in rows) >= 2,
        90, "two evaluated rounds on the dashboard",
    )  # fmt: skip
    dom = rendered_dom(url)
    rows = re.findall(r'<tr class="peer" data-peer-id="(\w+)"', dom)
    assert len(rows) == 2, dom[:3000]
    loss_plot = re.search(r'<svg id="loss-plot".*?</svg>', dom, re.S)
    assert loss_plot and '<path class="series" d="M' in loss_plot.group(0), dom[:3000]
    assert len(re.findall(r'<circle class="point"', loss_plot.group(0))) >= 2
    assert re.search(r'<svg id="bytes-plot".*?<rect class="bar"', dom, re.S)
    assert dom.count('<td class="yes">✓</td>') >= 2  # both replicas contributed to some round
    out = FIGURES if os.environ.get("HETERO_NODE_SAVE_FIGURES") else tmp_path
    screenshot(url, out / "dashboard.png")
