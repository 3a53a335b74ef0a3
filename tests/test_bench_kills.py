"""The kill/freeze soak's figures, computed from synthetic metrics files (the real run is `make bench-kills`)."""

from __future__ import annotations

import json
from pathlib import Path

from command_lines import parse_argv

from hetero_node.bench.config import KillSoakConfig
from hetero_node.bench.kill_soak import analyse, peer_args, render_markdown


def write(path: Path, rounds: list[dict]) -> None:
    lines = [json.dumps({"header": {}})] + [json.dumps(r) for r in rounds]
    path.write_text("\n".join(lines) + '\n{"round": 9, "trunc')  # a line still being written is skipped


def record(t: int, fp: str, contributed: bool = True, comm_s: float = 1.0) -> dict:
    return {"round": t, "fingerprints": {"0": fp}, "contributed": contributed, "comm_s": comm_s}


def test_the_soak_counts_disagreements_hangs_recovery_and_leftovers(tmp_path: Path) -> None:
    write(tmp_path / "r0.jsonl", [record(t, f"fp{t}") for t in range(6)])
    write(tmp_path / "r1.jsonl", [record(0, "fp0"), record(1, "fp1", contributed=False), record(2, "other"),
                                  record(3, "fp3", contributed=False, comm_s=45.0), record(4, "fp4")])  # fmt: skip
    events = [{"fault": "kill", "peer": "r1", "at_s": 10.0, "swarm_round": 1},
              {"fault": "freeze", "peer": "r0", "at_s": 20.0, "swarm_round": 3}]  # fmt: skip
    exits = {"r0": {"code": 0, "seconds": 1.0}, "r1": {"code": "did not exit", "seconds": 30.0}}
    report = analyse(KillSoakConfig(), ["r0", "r1"], tmp_path, events, exits, leftovers=1, wall_s=100.0)
    assert report["rounds"] == 6 and report["disagreeing_rounds"] == [2]
    assert report["waits_past_deadline"] == 1 and report["longest_wait_s"] == 45.0
    assert [f["rounds_to_contribute"] for f in report["faults"]] == [1, 0]  # r1 contributed again in round 2
    assert report["restarts_contributing_within_2_rounds"] == 1 and report["kills"] == 1 and report["freezes"] == 1
    assert report["not_exiting_0_on_sigterm"] == ["r1"] and report["processes_left_running"] == 1
    assert "| rounds in which peers disagreed (goal 0) | 1 |" in render_markdown(report)


def test_a_restarted_peer_keeps_its_identity_checkpoints_and_metrics(tmp_path: Path) -> None:
    full, stage = peer_args("/ip4/x", "r1", tmp_path, 1), peer_args("/ip4/x", "vr0-s1", tmp_path, 4)
    (_, full, _), (_, stage, _) = parse_argv(full), parse_argv(stage)
    assert (full["identity"], full["metrics"]) == (tmp_path / "r1.id", tmp_path / "r1.jsonl")
    assert (full["role"], full["checkpoint_dir"]) == ("full", tmp_path / "r1.ckpt")
    assert (stage["role"], stage["stage"], stage["identity"]) == ("stage", 1, tmp_path / "vr0-s1.id")
