"""Network-namespace lab: nodes on a shared bridge, each with its upload and download shaped by `tc tbf`.

Layout: one hub namespace holds a bridge `br0`; every node gets its own namespace whose `eth0` is one end of a
veth pair, the other end (`n<index>`) enslaved to the bridge. Upload is shaped by a tbf on the node's `eth0`
egress, download by a tbf on the hub-side veth's egress, so a transfer from A to B is limited by
min(A.up, B.down). Every interface is created directly inside its namespace and never exists in the host's,
so interface names only have to be unique within one lab and stay far below IFNAMSIZ; the namespace names
carry the lab's tag (`hnlab<pid>-<random>`), so two labs, or one left behind by a killed process, never
collide, and `cleanup_stale` can tell an abandoned lab (its pid is gone) from a running one.

Latency (a node's `latency_ms`) comes from a delaying proxy in each node's namespace (`delay_proxy`), since this
kernel has no `netem`; it needs iptables, like the NAT'd nodes.

Measured here (kernel 6.18, iproute2 6.1, 2 cores; one Python TCP connection between two nodes, timed at the
receiver after its first MB): both ends at 50 Mbit/s, 6 MB -> 47.8 Mbit/s of payload; at 1000 Mbit/s, 100 MB
-> 956 Mbit/s. Both are the tbf rate times 1448/1514, the payload share of a full Ethernet frame, because tbf
charges a frame's full length. Up 1000 / down 20 on the receiver -> 19.5 Mbit/s; up 20 on the sender -> 19.6.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from types import FrameType
from typing import Any

import psutil

from hetero_node.bench.delay_proxy import redirect_rules

log = logging.getLogger(__name__)

LAB_PREFIX = "hnlab"
SUBNET = "10.213.0"  # a /24; labs never share it since each has its own hub, so one fixed subnet serves all
NAT_SUBNET = "10.214"  # NAT'd nodes' LANs: 10.214.<k>.0/24 behind their routers
PUBLIC_SUBNET = "192.0.2"
"""A /24 that libp2p does not count as a private LAN (TEST-NET-1, as on the machine of issue 29). p2pd's DHT finds
a peer by id alone only on a private LAN (and loopback), so a lab on `SUBNET` hides failures of a peer that must dial
the addresses it learned, as volunteers on the internet must."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
NODE_IF = "eth0"
BRIDGE = "br0"
CUT_BRIDGE = "br1"
"""Where `NetLab.partition` moves the ports of the nodes it cuts off."""
TERM_GRACE_S = 3.0

# tbf settings. tbf sends a packet only when its whole length fits in the bucket, so burst must hold at least
# one packet. veth keeps GSO on (there is no ethtool here), so TCP hands it super-packets of up to 64 KiB; tbf
# charges them per segment (headers included) and splits those larger than the bucket into frames
# (tbf_segment) instead of dropping them, so no offload needs turning off. Turning GSO off anyway
# (`ip link set DEV gso_max_segs 1`) left 50 Mbit/s unchanged but cut 1000 Mbit/s to ~290 (CPU-bound on
# 2 cores). Burst, measured at 50 Mbit/s: 1600 B -> 44.4, 4000 -> 47.5, >= 16 KB -> 47.8 (the ceiling); at
# 1000 Mbit/s: 32 KiB -> 829, 64 KiB -> 940, 500 KB (rate x 4 ms) -> 956. Hence max(32 KiB, rate x 4 ms).
# latency bounds the queue at rate x 50 ms, like a modest home-router buffer; a sender beyond it sees drops.
TBF_LATENCY_MS = 50
MIN_BURST_BYTES = 32 * 1024
BURST_SECONDS = 0.004  # rate x 4 ms: one timer tick at HZ=250, so a late dequeue does not lose tokens

DELAY_PROXY_PORT = 10999
"""Where a node's delaying proxy listens on its namespace's loopback (below the ephemeral port range)."""


def _sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a setup command, raising with its stderr (which says what is wrong) when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {' '.join(result.stderr.split())}")
    return result


