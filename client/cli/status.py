"""`hetero-node status`: the swarm as the DHT describes it, as a table, JSON, a live view, or a web dashboard.

It joins the DHT as a client (it serves nothing and owns no records), learns the run from the bootstrap's
announcement (or `--run-id`), and reads the run's peer records: only signed, schema-valid ones count.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from functools import partial
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from hetero_node.client.monitor.http_server import open_dashboard
from hetero_node.client.monitor.snapshot import read_snapshot
from hetero_node.client.node.run_definition import fetch_run_announcement
from hetero_node.client.swarm.addresses import parse_peer_multiaddrs
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.errors import ConfigError


def _hardware(peer: dict[str, Any]) -> str:
    """What a peer trains on: its GPU (a peer's text, not markup), or its CPU; ×N where a node trains one replica
    on N local devices (`--devices`)."""
    ranks = peer["devices"]
    if peer["gpus"]:
        name = escape(peer["gpus"][0]["name"])
        return f"{ranks}× {name}" if ranks > 1 else name
    return f"cpu ×{peer['cpu_cores']}" + (f", {ranks} ranks" if ranks > 1 else "")


def _peer_table(snapshot: dict[str, Any]) -> Table:
    run = snapshot["run"]
    title = f"run {snapshot['run_id']}" + (f" · {run['preset']} · H={run['outer']['inner_steps']}" if run else "")
    table = Table(title=f"{title} · round {snapshot['round']} · {len(snapshot['peers'])} peers")
    for column in ("peer", "role", "vr", "stage", "gpu", "mem GB", "up/down Mbit/s", "rtt ms", "tokens/s", "round",
                   "loss", "seen"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("peer", "role", "gpu") else "right")
    for p in snapshot["peers"]:
        gpu = _hardware(p)
        table.add_row(
            p["peer_id"][-8:], p["role"], str(p["vr"]) if p["vr"] >= 0 else "", str(p["stage"]) if p["stage"] >= 0
            else "", gpu, f"{p['memory_gb']:.2f}", f"{p['upload_mbps']:,.0f}/{p['download_mbps']:,.0f}",
            f"{p['rtt_ms']:.0f}" if p["rtt_ms"] else "?", f"{p['tokens_per_s']:,.0f}", str(p["round"]),
            "" if p["loss"] is None else f"{p['loss']:.3f}", f"{p['last_seen_s']:.0f}s ago",
        )  # fmt: skip
    return table


def _replica_table(snapshot: dict[str, Any]) -> Table:
    table = Table(title="virtual replicas")
    for column in ("vr", "stages held (peer)", "missing stages"):
        table.add_column(column)
    for vr, info in snapshot["virtual_replicas"].items():
        held = ", ".join(f"{s}: {pid[-8:]}" for s, pid in info["stages"].items())
        table.add_row(vr, held, ", ".join(map(str, info["missing"])) or "complete")
    return table


def render(snapshot: dict[str, Any]) -> Group:
    agree = "yes" if snapshot["views_agree"] else "not yet"
    parts: list[Any] = [_peer_table(snapshot)]
    if snapshot["virtual_replicas"]:
        parts.append(_replica_table(snapshot))
    parts.append(f"all peers see the same plan: {agree}")
    return Group(*parts)


def show_status(
    peers: list[str], run_id: str | None, as_json: bool, watch_s: float, serve_port: int | None, console: Console,
    swarm_key: bytes | None = None,
) -> None:  # fmt: skip
    """See the module docstring; with `watch_s` > 0, refresh until Ctrl-C; with `serve_port`, serve the dashboard
    on 127.0.0.1 until Ctrl-C; with `swarm_key`, a private swarm's (sealed) records."""
    addresses = parse_peer_multiaddrs([p for arg in peers for p in arg.replace(",", " ").split()])
    runtime = PeerRuntime(addresses, client_mode=True, swarm_key=swarm_key)
    try:
        announcement = fetch_run_announcement(runtime)
        if announcement is None and run_id is None:
            raise ConfigError("no peer in --peers announces a run (a plain hivemind-dht?); pass --run-id")
        run = announcement.config if announcement is not None else None
        runtime.join_run(announcement.run_id if announcement is not None else run_id, serve=False)

        def current() -> dict[str, Any]:
            snapshot = read_snapshot(runtime.read_records_timed, runtime.run_id, run)
            if snapshot is None:
                raise ConfigError("the DHT did not answer; check --peers and try again")
            return snapshot

        if serve_port is not None:
            read = partial(read_snapshot, runtime.read_records_timed, runtime.run_id, run)
            with open_dashboard("127.0.0.1", serve_port, read) as server, contextlib.suppress(KeyboardInterrupt):
                console.print(f"dashboard: {server.url}  metrics: {server.url}metrics", markup=False, highlight=False)
                threading.Event().wait()
        elif as_json:
            console.out(json.dumps(current(), indent=2), highlight=False)
        elif watch_s <= 0:
            console.print(render(current()))
        else:
            live = Live(render(current()), console=console, auto_refresh=False)
            with live, contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(watch_s)
                    live.update(render(current()), refresh=True)
    finally:
        runtime.shutdown()
