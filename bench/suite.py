"""`hetero-node-lab bench`: run each method of a scenario in a fresh lab, keep the raw runs, write the report."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetero_node.bench import cpu_quota
from hetero_node.bench.config import BenchConfig
from hetero_node.bench.lab_run import run_method
from hetero_node.bench.netns import cleanup_stale, netns_unavailable_reason
from hetero_node.bench.report import write_report
from hetero_node.bench.topology import load_topology
from hetero_node.protocol.errors import HeteroNodeError

logger = logging.getLogger(__name__)

RESULTS_DIR = Path("bench/results")


def run_bench(cfg: BenchConfig, console: Console | None = None) -> Path:
    """Run every method of `cfg` one after the other and write `<out>/report.json` (returned), `report.md`, the
    plots, and one raw `runs/<method>.json` per method. A method that fails or times out is reported with its
    status and the tail of its logs; the others still run."""
    topology = load_topology(cfg.topology)
    out = cfg.out or RESULTS_DIR / topology.name
    if cfg.report_only:
        return write_report(load_runs(out, cfg.method_list), out)
    reason = netns_unavailable_reason()
    if reason is not None:
        raise HeteroNodeError(f"the benchmark lab needs network namespaces, which are unavailable here: {reason}")
    quota_reason = cpu_quota.unavailable_reason()
    if quota_reason is not None and any(n.cpu_quota is not None for n in topology.nodes):
        raise HeteroNodeError(f"topology {topology.name} caps node CPUs, which is unavailable here: {quota_reason}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cleanup_stale()  # namespaces a killed earlier run left behind
    runs = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rounds"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console or Console(stderr=True)) as progress:
        for method in cfg.method_list:
            run = run_method(cfg, topology, method, out / "logs" / method, progress)
            (out / "runs" / f"{method}.json").write_text(json.dumps(run, indent=2) + "\n")
            if run["status"] != "ok":
                logger.error("%s: %s; the logs are in %s", method, run["status"], out / "logs" / method)
            runs.append(run)
    return write_report(runs, out)


def load_runs(out: Path, methods: tuple[str, ...]) -> list[dict[str, Any]]:
    """The raw runs an earlier `hetero-node-lab bench` left in `out/runs/`, in `methods` order (missing ones
    skipped)."""
    runs = []
    for method in methods:
        path = out / "runs" / f"{method}.json"
        try:
            runs.append(json.loads(path.read_text()))
        except FileNotFoundError:
            logger.warning("no raw run of %s in %s", method, path.parent)
        except (OSError, json.JSONDecodeError) as e:
            raise HeteroNodeError(f"{path}: not a benchmark run ({e})") from None
    if not runs:
        raise HeteroNodeError(f"no raw runs of {', '.join(methods)} in {out / 'runs'}: run the benchmark first")
    return runs
