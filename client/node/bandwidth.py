"""Measure this node's upload and download bandwidth by timing real transfers over hivemind P2P.

The far end is a peer serving `protocol/probe.py` (the bootstrap, or any hetero-node peer). A probe starts at
a few MB and grows until a transfer lasts long enough to be timed (or hits the cap), so a fast link is not
reported as "instant" and a slow one is not kept busy for long. Results are cached per host and target, so a
restarted node does not re-measure; `--remeasure-bandwidth` forces it, `--bandwidth-mbps` skips it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.protocol.probe import MAX_PROBE_BYTES, PROBE_DOWNLOAD, PROBE_PIECE_BYTES, PROBE_UPLOAD, wire

logger = logging.getLogger(__name__)

FIRST_PROBE_BYTES = 4 * 1024 * 1024
MIN_TIMED_S = 1.0
"""A transfer shorter than this is repeated 4× larger (up to MAX_PROBE_BYTES): timer and scheduler noise."""
CACHE_MAX_AGE_S = 24 * 3600.0


@dataclass(frozen=True)
class Bandwidth:
    upload_mbps: float
    download_mbps: float
    source: str  # "measured", "override" or "unknown" (as in PeerRecord.bandwidth_source)


def _mbps(n_bytes: int, seconds: float) -> float:
    return n_bytes * 8 / max(seconds, 1e-6) / 1e6


async def _time_download(p2p: Any, peer: Any, size: int) -> tuple[int, float]:
    """(bytes after the first piece, seconds from the first piece to the last)."""
    stream = await p2p.iterate_protobuf_handler(peer, PROBE_DOWNLOAD, wire.ProbeRequest(size=size), wire.ProbePiece)
    first_at, last_at, counted = None, 0.0, 0
    async for piece in stream:
        now = time.perf_counter()
        if first_at is None:
            first_at = now
        else:
            counted += len(piece.data)
        last_at = now
    return counted, (last_at - first_at) if first_at is not None else 0.0


async def _time_upload(p2p: Any, peer: Any, size: int) -> tuple[int, float]:
    piece = os.urandom(PROBE_PIECE_BYTES)

    async def pieces() -> AsyncIterator[Any]:
        for start in range(0, size, PROBE_PIECE_BYTES):
            yield wire.ProbeRequest(data=piece[: min(PROBE_PIECE_BYTES, size - start)])

    reply = await p2p.call_protobuf_handler(peer, PROBE_UPLOAD, pieces(), wire.ProbeReply)
    return reply.received, reply.elapsed_s


async def _probe(p2p: Any, peer: Any, timed: Any) -> float:
    size = FIRST_PROBE_BYTES
    while True:
        counted, seconds = await timed(p2p, peer, size)
        if counted <= 0:
            raise ValueError(f"{peer} answered the probe with no data")
        if seconds >= MIN_TIMED_S or size >= MAX_PROBE_BYTES:
            return _mbps(counted, seconds)
        size = min(4 * size, MAX_PROBE_BYTES)


def measure_link(runtime: PeerRuntime, peer: Any, timeout_s: float = 120.0) -> Bandwidth:
    """Upload then download to `peer`; raises if the peer does not serve probes or the link fails."""
    upload = runtime.run(asyncio.wait_for(_probe(runtime.p2p, peer, _time_upload), timeout_s))
    download = runtime.run(asyncio.wait_for(_probe(runtime.p2p, peer, _time_download), timeout_s))
    return Bandwidth(round(upload, 2), round(download, 2), "measured")


def _cache_key(runtime: PeerRuntime, target: str) -> str:
    """Per host (name and the addresses it is reachable at: a network namespace is another host) and target."""
    addresses = sorted(a.split("/")[2] for a in runtime.visible_maddrs if a.startswith("/ip"))
    return f"{socket.gethostname()}|{','.join(addresses)}|{target}"


def node_bandwidth(
    runtime: PeerRuntime, override_mbps: float | None, cache_file: Path, remeasure: bool = False
) -> Bandwidth:
    """This node's bandwidth: the override, a fresh cached measurement, or a new one to an initial peer."""
    if override_mbps is not None:
        return Bandwidth(float(override_mbps), float(override_mbps), "override")
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    for maddr in runtime.initial_peers:
        target = Multiaddr(maddr).value_for_protocol("p2p")
        key = _cache_key(runtime, target)
        cached = cache.get(key)
        if not remeasure and isinstance(cached, dict) and time.time() - cached.get("at", 0) < CACHE_MAX_AGE_S:
            return Bandwidth(float(cached["upload_mbps"]), float(cached["download_mbps"]), "measured")
        try:
            measured = measure_link(runtime, PeerID.from_base58(target))
        except Exception as e:  # a peer that does not serve probes (stock hivemind-dht) or a broken link
            logger.info("bandwidth probe to %s failed: %r", target, e)
            continue
        cache[key] = {**asdict(measured), "at": time.time()}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_file)
        logger.info("measured %.1f Mbit/s up, %.1f down to %s", measured.upload_mbps, measured.download_mbps, target)
        return measured
    logger.warning("could not measure bandwidth (no initial peer serves probes); pass --bandwidth-mbps")
    return Bandwidth(0.0, 0.0, "unknown")


def cached_upload_mbps(cache_file: Path, initial_peers: list[str]) -> float | None:
    """This host's last fresh measurement of its upload to one of `initial_peers`: all a node knows of its link
    before it joins the DHT (the cache's keys name the addresses of a run that may have had others)."""
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return None
    targets = {peer.rsplit("/p2p/", 1)[-1] for peer in initial_peers}
    found = [
        entry
        for key, entry in (cache.items() if isinstance(cache, dict) else [])
        if key.split("|")[0] == socket.gethostname() and key.split("|")[-1] in targets and isinstance(entry, dict)
        and all(isinstance(entry.get(k), (int, float)) for k in ("upload_mbps", "at"))
        and time.time() - entry["at"] < CACHE_MAX_AGE_S
    ]  # fmt: skip
    return float(max(found, key=lambda e: e["at"])["upload_mbps"]) if found else None


def joins_as_dht_client(override_mbps: float | None, below_mbps: float, cache_file: Path, peers: list[str]) -> bool:
    """Whether a node on a slow uplink (below `below_mbps`: --bandwidth-mbps, else this host's last measurement)
    joins the DHT as a client. A DHT server answers everyone's stores and reads of the keys nearest it, and every
    member's round waits on them: on the netlab a server 150 ms away on 5 Mbit/s lengthened the others' rounds by
    0.8 s; as a client it still stores and reads (its records, statements and seals) and serves its blobs."""
    if below_mbps <= 0:
        return False
    upload = override_mbps if override_mbps is not None else cached_upload_mbps(cache_file, peers)
    return upload is not None and upload < below_mbps