@cache
def netns_unavailable_reason() -> str | None:
    """None when this process can create namespaces, veths, bridges and tbf qdiscs; otherwise a one-line reason.

    Tries the real thing in a throwaway namespace (about 50 ms, once per process), since being root does not
    guarantee it inside a container.
    """
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    probe = f"{LAB_PREFIX}{os.getpid()}-probe"
    try:
        _sh(["ip", "netns", "add", probe])
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _sh(["ip", "-n", probe, "link", "add", BRIDGE, "type", "bridge"])
        _sh(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _sh(["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", *_tbf_args(50.0)])
    except RuntimeError as e:
        return f"cannot set up a bridge, veth pair or tbf qdisc: {e}"
    finally:
        _sh(["ip", "netns", "del", probe], check=False)
    return None


@cache
def nat_unavailable_reason() -> str | None:
    """None when NAT'd lab nodes can be made (namespaces and iptables), else a one-line reason."""
    reason = netns_unavailable_reason()
    if reason is None and shutil.which("iptables") is None:
        return "`iptables` not found (Debian: apt-get install iptables)"
    return reason


def _tbf_args(mbit: float) -> list[str]:
    rate_bytes = mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_SECONDS))
    return ["tbf", "rate", f"{mbit * 1e6:.0f}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


@dataclass(frozen=True)
class LabNode:
    """One node of a NetLab: where its processes run and how its link is shaped."""

    name: str  # logical name given by the caller
    namespace: str
    address: str  # IPv4 in the lab's /24
    veth: str  # the node's interface, inside its namespace
    up_mbit: float
    down_mbit: float
    hub_port: str = ""
    """Its veth's end on the hub's bridge ("" for a node behind a NAT router: its router has one)."""
    latency_ms: float = 0.0
    """One-way latency of its access link: a connection to another node is delayed by the sum of theirs, each way
    (`start_delays`)."""


class NetLab:
    """A hub namespace with a bridge plus one namespace per node; use as a context manager.

    Everything it creates is torn down by close(): on leaving the `with` block, at interpreter exit, and on
    SIGINT/SIGTERM while the lab is open (the lab closes, then the previous handler runs, so Ctrl-C still
    raises KeyboardInterrupt and SIGTERM still ends the process).
    """

    def __init__(self, tag: str | None = None, subnet: str = SUBNET) -> None:
        """`subnet`: the /24 (first three octets) the nodes on the bridge get their addresses from."""
        self.tag = tag or f"{LAB_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        if not NAME.match(self.tag):
            raise ValueError(f"lab tag {self.tag!r} must match {NAME.pattern}")
        self.hub = f"{self.tag}-hub"
        self.subnet = subnet
        self._owner_pid = os.getpid()
        self.nodes: dict[str, LabNode] = {}
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen] = []
        self._cut: set[str] = set()
        self._previous_handlers: dict[int, Any] = {}
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._add_namespace(self.hub)
            _sh(["ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge"])
            _sh(["ip", "-n", self.hub, "link", "set", BRIDGE, "up"])
        except BaseException:
            self.close()
            raise
        log.info("lab %s: hub namespace %s", self.tag, self.hub)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, namespace: str) -> None:
        _sh(["ip", "netns", "add", namespace])
        self._namespaces.append(namespace)
        _sh(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def add_node(self, name: str, up_mbit: float, down_mbit: float | None = None, latency_ms: float = 0.0) -> LabNode:
        """A new namespace on the bridge, its upload shaped to `up_mbit` and download to `down_mbit` (default:
        the same); `latency_ms` takes effect once `start_delays` runs."""
        down_mbit = up_mbit if down_mbit is None else down_mbit
        if not NAME.match(name) or name == "hub":
            raise ValueError(f"node name {name!r} must match {NAME.pattern} and not be 'hub'")
        if name in self.nodes:
            raise ValueError(f"lab {self.tag} already has a node {name!r}")
        if up_mbit <= 0 or down_mbit <= 0:
            raise ValueError(f"rates must be positive, got up={up_mbit} down={down_mbit}")
        if latency_ms < 0:
            raise ValueError(f"latency must not be negative, got {latency_ms} ms")
        index = len(self.nodes)
        if index >= 253:
            raise ValueError("a lab holds at most 253 nodes (one /24)")
        address = f"{self.subnet}.{index + 1}"
        hub_if = f"n{index}"
        node = LabNode(name, f"{self.tag}-{name}", address, NODE_IF, up_mbit, down_mbit, hub_if, latency_ms)
        self._add_namespace(node.namespace)
        _sh(["ip", "-n", self.hub, "link", "add", hub_if, "type", "veth", "peer", "name", NODE_IF,
             "netns", node.namespace])  # fmt: skip
        _sh(["ip", "-n", self.hub, "link", "set", hub_if, "master", BRIDGE, "up"])
        _sh(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", NODE_IF])
        _sh(["ip", "-n", node.namespace, "link", "set", NODE_IF, "up"])
        _sh(["tc", "-n", node.namespace, "qdisc", "replace", "dev", NODE_IF, "root", *_tbf_args(up_mbit)])
        _sh(["tc", "-n", self.hub, "qdisc", "replace", "dev", hub_if, "root", *_tbf_args(down_mbit)])
        self.nodes[name] = node
        log.info("lab %s: node %s at %s, up %g / down %g Mbit/s", self.tag, name, node.address, up_mbit, down_mbit)
        return node

    def add_nat_node(self, name: str, up_mbit: float, down_mbit: float | None = None) -> LabNode:
        """A node behind a home router: the router (`<name>-nat`) is an ordinary node on the bridge whose link is
        shaped to the given rates; the node sits on a LAN behind it (10.214.<k>.0/24) and reaches the lab only
        through the router's source NAT (iptables MASQUERADE), with no inbound mapping, so nobody can dial it.
        Needs iptables (`nat_unavailable_reason`)."""
        router = self.add_node(f"{name}-nat", up_mbit, down_mbit)
        lan = f"{NAT_SUBNET}.{sum(n.name.endswith('-nat') for n in self.nodes.values())}"
        node = LabNode(name, f"{self.tag}-{name}", f"{lan}.2", NODE_IF, router.up_mbit, router.down_mbit)
        self._add_namespace(node.namespace)
        _sh(["ip", "-n", router.namespace, "link", "add", "lan0", "type", "veth", "peer", "name", NODE_IF,
             "netns", node.namespace])  # fmt: skip
        _sh(["ip", "-n", router.namespace, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
        _sh(["ip", "-n", router.namespace, "link", "set", "lan0", "up"])
        _sh(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", NODE_IF])
        _sh(["ip", "-n", node.namespace, "link", "set", NODE_IF, "up"])
        _sh(["ip", "-n", node.namespace, "route", "add", "default", "via", f"{lan}.1"])
        _sh(["ip", "netns", "exec", router.namespace, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _sh(["ip", "netns", "exec", router.namespace, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", NODE_IF,
             "-j", "MASQUERADE"])  # fmt: skip
        self.nodes[name] = node
        log.info("lab %s: node %s at %s behind NAT router %s", self.tag, name, node.address, router.address)
        return node

    def partition(self, names: Iterable[str]) -> None:
        """Cut the nodes `names` off from the others: their ports move to a bridge of their own, so they reach each
        other and nobody else, and open connections see packets vanish as on a broken link (`rejoin` undoes it)."""
        if not self._cut:
            _sh(["ip", "-n", self.hub, "link", "add", CUT_BRIDGE, "type", "bridge"], check=False)
            _sh(["ip", "-n", self.hub, "link", "set", CUT_BRIDGE, "up"])
        for name in names:
            port = self.nodes[name].hub_port
            if not port:
                raise ValueError(f"node {name!r} sits behind a NAT router: cut the router off instead")
            _sh(["ip", "-n", self.hub, "link", "set", port, "master", CUT_BRIDGE])
            self._cut.add(name)
        log.info("lab %s: %s cut off from the others", self.tag, ", ".join(sorted(self._cut)))

    def rejoin(self) -> None:
        """Undo `partition`: every node is on the one bridge again."""
        for name in sorted(self._cut):
            _sh(["ip", "-n", self.hub, "link", "set", self.nodes[name].hub_port, "master", BRIDGE])
        log.info("lab %s: %s joined again", self.tag, ", ".join(sorted(self._cut)))
        self._cut.clear()

    def start_delays(self) -> None:
        """Give every connection between lab nodes its latency: a delaying proxy in each node's namespace takes
        the TCP connections the node opens (`delay_proxy`). Call it after adding the nodes and before starting
        their processes; it does nothing when no node has a latency. Nodes behind NAT add none of their own."""
        if not any(n.latency_ms > 0 for n in self.nodes.values()):
            return
        reason = nat_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"lab {self.tag}: latency needs iptables for its delaying proxies: {reason}")
        for node in self.nodes.values():
            delays = {o.address: node.latency_ms + o.latency_ms for o in self.nodes.values() if o is not node}
            proxy = self.popen(node, [sys.executable, "-m", "hetero_node.bench.delay_proxy", "--port",
                                      str(DELAY_PROXY_PORT), "--delays", json.dumps(delays),
                                      "--default-ms", str(node.latency_ms)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
            if proxy.stdout is None or proxy.stdout.readline().strip() != "ready":
                raise RuntimeError(f"lab {self.tag}: the delay proxy of {node.name} did not start")
            for rule in redirect_rules(f"{self.subnet}.0/24", node.address, DELAY_PROXY_PORT):
                _sh(["ip", "netns", "exec", node.namespace, "iptables", *rule])
        log.info("lab %s: latencies %s", self.tag, {n.name: n.latency_ms for n in self.nodes.values()})

    def popen(self, node: LabNode, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside the node's namespace in a session of its own, so close() can kill it with all
        of its children."""
        process = subprocess.Popen(["ip", "netns", "exec", node.namespace, *argv], start_new_session=True, **kwargs)
        self._processes = [p for p in self._processes if p.returncode is None]  # forget the reaped ones
        self._processes.append(process)
        return process

    def run(
        self,
        node: LabNode,
        argv: list[str],
        check: bool = True,
        timeout: float | None = None,
        input: str | bytes | None = None,
        capture_output: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """subprocess.run inside the node's namespace; the process group is killed if the wait is cut short
        (timeout, Ctrl-C)."""
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        if capture_output:
            kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
        process = self.popen(node, argv, **kwargs)
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except BaseException:
            _stop([process])
            raise
        if check and process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, stdout, stderr)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def counters(self, node: LabNode) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of the node's interface: what really crossed its link, retransmissions and
        headers included. A GSO super-packet counts its headers once, so a bulk TCP transfer reads 0-5% above
        its payload where the wire (and tbf) saw 4.6% more."""
        stats = f"/sys/class/net/{node.veth}/statistics"
        out = _sh(["ip", "netns", "exec", node.namespace, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).stdout
        tx, rx = (int(line) for line in out.split())
        return tx, rx

    def close(self) -> None:
        """Kill every process started in the lab and delete its namespaces (which takes their interfaces with
        them). Idempotent, and safe to re-enter from a signal handler: each item is removed as it is handled.
        A forked child (which inherits the atexit hook and signal handlers) leaves its parent's lab alone."""
        if os.getpid() != self._owner_pid:
            return
        _stop(self._processes)
        self._processes.clear()
        while self._namespaces:
            _delete_namespace(self._namespaces.pop())
        self.nodes.clear()
        self._restore_signal_handlers()
        atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        with contextlib.suppress(ValueError):  # not the main thread: no handlers, the with/atexit paths remain
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) != signal.SIG_IGN:  # an ignored signal must not tear the lab down
                    previous = signal.signal(sig, self._on_signal)
                    self._previous_handlers[sig] = signal.SIG_DFL if previous is None else previous

    def _restore_signal_handlers(self) -> None:
        """Put back what was there, unless someone (another lab) installed a handler since: that one still
        chains to ours, which only forwards once the lab is closed."""
        for sig, previous in list(self._previous_handlers.items()):
            with contextlib.suppress(ValueError):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
                    del self._previous_handlers[sig]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.warning("lab %s: %s received, tearing the lab down", self.tag, signal.Signals(signum).name)
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        self.close()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end the process the way the signal would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each live process's group, give them TERM_GRACE_S together, then SIGKILL the groups left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in processes if p.poll() is None]  # an unreaped child keeps its pid: no reuse race
        for process in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + TERM_GRACE_S
        for process in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))


def _list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(namespace: str) -> None:
    """SIGKILL whatever still runs inside (children that left their process group), then delete the name; the
    namespace and its interfaces go once nothing references it."""
    for pid in _sh(["ip", "netns", "pids", namespace], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    result = _sh(["ip", "netns", "del", namespace], check=False)
    if result.returncode != 0 and namespace in _list_namespaces():
        log.warning("could not delete namespace %s: %s", namespace, result.stderr.strip())


def cleanup_stale(prefix: str = LAB_PREFIX) -> list[str]:
    """Delete namespaces starting with `prefix` whose lab process is gone (a killed run); returns their names.

    A name built from the default tag carries its creator's pid, and a lab whose creator still runs is left
    alone, so this is safe to call while other labs are open.
    """
    owner = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    for namespace in _list_namespaces():
        if not namespace.startswith(prefix):
            continue
        match = owner.match(namespace)
        if match and psutil.pid_exists(int(match.group(1))):
            continue
        _delete_namespace(namespace)
        removed.append(namespace)
    if removed:
        log.info("removed stale lab namespaces: %s", ", ".join(removed))
    return removed
