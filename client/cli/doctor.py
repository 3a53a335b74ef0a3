"""`hetero-node doctor`: why a node cannot join, or cannot be reached, in one table.

Each check says what it found and, when it fails, what to do. The checks follow what `join` does: the p2p daemon
starts, the join line parses, the bootstrap answers and announces a run, the bootstrap can dial this node back,
and the addresses this node would announce are ones others can use.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hetero_node.protocol.errors import ConfigError, HeteroNodeError


@dataclass
class Check:
    name: str
    ok: bool | None  # None: could not tell
    found: str
    advice: str = ""


def _p2pd_check() -> Check:
    import hivemind

    p2pd = Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"
    if p2pd.is_file() and p2pd.stat().st_mode & 0o111:
        return Check("p2p daemon", True, str(p2pd))
    return Check(
        "p2p daemon", False, f"{p2pd} is missing or not executable",
        "reinstall hivemind from its wheel, which bundles p2pd: pip install --force-reinstall hivemind==1.1.12",
    )  # fmt: skip


def _private(addr: str) -> bool:
    parts = addr.split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and not ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return False


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def diagnose(peers: list[str], host: str, port: int) -> list[Check]:
    """Run the checks in order; a failure that makes the later ones meaningless ends the list."""
    from hetero_node.client.node.run_definition import fetch_run_announcement
    from hetero_node.client.swarm.addresses import parse_peer_multiaddrs
    from hetero_node.client.swarm.reachability import check_reachability
    from hetero_node.client.swarm.runtime import PeerRuntime

    checks = [_p2pd_check()]
    if checks[0].ok is False:
        return checks
    try:
        addresses = parse_peer_multiaddrs([p for arg in peers for p in arg.replace(",", " ").split()])
    except HeteroNodeError as e:
        return [*checks, Check("join line", False, str(e), "copy the whole line `hetero-node bootstrap` printed")]
    checks.append(Check("join line", True, ", ".join(addresses)))
    try:
        runtime = PeerRuntime(addresses, host, port)
    except HeteroNodeError as e:
        return [*checks, Check(
            "bootstrap reachable", False, str(e)[:300],
            "check that the bootstrap runs and that this machine may open outgoing TCP connections to its port "
            "(a firewall, a VPN or a typo in the address are the usual causes)",
        )]  # fmt: skip
    try:
        checks.append(Check("bootstrap reachable", True, f"connected; this node is {runtime.peer_id}"))
        try:
            announcement = fetch_run_announcement(runtime, timeout_s=10.0)
        except ConfigError as e:  # a private swarm's (sealed: doctor has no key), another release's: say so, go on
            checks.append(Check("run announced", None, str(e)[:300], "join with what it asks for"))
        else:
            checks.append(
                Check("run announced", True, f"run {announcement.run_id} ({announcement.config['preset']})")
                if announcement is not None
                else Check("run announced", None, "the peer announces no run",
                           "a plain hivemind-dht bootstrap: pass the run's options to join yourself")
            )  # fmt: skip
        checks.append(_reachability_check(check_reachability(runtime), host))
        announced = runtime.visible_maddrs
        public_swarm = any(not _private(a) for a in addresses)
        only_private = all(_private(a) for a in announced)
        checks.append(Check(
            "announced addresses", not (public_swarm and only_private), ", ".join(announced),
            "" if not (public_swarm and only_private) else
            "only private addresses: peers on the internet cannot use them; join relays through the bootstrap "
            "when the dial-back fails, or forward a port and give --host 0.0.0.0 --port P",
        ))  # fmt: skip
    finally:
        runtime.shutdown()
    return checks


def _reachability_check(result: Any, host: str) -> Check:
    ports = ", ".join(map(str, result.ports))
    if result.reachable is False and _loopback(host):
        return Check(
            "reachable from outside", False,
            f"this node listens on {host}, which only programs on this machine can reach",
            "leave --host out (join listens on every interface, 0.0.0.0, by default) or give the address of an "
            "interface other peers can reach",
        )  # fmt: skip
    if result.reachable:
        return Check("reachable from outside", True, f"the bootstrap connected to {', '.join(result.accepted)}")
    if result.reachable is None:
        return Check("reachable from outside", None, "no peer answered the dial-back check",
                     "the bootstrap may run an older hetero-node; join assumes this node is reachable")  # fmt: skip
    seen = ", ".join(result.observed) or "?"
    return Check(
        "reachable from outside", False,
        f"peers see this node at {seen} but cannot connect to port {ports} (behind NAT or a firewall)",
        "nothing to do: join detects this and trains through a relay on the bootstrap (--reachability auto). "
        f"For direct connections (faster), forward TCP port {ports} on your router to this machine, or open it "
        "in the firewall, and give join --host 0.0.0.0 --port with that port",
    )  # fmt: skip


def render(checks: list[Check]) -> str:
    """One line per check (result, name, what was found), and what to do under any that did not pass."""
    lines = []
    for c in checks:
        lines.append(f"{ {True: 'ok', False: 'FAILED', None: 'unknown'}[c.ok]:<8}{c.name}: {c.found}")
        if c.advice:
            lines.append(f"{'':<8}what to do: {c.advice}")
    return "\n".join(lines)


def run_doctor(peers: list[str], host: str, port: int, console: Console) -> bool:
    """Print the checks; True when none failed."""
    checks = diagnose(peers, host, port)
    console.print(render(checks), markup=False, highlight=False, soft_wrap=True)
    return all(c.ok is not False for c in checks)
