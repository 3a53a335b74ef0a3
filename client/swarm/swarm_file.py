"""A swarm description for `hetero-node plan`: kinds of nodes with their speed, memory and links.

    rtt_ms = 40                  # optional: a node's round trip to the bootstrap, for nodes that give none (default
                                 # 0); with every node at one figure, the round trip between any two of them
    matchmaking_s = 1.0          # optional: fixed cost of forming a round's group (default 1 s)
    [[node]]
    name = "dc"                  # unique; with count = N the nodes are dc-0 … dc-(N-1)
    count = 4                    # optional, default 1
    tokens_per_s = 20000         # full-model training throughput (what `join` measures and advertises), or
    tflops = 150                 # effective training TFLOP/s instead: tokens/s = tflops × 10¹² / (6 × parameters)
    memory_gb = 80
    gpus = 8                     # optional, default 1: a server training one replica on all its GPUs
                                 # (`join --devices all`); speed and memory_gb are per GPU, the node is one replica
    up_mbit = 10000
    down_mbit = 10000            # optional, default up_mbit
    relayed = false              # optional: reachable only through a relay
    rtt_ms = 80                  # optional: this kind's round trip to the bootstrap, as `join` measures it; two
                                 # nodes are rtt_a + rtt_b − the smallest node's apart (`cost_model.Latency`)

Unknown keys are errors (a misspelt key would silently plan the wrong swarm).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from hetero_node.client.swarm.cost_model import LinkModel
from hetero_node.client.swarm.planner import PeerInfo
from hetero_node.protocol.errors import ConfigError

NODE_KEYS = {
    "name", "count", "gpus", "tokens_per_s", "tflops", "memory_gb", "up_mbit", "down_mbit", "relayed", "rtt_ms",
}  # fmt: skip
TOP_KEYS = {"rtt_ms", "matchmaking_s", "node"}


def load_swarm(path: Path, parameters: int) -> tuple[list[PeerInfo], LinkModel]:
    """The nodes (expanded by count) and link settings of a swarm file; `parameters` converts TFLOP/s to tokens/s."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the swarm file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not TOML ({e})") from None
    return parse_swarm(data, parameters, str(path))


def _check_keys(table: dict[str, Any], known: set[str], where: str) -> None:
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")


def parse_swarm(data: dict[str, Any], parameters: int, where: str = "swarm") -> tuple[list[PeerInfo], LinkModel]:
    _check_keys(data, TOP_KEYS, where)
    kinds = data.get("node")
    if not isinstance(kinds, list) or not kinds:
        raise ConfigError(f"{where}: no [[node]] entries")
    peers: list[PeerInfo] = []
    for i, kind in enumerate(kinds):
        peers += _node_kind(kind, parameters, f"{where}: node {i + 1}")
    names = [p.peer_id for p in peers]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: node names must be unique (after count expansion)")
    try:
        links = LinkModel(rtt_ms=_number(data, "rtt_ms", 0.0, where), matchmaking_s=_number(data, "matchmaking_s",
                          1.0, where))  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return peers, links


def _node_kind(kind: Any, parameters: int, where: str) -> list[PeerInfo]:
    if not isinstance(kind, dict):
        raise ConfigError(f"{where}: not a table")
    _check_keys(kind, NODE_KEYS, where)
    name = kind.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: `name` must be a non-empty string")
    if ("tokens_per_s" in kind) == ("tflops" in kind):
        raise ConfigError(f"{where} ({name}): give exactly one of tokens_per_s and tflops")
    count, gpus = kind.get("count", 1), kind.get("gpus", 1)
    for key, value in (("count", count), ("gpus", gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where} ({name}): {key} must be an integer ≥ 1")
    if "tflops" in kind:
        tokens_per_s = _number(kind, "tflops", None, where) * 1e12 / (6 * parameters)
    else:
        tokens_per_s = _number(kind, "tokens_per_s", None, where)
    up = _number(kind, "up_mbit", None, where)
    down = _number(kind, "down_mbit", up, where)
    memory = _number(kind, "memory_gb", None, where) * 1e9
    tokens_per_s *= gpus  # data parallel inside the node; each GPU holds the whole model, so memory stays per GPU
    if min(tokens_per_s, up, down, memory) <= 0:
        raise ConfigError(f"{where} ({name}): speed, links and memory must be > 0")
    relayed = kind.get("relayed", False)
    if not isinstance(relayed, bool):
        raise ConfigError(f"{where} ({name}): relayed must be true or false")
    rtt_ms = _number(kind, "rtt_ms", 0.0, where)
    names = [name] if count == 1 else [f"{name}-{i}" for i in range(count)]
    return [PeerInfo(n, int(memory), up, down, tokens_per_s, relayed=relayed, rtt_ms=rtt_ms) for n in names]


def _number(table: dict[str, Any], key: str, default: float | None, where: str) -> float:
    value = table.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: `{key}` is required")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: `{key}` must be a finite number ≥ 0, got {value!r}")
    return float(value)
