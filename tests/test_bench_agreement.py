"""The agreement loop's figures from synthetic runs (the real loop is `make bench-agreement`)."""

from __future__ import annotations

from pathlib import Path

from hetero_node.bench.agreement import analyse_run, render_markdown, summarise, swarm_argvs
from hetero_node.bench.config import AgreementConfig


def record(t: int, fp: str, contributors: int = 4) -> dict[str, object]:
    return {"round": t, "fingerprints": {"0": fp, "1": "s1"}, "contributors": contributors, "comm_s": 1.0 + t}


def test_a_fork_a_partial_round_and_a_failed_replica_are_each_counted() -> None:
    agree = {f"r{i}": {t: record(t, f"a{t}") for t in range(3)} for i in range(3)}
    forked = {**agree, "r3": {0: record(0, "a0"), 1: record(1, "b1", contributors=2), 2: record(2, "a2")}}
    run = analyse_run({"exits": {"r0": 0, "r1": 0, "r2": 0, "r3": 1}, "rounds": forked}, replicas=4)
    assert run["disagreeing_rounds"] == [1] and run["partial_rounds"] == [1] and run["failed"] == ["r3"]
    clean = analyse_run({"exits": dict.fromkeys(agree, 0), "rounds": agree}, replicas=4)
    assert clean["partial_rounds"] == [] and clean["disagreeing_rounds"] == [] and clean["failed"] == []
    report = summarise(AgreementConfig(runs=2, rounds=3), [run, clean])
    assert (report["failed_runs"], report["disagreeing_rounds"], report["rounds_without_every_replica"]) == (1, 1, 1)
    assert "| rounds in which replicas disagreed (goal 0) | 1 of 6 |" in render_markdown(report)


def test_the_swarm_is_the_tests_swarm(tmp_path: Path) -> None:
    cfg = AgreementConfig(replicas=4, rounds=3)
    run = swarm_argvs(cfg, None, tmp_path, -1)
    assert run[run.index("--preset") : run.index("--preset") + 2] == ["--preset", "tiny"]
    join = swarm_argvs(cfg, "/ip4/127.0.0.1/tcp/1/p2p/QmX", tmp_path, 2)
    assert join[join.index("--min-peers") + 1] == "4" and str(tmp_path / "r2.jsonl") in join
