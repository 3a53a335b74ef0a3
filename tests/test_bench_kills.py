"""The kill/freeze soak's figures, computed from synthetic metrics files (the real run is `make bench-kills`)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from command_lines import parse_argv

from hetero_node.bench.config import KillSoakConfig
from hetero_node.bench.kill_soak import analyse, peer_args, render_markdown


def write(path: Path, rounds: list[dict]) -> None:
    lines = [json.dumps({"header": {}})] + [json.dumps(r) for r in rounds]
    path.write_text("\n".join(lines) + '\n{"round": 9, "trunc')  # a line still being written is skipped


def record(t: int, fp: str, contributed: bool = True, comm_s: float = 1.0) -> dict:
    """Round t's metrics line, ended at wall time 1000 + 10·t."""
    return {
        "round": t,
        "fingerprints": {"0": fp},
        "contributed": contributed,
        "comm_s": comm_s,
        "ended_at": 1000 + 10 * t,
    }


def resumed_log(path: Path, up_at: float, at_wall: float) -> None:
    """A restarted peer's log: its first line at `up_at`, its checkpoint loaded at `at_wall`."""
    up, resumed = (datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:23] for t in (up_at, at_wall))
    path.write_text(f"p2pd says hello\n{up} INFO reachability: reachable\nTraceback (no time)\n"
                    f"{resumed} INFO held_state: resumed from checkpoint at round 1\n")  # fmt: skip


def kill(peer: str, at_wall: float, swarm_round: int, process: str) -> dict:
    return {"fault": "kill", "peer": peer, "at_s": at_wall - 1000, "at_wall": at_wall, "swarm_round": swarm_round,
            "process": process}  # fmt: skip


def test_the_soak_counts_disagreements_hangs_recovery_and_leftovers(tmp_path: Path) -> None:
    write(tmp_path / "r0.jsonl", [record(t, f"fp{t}") for t in range(6)])
    lagging = {**record(5, "fp4", contributed=False), "caught_up": "behind"}  # holds θ(5) still: lags, agrees
    slow = record(3, "fp3", contributed=False, comm_s=45.0)
    write(tmp_path / "r1.jsonl", [record(0, "fp0"), record(1, "fp1", contributed=False), record(2, "other"), slow,
                                  record(4, "fp4"), lagging])  # fmt: skip
    resumed_log(tmp_path / "r1.0.log", 1009.0, 1012.0)  # the swarm had recorded round 1 then: started within it
    resumed_log(tmp_path / "r1.3.log", 1035.5, 1036.0)
    events = [kill("r1", 1005.0, 1, "r1.0"),
              {"fault": "freeze", "peer": "r0", "at_s": 20.0, "at_wall": 1020.0, "swarm_round": 3, "process": "r0"},
              kill("r1", 1033.0, 3, "r1.2"),  # hit again 2 s later, before it contributed: interrupted
              kill("r1", 1035.0, 3, "r1.3")]  # fmt: skip
    exits = {"r0": {"code": 0, "seconds": 1.0}, "r1": {"code": "did not exit", "seconds": 30.0}}
    report = analyse(KillSoakConfig(), ["r0", "r1"], tmp_path, events, exits, leftovers=1, wall_s=100.0,
                     idle_import_s=2.5)  # fmt: skip
    assert report["rounds"] == 6 and report["disagreeing_rounds"] == [2]
    assert report["waits_past_deadline"] == 1 and report["longest_wait_s"] == 45.0
    assert [f["rounds_to_contribute"] for f in report["faults"]] == [1, 0, 1, 1]  # r1 contributed in rounds 2, 4
    assert report["restarts_contributing_within_2_rounds"] == 3 and report["kills"] == 3 and report["freezes"] == 1
    assert [f.get("interrupted") for f in report["faults"]] == [False, None, True, False]
    assert report["restarts_not_interrupted"] == 2 and report["uninterrupted_within_2_rounds"] == 2
    first, last = report["faults"][0], report["faults"][3]
    assert (first["startup_s"], first["startup_rounds"], first["rounds_after_resuming"]) == (7.0, 0, 1)
    assert (last["startup_s"], last["startup_rounds"], last["rounds_after_resuming"]) == (1.0, 0, 1)
    assert report["startup_s_mean"] == 4.0 and report["rounds_after_resuming"] == {"max": 1, "mean": 1}
    assert (first["process_up_s"], last["process_up_s"], report["process_up_s_mean"]) == (4.0, 0.5, 2.2)
    assert report["not_exiting_0_on_sigterm"] == ["r1"] and report["processes_left_running"] == 1
    markdown = render_markdown(report)
    assert "| rounds in which peers disagreed (goal 0) | 1 |" in markdown
    assert "| restarts not hit again before contributing: within 2 rounds | 2 / 2 |" in markdown
    assert "(interpreter, imports, p2pd, the DHT): s, mean | 2.2 |" in markdown
    assert "on the idle machine (before the swarm), s | 2.5 |" in markdown


def test_a_restarted_peer_keeps_its_identity_checkpoints_and_metrics(tmp_path: Path) -> None:
    full, stage = peer_args("/ip4/x", "r1", tmp_path, 1), peer_args("/ip4/x", "vr0-s1", tmp_path, 4)
    (_, full, _), (_, stage, _) = parse_argv(full), parse_argv(stage)
    assert (full["identity"], full["metrics"]) == (tmp_path / "r1.id", tmp_path / "r1.jsonl")
    assert (full["role"], full["checkpoint_dir"]) == ("full", tmp_path / "r1.ckpt")
    assert (stage["role"], stage["stage"], stage["identity"]) == ("stage", 1, tmp_path / "vr0-s1.id")
