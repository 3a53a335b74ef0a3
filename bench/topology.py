"""Lab topologies: which nodes a benchmark starts, the link each one gets, and the role it asks for.

A topology is a small TOML file (bundled ones live in `bench/topologies/`):

    name = "hetero"                      # optional; default: the file's stem
    [bootstrap]                          # optional; default: 1000 Mbit/s both ways
    up_mbit = 1000
    down_mbit = 1000
    [[node]]
    name = "dc0"                         # a namespace-safe name, unique in the file
    role = "auto"                        # full, stage or auto (what `hetero-node join --role` gets)
    up_mbit = 1000
    down_mbit = 1000                     # optional; default: up_mbit
    cpus = [0]                           # optional; pin the node's processes to these cores
    memory_gb = 0.3                      # optional; the memory the node advertises to the planner (--memory-gb)
    cpu_quota = 0.3                      # optional; a CPU cgroup caps the node at this many cores (a slow machine)
    latency_ms = 40                      # optional; one-way latency of its access link (default 0; the bootstrap
                                         # takes one too): a round trip between two nodes is 2 × the sum of theirs

Unknown keys are errors, not ignored typos: a misspelt `down_mibt` would silently give a node the wrong link.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero_node.bench.netns import NAME
from hetero_node.protocol.errors import ConfigError

ROLES = ("full", "stage", "auto")
BUNDLED_DIR = Path(__file__).parent / "topologies"
RESERVED_NAMES = ("hub", "bootstrap")
"""`hub` is the lab's bridge namespace and `bootstrap` the run's bootstrap node."""
DEFAULT_BOOTSTRAP_MBIT = 1000.0


class TopologyError(ConfigError):
    """A topology file is missing, not TOML, or describes an impossible lab (the message names file and key)."""


@dataclass(frozen=True)
class NodeSpec:
    """One node of a topology."""

    name: str
    role: str
    up_mbit: float
    down_mbit: float
    cpus: tuple[int, ...] | None = None
    memory_gb: float | None = None
    """What the node tells the planner it has (`--memory-gb`); None: what the machine has."""
    cpu_quota: float | None = None
    """Cores the node's processes may use together (a CPU cgroup); None: no cap."""
    latency_ms: float = 0.0
    """One-way latency of its access link (`NetLab.start_delays`)."""

    @property
    def link_mbit(self) -> float:
        """What the node can sustain both ways (what it advertises when the benchmark skips the probe)."""
        return min(self.up_mbit, self.down_mbit)


@dataclass(frozen=True)
class Topology:
    name: str
    nodes: tuple[NodeSpec, ...]
    bootstrap_up_mbit: float = DEFAULT_BOOTSTRAP_MBIT
    bootstrap_down_mbit: float = DEFAULT_BOOTSTRAP_MBIT
    bootstrap_latency_ms: float = 0.0

    @property
    def edge_nodes(self) -> tuple[str, ...]:
        """Nodes whose link is slower than the fastest node's: the ones whose share of the work the report
        tracks. Empty when every link is alike (edge-only, uniform)."""
        fastest = max(n.link_mbit for n in self.nodes)
        return tuple(n.name for n in self.nodes if n.link_mbit < fastest)


def bundled_topologies() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.toml"))


def resolve_topology_path(path: Path) -> Path:
    """A file path as given, or the name of a bundled topology (`hetero` -> bench/topologies/hetero.toml)."""
    if path.is_file():
        return path
    bundled = BUNDLED_DIR / f"{path.name}.toml"
    if path.suffix == "" and path.parent == Path(".") and bundled.is_file():
        return bundled
    raise TopologyError(f"topology {path}: no such file, nor a bundled topology ({', '.join(bundled_topologies())})")


def load_topology(path: Path) -> Topology:
    """Read and check a topology file (or a bundled topology's name)."""
    path = resolve_topology_path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"topology {path}: {e}") from None
    return parse_topology(text, path.stem, str(path))


