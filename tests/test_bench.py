"""The benchmark harness: topology files, per-method command lines, the report, and short real lab runs.

The lab runs need root and network namespaces (skipped otherwise, with the reason) and the bundled corpus;
they check that shaping is in force, that interface counters are read next to what the program counted, and
that a run, failed or not, leaves no namespace behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from command_lines import parse_argv
from factories import run_config

from hetero_node.bench.commands import bootstrap_argv, ddp_argv, expected_replicas, join_argv
from hetero_node.bench.config import METHODS, BenchConfig
from hetero_node.bench.lab_run import MetricsTail, advanced, run_method
from hetero_node.bench.netns import LAB_PREFIX, netns_unavailable_reason
from hetero_node.bench.report import LOSS_VS_BYTES, LOSS_VS_WALL, write_report
from hetero_node.bench.suite import run_bench
from hetero_node.bench.topology import Topology, TopologyError, load_topology, parse_topology
from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.client.swarm.cost_model import LinkModel, RunShape, exchange_hops
from hetero_node.protocol.errors import ConfigError, HeteroNodeError

TWO_NODES = """
[[node]]
name = "a"
role = "full"
up_mbit = {a}

[[node]]
name = "b"
role = "full"
up_mbit = {b}
"""


# ------------------------------------------------------------------------------------------------- topologies


def test_bundled_topologies_load_with_their_edge_nodes() -> None:
    hetero = load_topology(Path("hetero"))
    assert [(n.name, n.up_mbit, n.down_mbit) for n in hetero.nodes] == [
        ("dc0", 1000, 1000), ("dc1", 1000, 1000), ("edge0", 50, 50), ("edge1", 50, 50),
    ]  # fmt: skip
    assert hetero.edge_nodes == ("edge0", "edge1")
    assert hetero.bootstrap_up_mbit == hetero.bootstrap_down_mbit == 1000
    for name, rate in (("edge-only", 50), ("uniform", 1000)):
        topology = load_topology(Path(name))
        assert {n.link_mbit for n in topology.nodes} == {rate} and len(topology.nodes) == 4
        assert topology.edge_nodes == ()
    mixed = load_topology(Path("mixed-speed"))
    assert {n.name: n.cpu_quota for n in mixed.nodes} == {
        "dc0": 0.5, "dc1": 0.5, "slow0": 0.17, "edge0": 0.3, "edge1": 0.3,
    }  # fmt: skip
    assert mixed.edge_nodes == ("edge0", "edge1") and [n.role for n in mixed.nodes][2] == "full"
    slow, base = load_topology(Path("slow-link")), load_topology(Path("slow-link-base"))
    assert slow.edge_nodes == ("home0",) and base.edge_nodes == ()  # only home0's link differs between the two
    assert [dataclasses.replace(n, up_mbit=0, down_mbit=0, latency_ms=0) for n in slow.nodes] == [
        dataclasses.replace(n, up_mbit=0, down_mbit=0, latency_ms=0) for n in base.nodes
    ]
    home = {n.name: n for n in slow.nodes}["home0"]
    assert (home.up_mbit, home.down_mbit, home.latency_ms + 5) == (5, 5, 75)  # 150 ms round trip to the others


def test_a_topology_file_gives_roles_asymmetric_links_and_cpu_pinning(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(TWO_NODES.format(a=100, b=10) + "down_mbit = 5\ncpus = [0]\nlatency_ms = 40\n"
                    "[bootstrap]\nup_mbit = 200\nlatency_ms = 2.5\n")  # fmt: skip
    topology = load_topology(path)
    assert topology.name == "lab"
    a, b = topology.nodes
    assert (b.up_mbit, b.down_mbit, b.link_mbit, b.cpus, b.latency_ms) == (10, 5, 5, (0,), 40)
    assert a.latency_ms == 0
    assert (topology.bootstrap_up_mbit, topology.bootstrap_down_mbit, topology.bootstrap_latency_ms) == (200, 200, 2.5)
    assert topology.edge_nodes == ("b",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[node]\n", "not valid TOML"),
        ("colour = 1\n" + TWO_NODES.format(a=1, b=1), "unknown keys in the top level: colour"),
        (TWO_NODES.format(a=1, b=1) + "down_mibt = 3\n", "unknown keys in node 'b'"),
        (TWO_NODES.format(a=1, b=1).replace('role = "full"\nup_mbit = 1\n\n', "", 1), "lacks `role`"),
        (TWO_NODES.format(a=0, b=1), "up_mbit must be a positive number"),
        (TWO_NODES.format(a='"fast"', b=1), "up_mbit must be a positive number"),
        (TWO_NODES.format(a=1, b=1).replace('"full"', '"boss"', 1), "role 'boss' is not one of"),
        (TWO_NODES.format(a=1, b=1).replace('"b"', '"a"'), "repeated: a"),
        (TWO_NODES.format(a=1, b=1).replace('"b"', '"hub"'), "name 'hub' must match"),
        (TWO_NODES.format(a=1, b=1).replace('"b"', '"no spaces"'), "name 'no spaces' must match"),
        (TWO_NODES.format(a=1, b=1) + "cpus = [4096]\n", "cpus must be a non-empty list of core numbers"),
        (TWO_NODES.format(a=1, b=1) + "memory_gb = 0\n", "memory_gb must be a positive number of GB"),
        (TWO_NODES.format(a=1, b=1) + "cpu_quota = -0.5\n", "cpu_quota must be a positive number of cores"),
        (TWO_NODES.format(a=1, b=1).split("\n\n")[0], "at least two [[node]] tables"),
        ("[bootstrap]\nup_mbit = -1\n" + TWO_NODES.format(a=1, b=1), "[bootstrap] up_mbit must be a positive"),
        (TWO_NODES.format(a=1, b=1) + "latency_ms = -3\n", "node 'b' latency_ms must be 0 to 10000 ms"),
        ("[bootstrap]\nlatency_ms = true\n" + TWO_NODES.format(a=1, b=1), "[bootstrap] latency_ms must be 0 to"),
    ],
)
def test_a_malformed_topology_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=r"topology lab\.toml: ") as error:
        parse_topology(text, "lab", "lab.toml")
    assert message in str(error.value)


def test_a_missing_topology_names_the_bundled_ones() -> None:
    bundled = (
        "edge-only, hetero, hetero-tiny, hetero-tiny-wan, mixed-speed, pipeline-link-fast, pipeline-link-slow, "
        "slow-link, slow-link-base, uniform"
    )
    with pytest.raises(TopologyError, match=rf"no such file, nor a bundled topology .*{bundled}"):
        load_topology(Path("nowhere.toml"))


# ----------------------------------------------------------------------------------------------- command lines


def test_each_method_starts_the_cli_with_its_roles_and_run_options() -> None:
    cfg = BenchConfig(preset="tiny", rounds=2, inner_steps=5, subspace_rank=8)
    hetero = load_topology(Path("hetero"))

    def options(argv: list[str], *names: str) -> tuple[Any, ...]:
        """What the started command gets for `names`, however the command line spells it."""
        params = parse_argv(argv)[1]
        return tuple(params[name] for name in names)

    diloco = bootstrap_argv(cfg, "diloco", "10.0.0.1", "b.id")
    assert options(diloco, "outer", "diloco_wire", "inner_steps", "host", "port") == (
        "diloco", "fp32", 5, "10.0.0.1", 31337,
    )  # fmt: skip
    assert options(diloco, "activation_compression", "subspace_rank", "overlap", "round_s") == ("subspace", 0, False, 0)
    overlapped = bootstrap_argv(BenchConfig(round_s=20, overlap=True), "sparseloco", "10.0.0.1", "b.id")
    assert options(overlapped, "outer", "overlap", "round_s") == ("sparseloco", True, 20)
    assert expected_replicas("hetero", load_topology(Path("mixed-speed")), 2) == 4  # 3 full, and the edge pipeline
    compress_all = bootstrap_argv(cfg, "compress-all", "10.0.0.1", "b.id")
    assert options(compress_all, "activation_compression", "subspace_rank") == ("compress-all", 8)
    assert options(bootstrap_argv(cfg, "hetero", "10.0.0.1", "b.id"), "activation_compression") == ("subspace",)
    # the lab's nodes are its own processes: the mean rule, said explicitly (a public bootstrap's own is robust)
    assert options(compress_all, "aggregation", "target_utilisation") == ("mean", 0.9)
    assert "aggregation" in parse_argv(compress_all)[2]
    robust = BenchConfig(aggregation="robust", target_utilisation=0.5)
    assert options(bootstrap_argv(robust, "hetero", "10.0.0.1", "b.id"), "aggregation", "target_utilisation") == (
        "robust", 0.5,
    )  # fmt: skip
    assert options(bootstrap_argv(robust, "diloco", "10.0.0.1", "b.id"), "aggregation") == ("mean",)  # its only rule
    with pytest.raises(ConfigError, match="--aggregation must be one of mean, robust"):
        BenchConfig(aggregation="median")
    with pytest.raises(ConfigError, match=r"--target-utilisation must be in \[0, 1\)"):
        BenchConfig(target_utilisation=90)
    edge = join_argv(cfg, "sparseloco", hetero, 2, "10.0.0.4", "/ip4/x", "edge0.jsonl")
    assert options(edge, "role", "bandwidth_mbps", "min_peers", "peers", "host") == (
        "full", 50, 4, ["/ip4/x"], "10.0.0.4",
    )  # fmt: skip
    assert options(join_argv(cfg, "hetero", hetero, 2, "10.0.0.4", "/ip4/x", "m"), "role") == ("auto",)
    assert expected_replicas("hetero", hetero, 2) == 3  # the datacenter nodes, and the edge nodes' pipeline
    assert expected_replicas("compress-all", hetero, 2) == 2
    assert options(join_argv(cfg, "hetero", hetero, 2, "10.0.0.4", "/ip4/x", "m"), "memory_gb") == (0.3,)
    assert options(edge, "memory_gb") == (None,)  # a pinned full replica: the cap is the planner's business only
    measured = join_argv(BenchConfig(measure_bandwidth=True), "hetero", hetero, 0, "10.0.0.2", "/ip4/x", "m")
    assert options(measured, "remeasure_bandwidth", "bandwidth_mbps") == (True, None)
    ddp = ddp_argv(cfg, 1, 4, "10.0.0.2", "dc1.jsonl")
    assert parse_argv(ddp)[0] == "ddp-rank"
    assert options(ddp, "rank", "world_size", "master", "rounds", "inner_steps") == (1, 4, "10.0.0.2:29500", 2, 5)


def test_swarm_methods_can_get_a_larger_budget_than_ddp() -> None:
    cfg = BenchConfig(preset="tiny", rounds=4, swarm_rounds=24)
    boot = bootstrap_argv(cfg, "hetero", "10.0.0.1", "b.id")
    ddp = ddp_argv(cfg, 0, 4, "10.0.0.2", "m.jsonl")
    assert parse_argv(boot)[1]["rounds"] == 24 and parse_argv(ddp)[1]["rounds"] == 4
    assert BenchConfig(rounds=4).rounds_for("hetero") == 4  # 0: the same budget as ddp
    with pytest.raises(ConfigError, match="--swarm-rounds must not be negative"):
        BenchConfig(swarm_rounds=-1)


def test_bench_config_rejects_unknown_methods() -> None:
    assert BenchConfig().method_list == METHODS
    with pytest.raises(ConfigError, match="--methods 'ddp,fedavg'"):
        BenchConfig(methods="ddp,fedavg")


# ------------------------------------------------------------------------------------------------------ report


def synthetic_round(r: int, at_s: float, swarm_sent: int, loss: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "round": r, "inner_steps": 10, "tokens": 1000, "train_loss": 5.0, "eval_loss": loss, "bytes_sent": 100,
        "bytes_received": 100, "compute_s": 8.0, "comm_s": 2.0, "fingerprints": {}, "group_size": 3,
        "observed": {"at_s": at_s, "wire_bytes_sent": 0, "wire_bytes_received": 0,
                     "swarm_wire_bytes_sent": swarm_sent},
        **extra,
    }  # fmt: skip


def synthetic_node(name: str, role: str, vr: int | None, losses: list[float | None], **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "requested_role": "auto", "wire_bytes_sent": 4000, "wire_bytes_received": 5000,
        "header": {"role": role, "vr": vr},
        "rounds": [synthetic_round(i, 20.0 + 10 * i, 1000 * (i + 1), loss, **extra) for i, loss in enumerate(losses)],
    }  # fmt: skip


def synthetic_run(method: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "method": method, "topology": "hetero", "status": "ok", "elapsed_s": 50.0, "edge_nodes": ["edge0", "edge1"],
        "config": {"preset": "tiny", "rounds": 2, "inner_steps": 10, "batch_size": 4, "seq_len": 25, "stages": 2,
                   "subspace_rank": 0, "lr": 0.002},
        "bootstrap": {"wire_bytes_sent": 2000, "wire_bytes_received": 0}, "nodes": nodes,
    }  # fmt: skip


def test_report_from_runs_splits_virtual_replica_tokens_and_writes_table_and_plots(tmp_path: Path) -> None:
    hetero = synthetic_run("hetero", [
        synthetic_node("dc0", "full", None, [4.0, 3.0]),
        synthetic_node("dc1", "full", None, [4.2, 3.2]),
        synthetic_node("edge0", "stage", 0, [None, None], boundary_bytes_sent=50),
        synthetic_node("edge1", "stage", 0, [4.1, 3.1], boundary_bytes_sent=50),
    ])  # fmt: skip
    ddp = synthetic_run("ddp", [synthetic_node(n, "ddp", None, [3.9, 2.9]) for n in ("dc0", "dc1", "edge0", "edge1")])
    path = write_report([ddp, hetero], tmp_path)

    report = json.loads(path.read_text())
    assert report["scenario"]["topology"] == "hetero" and report["scenario"]["inner_steps"] == 10
    m = report["methods"]["hetero"]
    assert m["final_eval_loss"] == pytest.approx(3.1)  # mean over the nodes that evaluated the last round
    assert m["wall_s"] == 30.0 and m["tokens"] == 6000  # the virtual replica's 2000 tokens per node count once
    assert m["edge_token_share"] == pytest.approx(2000 / 6000)
    assert m["wire_bytes_sent"] == 4 * 4000 + 2000
    assert m["bytes_per_token"] == pytest.approx(18000 / 6000)
    edge = m["nodes"]["edge1"]
    assert (edge["role"], edge["tokens"], edge["reported_bytes_sent"], edge["edge"]) == ("stage", 1000, 300, True)
    assert edge["wall_s"] == 20.0 and edge["compute_utilisation"] == pytest.approx(16 / 20)
    assert [p["wire_bytes_sent"] for p in m["curve"]] == [1000, 2000]
    assert report["methods"]["ddp"]["edge_token_share"] == pytest.approx(0.5)

    assert m["rounds_not_aggregated"] == 0 and m["outer_bytes_per_round_per_node"] == 100
    assert m["outer_message_bytes"] == 50  # 100 bytes a round, fetched by the 2 other members of a group of 3
    met = {t["target"]: (t["measured"], t["met"]) for t in report["targets"]}
    assert met["hetero's final eval loss within 3% of ddp's (ratio)"] == (pytest.approx(3.1 / 2.9), False)
    assert met["hetero: edge nodes contribute ≥ 25% of the swarm's tokens"] == (pytest.approx(1 / 3), True)
    assert met["sparseloco sends ≥ 30× fewer bytes per round than fp32 diloco (counted, per receiving peer)"] == (
        None,
        None,
    )

    markdown = (tmp_path / "report.md").read_text()
    assert "| hetero's final eval loss within 3% of ddp's (ratio) | 1.069 | no |" in markdown
    assert "| hetero | swarm | ok | 3.1000 | 30.0 |" in markdown
    assert "| hetero | edge1 (edge) | stage |" in markdown
    for plot in (LOSS_VS_WALL, LOSS_VS_BYTES):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


def test_time_to_ddp_loss_is_the_first_evaluation_within_3_percent_of_ddps_final_loss(tmp_path: Path) -> None:
    ddp = synthetic_run("ddp", [synthetic_node(n, "ddp", None, [3.5, 3.0]) for n in ("dc0", "dc1")])
    fast = synthetic_run("sparseloco", [synthetic_node(n, "full", None, [3.2, 3.08, 2.9]) for n in ("dc0", "dc1")])
    for node in fast["nodes"]:  # it starts at once and evaluates every 2 s where ddp takes 10
        for i, record in enumerate(node["rounds"]):
            record.update(compute_s=1.0, comm_s=1.0)
            record["observed"]["at_s"] = 2.0 * (i + 1)
    fast["config"]["target_utilisation"] = 0.0
    slow = synthetic_run("compress-all", [synthetic_node("dc0", "full", None, [3.3, 3.2])])
    report = json.loads(write_report([ddp, fast, slow], tmp_path).read_text())
    assert report["scenario"]["target_utilisation"] == 0.0  # the rounds' settings are a swarm run's, not ddp's

    reached = report["time_to_ddp_loss"]
    assert reached["target_eval_loss"] == pytest.approx(3.0 * 1.03)
    assert reached["methods"]["ddp"]["at_s"] == 30.0 and reached["methods"]["ddp"]["times_sooner_than_ddp"] == 1
    row = reached["methods"]["sparseloco"]  # 3.08 ≤ 3.09 at round 1: 2 nodes × 2 rounds × 1000 tokens
    assert (row["round"], row["at_s"], row["tokens"], row["times_sooner_than_ddp"]) == (1, 4.0, 4000, 7.5)
    # its ceiling: no start-up, then ddp's 4,000 tokens at its 1,000 tokens/s; it needed no more and got there
    assert row["ceiling_times_sooner"] == pytest.approx(7.5)
    assert reached["methods"]["ddp"]["ceiling_times_sooner"] is None
    slow_row = reached["methods"]["compress-all"]  # started at 10 s, then 2,000 tokens in 20 s
    assert slow_row["reached"] is False and slow_row["times_sooner_than_ddp"] is None
    assert slow_row["ceiling_times_sooner"] == pytest.approx(30 / (10 + 4000 / 100))
    markdown = (tmp_path / "report.md").read_text()
    assert "| sparseloco | 1 | 4.0 | 4,000 | 0.00 | 7.50× | 2.9000 | 7.50 |" in markdown
    assert "| compress-all | not reached |" in markdown
    assert write_report([fast], tmp_path) and json.loads((tmp_path / "report.json").read_text())[
        "time_to_ddp_loss"] is None  # no ddp run, no target  # fmt: skip


def test_the_report_checks_the_cost_model_against_the_run(tmp_path: Path) -> None:
    run = synthetic_run("sparseloco", [synthetic_node(n, "full", None, [3.5, 3.0]) for n in ("dc0", "dc1")])
    config = run_config(inner_steps=10)
    run["run"] = config.to_dict()
    for node in run["nodes"]:
        node.update(up_mbit=8.0, down_mbit=8.0)
    report = json.loads(write_report([run], tmp_path).read_text())

    check = report["cost_model"]["sparseloco"]
    message = RunShape.from_run(config).message_bytes
    speed = 1000 / 8.0  # each round: 1000 tokens in 8 s of compute
    sent = message + LinkModel().overhead_bytes  # the one other replica fetches it; DHT and matchmaking traffic
    assert check["predicted_round_s"] == pytest.approx(10 * 8 * 64 / speed + sent * 8 / 8e6 + 1.0)
    assert check["measured_round_s"] == 10.0  # rounds observed at 20 s and 30 s
    assert check["predicted_bytes_sent_per_round"]["dc0"] == sent
    assert check["bytes_error"]["dc0"] == pytest.approx(sent / 2000 - 1)  # 4000 wire bytes over 2 rounds
    assert "## The cost model against this run" in (tmp_path / "report.md").read_text()
    for node, latency in zip(run["nodes"], (5.0, 35.0), strict=True):
        node["latency_ms"] = latency  # a round trip between them: 2 × (5 + 35) ms
    delayed = json.loads(write_report([run], tmp_path).read_text())["cost_model"]["sparseloco"]
    hops = exchange_hops(2, LinkModel().exchange)
    assert delayed["rtt_ms"] == 80 and hops >= 1
    assert delayed["predicted_round_s"] == pytest.approx(check["predicted_round_s"] + hops * 0.080)
    assert "(the worst pair's: 80 ms)" in (tmp_path / "report.md").read_text()
    run["method"] = "ddp"
    assert json.loads(write_report([run], tmp_path).read_text())["cost_model"] == {}  # nothing to predict


def test_report_only_rebuilds_from_raw_runs_and_says_when_there_are_none(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    cfg = BenchConfig(methods="ddp,hetero", report_only=True, out=tmp_path)
    with pytest.raises(HeteroNodeError, match="no raw runs of ddp, hetero"):
        run_bench(cfg)
    run = synthetic_run("ddp", [synthetic_node("dc0", "ddp", None, [3.0])])
    (tmp_path / "runs" / "ddp.json").write_text(json.dumps(run))
    report = json.loads(run_bench(cfg).read_text())
    assert list(report["methods"]) == ["ddp"] and report["methods"]["ddp"]["final_eval_loss"] == 3.0
    (tmp_path / "runs" / "hetero.json").write_text("{truncated")
    with pytest.raises(HeteroNodeError, match=r"hetero\.json: not a benchmark run"):
        run_bench(cfg)


def test_metrics_tail_returns_only_complete_new_lines_and_skips_garbage(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == (None, [])  # the node has not started writing
    path.write_text('{"header": {"role": "full"}}\n{"round": 0}\n{"round": 1, "eval')
    assert tail.read_new() == ({"role": "full"}, [{"round": 0}])  # round 1 is still being written
    with open(path, "a") as f:
        f.write('_loss": 2.5}\nnot json\n[1, 2]\n{"round": 2}\n')
    assert tail.read_new() == (None, [{"round": 1, "eval_loss": 2.5}, {"round": 2}])
    assert tail.read_new() == (None, [])


# -------------------------------------------------------------------------------------------------- lab runs

UNAVAILABLE = netns_unavailable_reason()
needs_lab = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}")
TINY = {"preset": "tiny", "rounds": 1, "inner_steps": 3, "batch_size": 4, "seq_len": 64, "stall_timeout_s": 120.0}


def my_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{LAB_PREFIX}{os.getpid()}-")]


def two_node_topology(tmp_path: Path, mbit: float) -> Topology:
    path = tmp_path / "two.toml"
    path.write_text(TWO_NODES.format(a=mbit, b=mbit))
    return load_topology(path)


@needs_lab
@pytest.mark.usefixtures("bundled_cache_dir")
@pytest.mark.timeout(180)
def test_a_ddp_lab_run_is_held_to_the_shaped_rate_and_its_counters_see_the_all_reduce(tmp_path: Path) -> None:
    run = run_method(BenchConfig(**TINY), two_node_topology(tmp_path, 20), "ddp", tmp_path / "run")
    assert my_namespaces() == []
    assert run["status"] == "ok", run["errors"]
    for node in run["nodes"]:
        (record,) = node["rounds"]
        assert record["eval_loss"] is not None and record["allreduce_bytes"] > 0
        required = {f.name for f in fields(RoundRecord) if f.default is MISSING and f.default_factory is MISSING}
        assert required <= set(record), "ddp's metrics lines must carry every key a node's do"
        # two ranks: a ring all-reduce sends the whole buffer once per step; tbf caps it at 20 Mbit/s
        mbit = record["bytes_sent"] * 8 / record["comm_s"] / 1e6
        assert 0.3 * 20 <= mbit <= 1.1 * 20, f"{node['name']} all-reduced at {mbit:.1f} Mbit/s on a 20 Mbit/s link"
        assert record["bytes_sent"] <= node["wire_bytes_sent"] <= 1.2 * record["bytes_sent"] + 1_000_000
        assert record["bytes_received"] <= node["wire_bytes_received"] <= 1.2 * record["bytes_received"] + 1_000_000


@needs_lab
@pytest.mark.usefixtures("bundled_cache_dir")
@pytest.mark.timeout(180)
def test_a_swarm_lab_run_completes_a_round_and_counts_every_link(tmp_path: Path) -> None:
    run = run_method(BenchConfig(**TINY), two_node_topology(tmp_path, 50), "sparseloco", tmp_path / "run")
    assert my_namespaces() == []
    assert run["status"] == "ok", run["errors"]
    assert run["bootstrap"]["wire_bytes_sent"] > 0
    for node in run["nodes"]:
        (record,) = node["rounds"]
        assert node["header"]["role"] == "full" and record["group_size"] == 2
        assert record["eval_loss"] is not None and record["observed"]["at_s"] > 0
        # the other's message, as counted; the wire also carries the DHT, matchmaking and stream framing
        assert 0 < record["bytes_received"] < node["wire_bytes_received"]


@needs_lab
@pytest.mark.timeout(120)
def test_a_failing_run_is_reported_with_its_log_and_leaves_no_namespace(tmp_path: Path) -> None:
    cfg = BenchConfig(**{**TINY, "seq_len": 4096})  # longer than tiny's max_seq_len: the bootstrap refuses
    run = run_method(cfg, two_node_topology(tmp_path, 50), "sparseloco", tmp_path / "run")
    assert my_namespaces() == []
    assert run["status"] == "failed" and run["nodes"] == []
    assert any("--seq-len 4096" in line for line in run["errors"]["bootstrap"])


def test_only_a_round_past_a_nodes_furthest_counts_as_progress() -> None:
    """A stage that records round 1 again and again (its pipeline never forms) must not keep a stalled run alive."""
    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    furthest: dict[str, int] = {}
    assert advanced([(a, {"round": 0}), (b, {"round": 0})], furthest) and furthest == {"a": 0, "b": 0}
    assert advanced([(a, {"round": 1})], furthest)
    assert not advanced([(a, {"round": 1}), (a, {"round": 1}), (b, {"round": 0})], furthest)
    assert not advanced([], furthest)
    assert advanced([(b, {"round": 3})], furthest) and furthest == {"a": 1, "b": 3}
