"""The soak's figures from synthetic samples, and a real sample of this process's group (`make bench-soak` runs it)."""

from __future__ import annotations

import os

from hetero_node.bench.config import SoakConfig
from hetero_node.bench.soak import analyse, render_markdown, sample_group


def test_a_real_process_group_is_sampled() -> None:
    sample = sample_group(os.getpgid(0))
    assert sample["processes"] >= 1 and sample["rss_mb"] > 10 and sample["fds"] >= 3 and sample["threads"] >= 1
    assert sample_group(2**22 + 12345) == {"rss_mb": 0.0, "fds": 0, "threads": 0, "processes": 0}  # no such group


def test_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    cfg = SoakConfig(minutes=10, warmup_minutes=2)
    series = [{"t_s": t, "rss_mb": rss, "fds": 40, "threads": 20, "processes": 3}
              for t, rss in ((0, 100.0), (60, 300.0), (120, 400.0), (600, 410.0))]  # fmt: skip
    report = analyse(cfg, {"r0": series}, {"r0": 0}, left_running=1, left_files=["/tmp/x.sock"], rounds={"r0": 7})
    peer = report["peers"]["r0"]
    assert peer["rss_mb_warm"] == 400.0 and peer["rss_growth"] == 0.025 and peer["rss_mb_peak"] == 410.0
    text = render_markdown(report)
    assert "| r0 | 7 | 400.0 → 410.0 (+2.5%) | 410.0 | 40 → 40 |" in text
    assert "processes left running after SIGTERM: 1; files left behind: 1" in text
