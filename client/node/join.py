"""What `hetero-node join` does, start to finish.

connect → learn the run (the bootstrap's signed announcement, or this node's own options when the bootstrap is a
plain hivemind-dht) → load and check the data → measure hardware, bandwidth and throughput → publish a record
and settle on a role with the planner → train as a full replica, or hold a pipeline slot → leave cleanly.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from hetero_node.client.config import NodeConfig, SyncTimeouts
from hetero_node.client.local.devices import resolve_devices
from hetero_node.client.monitor.health import Health
from hetero_node.client.monitor.http_server import MonitorServer
from hetero_node.client.monitor.node_metrics import NodeMetrics
from hetero_node.client.node.bandwidth import joins_as_dht_client, node_bandwidth
from hetero_node.client.node.capabilities import measure_stage_throughput, measure_throughput, probe_hardware
from hetero_node.client.node.round_trip import node_round_trip_ms
from hetero_node.client.node.run_definition import adopt_announced_run, fetch_run_announcement, prepare_run
from hetero_node.client.roles.leaving import leave_on_signals
from hetero_node.client.roles.measured_speed import load_speed, speed_key
from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.client.swarm.addresses import identity_taken
from hetero_node.client.swarm.auto_plan import MarginalGain, requirements
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.client.swarm.membership import Membership
from hetero_node.client.swarm.reachability import reachable_runtime
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.client.swarm.twin_check import live_twin
from hetero_node.models.paths import default_cache_dir
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import REQUEST_FULL, REQUEST_STAGE, ROLE_FULL, ROLE_JOINING
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.swarm_key import load_swarm_key, member_proof

logger = logging.getLogger(__name__)

IDENTITY_NAME = "identity"
"""Without --identity, a node with a checkpoint directory keeps its key there: restarted, it is the same peer, so
its own record (and pipeline slot) is not mistaken for another peer's that still holds the slot it checkpointed."""


def bandwidth_cache() -> Path:
    """This host's measured links, by target (`client/node/bandwidth.py`)."""
    return default_cache_dir() / "bandwidth.json"


def _initial_record(
    runtime: PeerRuntime, run: RunConfig, shape: RunShape, node: NodeConfig, requested_role: str, pinned_stage: int,
    devices: list[torch.device],
) -> PeerRecord:  # fmt: skip
    """Measure this node (on `devices`, its local ranks' devices) and describe it as a PeerRecord (role still
    "joining")."""
    hardware = probe_hardware(devices[0], node.memory_gb)  # each local rank holds the whole model
    bandwidth = node_bandwidth(runtime, node.bandwidth_mbps, bandwidth_cache(), node.remeasure_bandwidth)
    rtt_ms = node_round_trip_ms(runtime)
    fits = hardware.memory_gb * 1e9 >= shape.full_memory_bytes
    stage = timed_stage(shape, hardware.memory_gb * 1e9, pinned_stage)
    throughput, step_s = 0.0, 0.0
    if fits and requested_role != REQUEST_STAGE:
        kept = load_speed(node.checkpoint_dir, speed_key(run, node, devices))
        if kept is not None:  # a restart: the speed our last rounds measured, not a probe's
            logger.info("speed as this node's last rounds measured it: %.0f tokens/s", kept.tokens_per_s)
            throughput, step_s = kept.tokens_per_s, kept.step_s
        else:
            throughput = measure_throughput(run, devices[0])
            step_s = run.batch_size * run.seq_len / throughput + node.step_delay_s
            throughput *= len(devices)  # an estimate (a step of each rank at once) until the first round measures it
    elif stage is not None:  # a stage node: the whole model's speed as its stage shows it (step_s stays a replica's)
        throughput = measure_stage_throughput(run, devices[0], stage, shape.stage_compute_share[stage])
    return PeerRecord(
        peer_id=str(runtime.peer_id),
        addrs=runtime.advertised_addrs[:16],
        version=version("hetero-node"),
        gpus=[{"name": name[:128], "memory_gb": round(gb, 2)} for name, gb in hardware.gpus],
        devices=len(devices),
        cpu_cores=hardware.cpu_cores,
        ram_gb=round(hardware.ram_gb, 2),
        memory_gb=round(hardware.memory_gb, 3),
        upload_mbps=bandwidth.upload_mbps,
        download_mbps=bandwidth.download_mbps,
        bandwidth_source=bandwidth.source,
        rtt_ms=rtt_ms,
        tokens_per_s=round(throughput, 1),
        role=ROLE_JOINING,
        requested_role=requested_role,
        pinned_stage=pinned_stage,
        stage=-1,
        vr=-1,
        claimed_at=0.0,
        round=0,
        certified=0,
        train_round=-1,
        deadline=0.0,
        step_s=round(step_s, 4),
        overhead_s=0.0,
        loss=None,
        fingerprints={},
        view="",
        last_round=None,
        refresh_s=float(node.record_refresh_s),
        written_at=0.0,  # set when stored
        member_proof=member_proof(runtime.swarm_key, str(runtime.peer_id)),
    )