def parse_topology(text: str, default_name: str, source: str) -> Topology:
    """Check every key of a topology's TOML text; `source` names it in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"topology {source}: not valid TOML ({e})") from None
    _only_keys(data, {"name", "bootstrap", "node"}, source, "the top level")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise TopologyError(f"topology {source}: `name` must be a non-empty string")
    bootstrap = data.get("bootstrap", {})
    if not isinstance(bootstrap, dict):
        raise TopologyError(f"topology {source}: [bootstrap] must be a table")
    _only_keys(bootstrap, {"up_mbit", "down_mbit", "latency_ms"}, source, "[bootstrap]")
    boot_up = _rate(bootstrap.get("up_mbit", DEFAULT_BOOTSTRAP_MBIT), source, "[bootstrap] up_mbit")
    boot_down = _rate(bootstrap.get("down_mbit", boot_up), source, "[bootstrap] down_mbit")
    boot_latency = _latency(bootstrap.get("latency_ms", 0.0), source, "[bootstrap] latency_ms")
    raw_nodes = data.get("node")
    if not isinstance(raw_nodes, list) or len(raw_nodes) < 2:
        raise TopologyError(f"topology {source}: needs at least two [[node]] tables")
    nodes = tuple(_node(raw, i, source) for i, raw in enumerate(raw_nodes))
    names = [n.name for n in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TopologyError(f"topology {source}: node names must be unique, repeated: {', '.join(duplicates)}")
    return Topology(name, nodes, boot_up, boot_down, boot_latency)


def _node(raw: Any, index: int, source: str) -> NodeSpec:
    if not isinstance(raw, dict):
        raise TopologyError(f"topology {source}: [[node]] #{index + 1} must be a table")
    where = f"node {raw['name']!r}" if isinstance(raw.get("name"), str) else f"[[node]] #{index + 1}"
    keys = {"name", "role", "up_mbit", "down_mbit", "cpus", "memory_gb", "cpu_quota", "latency_ms"}
    _only_keys(raw, keys, source, where)
    for key in ("name", "role", "up_mbit"):
        if key not in raw:
            raise TopologyError(f"topology {source}: {where} lacks `{key}`")
    name = raw["name"]
    if not isinstance(name, str) or not NAME.match(name) or name in RESERVED_NAMES:
        raise TopologyError(
            f"topology {source}: [[node]] #{index + 1} name {name!r} must match {NAME.pattern} and not be one of "
            f"{', '.join(RESERVED_NAMES)}"
        )
    if raw["role"] not in ROLES:
        raise TopologyError(f"topology {source}: {where} role {raw['role']!r} is not one of {', '.join(ROLES)}")
    up = _rate(raw["up_mbit"], source, f"{where} up_mbit")
    down = _rate(raw.get("down_mbit", up), source, f"{where} down_mbit")
    cpus = raw.get("cpus")
    if cpus is not None:
        n_cpus = os.cpu_count() or 1
        if not isinstance(cpus, list) or not cpus or any(type(c) is not int or not 0 <= c < n_cpus for c in cpus):
            raise TopologyError(
                f"topology {source}: {where} cpus must be a non-empty list of core numbers in 0..{n_cpus - 1} "
                f"(this machine has {n_cpus}), got {cpus!r}"
            )
        cpus = tuple(sorted(set(cpus)))
    memory = raw.get("memory_gb")
    if memory is not None:
        memory = _positive(memory, source, f"{where} memory_gb", "GB")
    quota = raw.get("cpu_quota")
    if quota is not None:
        quota = _positive(quota, source, f"{where} cpu_quota", "cores")
    latency = _latency(raw.get("latency_ms", 0.0), source, f"{where} latency_ms")
    return NodeSpec(name, raw["role"], up, down, cpus, memory, quota, latency)


def _rate(value: Any, source: str, where: str) -> float:
    return _positive(value, source, where, "Mbit/s")


def _latency(value: Any, source: str, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= 10_000:
        raise TopologyError(f"topology {source}: {where} must be 0 to 10000 ms, got {value!r}")
    return float(value)


def _positive(value: Any, source: str, where: str, unit: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise TopologyError(f"topology {source}: {where} must be a positive number of {unit}, got {value!r}")
    return float(value)


def _only_keys(table: dict[str, Any], allowed: set[str], source: str, where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise TopologyError(
            f"topology {source}: unknown keys in {where}: {', '.join(unknown)} (expected {', '.join(sorted(allowed))})"
        )