def timed_stage(shape: RunShape, memory_bytes: float, pinned_stage: int) -> int | None:
    """The stage a node that holds no full replica times its speed on: its pin, else the heaviest it fits (None:
    none fits)."""
    fits = [s for s in range(shape.stages) if shape.stage_memory_bytes[s] <= memory_bytes]
    if pinned_stage >= 0:
        return pinned_stage if pinned_stage in fits else None
    return max(fits, key=lambda s: (shape.stage_compute_share[s], -s), default=None)


def role_for_run(run: RunConfig, requested_role: str, devices: int = 1) -> str:
    """compress-all trains every replica as a virtual replica; a run without boundaries has no stages; a node on
    several devices (`--devices`) trains a full replica across them."""
    if devices > 1:
        if requested_role == REQUEST_STAGE or run.pipeline.activation_compression == "compress-all":
            raise ConfigError(
                "--devices: a node on several devices trains one full replica across them; a pipeline stage (--role "
                "stage, or a compress-all run) runs on one device: pass --device instead"
            )
        return REQUEST_FULL
    if run.pipeline.activation_compression == "compress-all":
        if requested_role == REQUEST_FULL:
            raise ConfigError("--role full: this run is compress-all, where every node serves a pipeline stage")
        return REQUEST_STAGE
    if run.outer.stages < 2 and requested_role == REQUEST_STAGE:
        raise ConfigError("--role stage: this run has one stage, so every node trains a full replica")
    return requested_role


def serve_node_metrics(
    stack: contextlib.ExitStack, node: NodeConfig, run: RunConfig, runtime: PeerRuntime
) -> NodeMetrics | None:
    """With --metrics-port: this node's Prometheus metrics, /healthz and /readyz on node.host, until `stack`
    closes."""
    if node.metrics_port is None:
        return None
    metrics = NodeMetrics(run.run_id, version("hetero-node"))
    metrics.watch_peers(lambda: runtime.peers_seen)
    server = MonitorServer(
        node.metrics_host, node.metrics_port, metrics.registry, health=Health(runtime.p2pd_alive, metrics.readiness)
    )
    stack.callback(server.close)
    logger.info("Prometheus metrics at %smetrics", server.url)
    return metrics


TRAINING_IMPORTS = ("torch._dynamo",)
"""What a node's first training step imports (AdamW's step imports torch's compiler): 1.5 s on an idle 2-core
machine, 3-4 s in a busy one, on the path of every (re)start if left to that step."""


def import_in_background(modules: tuple[str, ...] = TRAINING_IMPORTS) -> None:
    """Import `modules` in a thread while this node waits on the network (the DHT, the run, settling on a role),
    so its first step does not; a module the main thread needs meanwhile waits on Python's per-module lock."""
    threading.Thread(target=import_quietly, args=(modules,), name="hetero-node-imports", daemon=True).start()


def import_quietly(modules: tuple[str, ...]) -> None:
    """Import `modules`; a failure is only logged (at debug): a node that stops at once (a mismatched run) tears its
    interpreter down under the import, and CI saw torch's half-registered operators print a thread's traceback into
    a log whose error should be one line. A module that did not import is imported again where it is needed."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # whatever the import raised: it was only ever ahead of time
            logger.debug("importing %s ahead of time stopped: %r", name, e)
            return


def run_node(
    configs: dict[str, Any],
    explicit: set[str],
    node: NodeConfig,
    timeouts: SyncTimeouts,
    requested_role: str,
    pinned_stage: int,
    on_status: Callable[[str], None],
    on_round: Callable[[RoundRecord], None] | None = None,
) -> None:
    """See the module docstring; blocks until the run ends or a signal asks the node to leave."""
    from hetero_node.client.roles.full_replica import FullReplica  # after the cheap checks: torch-heavy
    from hetero_node.client.roles.stage_peer import StagePeer

    import_in_background()
    swarm_key = load_swarm_key(node.swarm_key)
    identity = node.identity or (node.checkpoint_dir / IDENTITY_NAME if node.checkpoint_dir is not None else None)
    known_key = identity is not None and identity.exists()  # a key made now is nobody else's
    dht_client = joins_as_dht_client(node.bandwidth_mbps, node.dht_client_below_mbps, bandwidth_cache(), node.peers)
    if dht_client:
        logger.info("a slow uplink: joining the DHT as a client (--dht-client-below-mbps)")
    runtime = reachable_runtime(
        lambda relays: PeerRuntime(
            node.peers, node.host, node.port, identity, client_mode=dht_client, swarm_key=swarm_key, relays=relays
        ),
        node.reachability,
        node.peers,
    )
    stop = threading.Event()
    leave_on_signals(stop)
    membership = None
    stack = contextlib.ExitStack()
    try:
        on_status("reading the run announcement")
        announcement = fetch_run_announcement(runtime)
        if announcement is not None:
            if swarm_key is not None and not announcement.private:  # our sealed record would be unreadable there
                raise ConfigError("this swarm is public: drop --swarm-key (its peers could not read our record)")
            run, store = adopt_announced_run(announcement, configs, explicit)
        else:
            logger.warning("no peer in --peers announces a run; using this node's own run options (%s aggregation)",
                           configs["outer"].aggregation)  # fmt: skip
            run, store = prepare_run(*configs.values())
        devices = resolve_devices(node.device, node.devices)
        requested_role = role_for_run(run, requested_role, len(devices))
        runtime.join_run(run.run_id)
        twin = stack.enter_context(ThreadPoolExecutor(1)).submit(live_twin, runtime, stop) if known_key else None
        metrics = serve_node_metrics(stack, node, run, runtime)
        if metrics is not None:
            on_round = _both(on_round, metrics.observe_round)
        on_status(f"run {run.run_id}: measuring this node")
        shape = RunShape.from_run(run)
        req = requirements(shape)
        record = _initial_record(runtime, run, shape, node, requested_role, pinned_stage, devices)
        if twin is not None and twin.result() and identity is not None:  # checked while this node was measured
            raise ConfigError(identity_taken(identity))
        membership = Membership(runtime, req, record, node.record_refresh_s, node.settle_s, stop, MarginalGain(shape))
        on_status(f"run {run.run_id}: choosing a role")
        if membership.settle() is None:
            return
        membership.watch()
        if metrics is not None:
            metrics.set_role(membership.role)
        if membership.role == ROLE_FULL:
            on_status(f"run {run.run_id}: full replica, joining the swarm")
            FullReplica(run, node, store, timeouts, runtime, membership).run(on_round)
        else:
            while not stop.is_set():  # a stage peer whose slot is reassigned serves its new slot
                vr, stage = membership.slot
                on_status(f"run {run.run_id}: pipeline stage {stage} of virtual replica {vr}")
                StagePeer(run, node, store, timeouts, runtime, membership).run(on_round)
                if membership.slot == (vr, stage):
                    break
    finally:
        stack.close()
        if membership is not None:
            membership.close()
        runtime.shutdown()


def _both(
    first: Callable[[RoundRecord], None] | None, second: Callable[[RoundRecord], None]
) -> Callable[[RoundRecord], None]:
    def both(record: RoundRecord) -> None:
        if first is not None:
            first(record)
        second(record)

    return both
