"""A swarm on a real network, not loopback: every peer in a network namespace of its own with its own address on a
shared bridge (bench/netns.py), so a peer reaches another only through the addresses it learned, as volunteers on
the internet do. Needs root and network namespaces (`sudo make test`); skipped otherwise."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from swarm_helpers import join_args, rounds_of, run_args, wait_for_round

from hetero_node.bench.lab_swarm import LabSwarm
from hetero_node.bench.netns import PUBLIC_SUBNET, netns_unavailable_reason

UNAVAILABLE = netns_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}"),
    pytest.mark.multipeer,
    pytest.mark.timeout(180),
]

LINK_MBIT = 1000.0
JOIN_AFTER_ROUNDS = 2
"""The late joiner starts once the first replica has completed this many rounds."""
MAX_ROUNDS_TO_CONTRIBUTE = 2
"""Rounds from the late joiner's first round (loading the swarm's state, or the first it takes part in after
rebuilding the earlier ones from their messages) to its first contribution."""
WAIT_S = 100.0


def first_contribution(workdir: Path, index: int) -> tuple[int, int] | None:
    """(the replica's first round, its first round whose aggregate holds its message), once it has both. Rounds it
    rebuilt from their messages on joining are not its first: a joiner that starts fast records the swarm's early
    rounds that way, all at once, before taking part in any."""
    rounds = rounds_of(workdir, index)
    contributed = [t for t, r in rounds.items() if r["contributed"]]
    live = [t for t, r in rounds.items() if r["caught_up"] != "messages"]
    return (min(live), min(contributed)) if contributed and live else None


def test_a_late_joiner_loads_state_over_the_network_and_contributes_without_stalling_the_swarm(
    tmp_path: Path,
) -> None:
    """The late joiner has never been connected to the first replica: it must dial the addresses the replica's
    signed record carries to fetch its state, not ask the daemon to route to a bare peer id. Both join with the
    line the bootstrap printed and no --host, as a volunteer pastes it; the first replica runs without --quiet,
    its output to a file, so it logs a plain line per round and one when it leaves."""
    with LabSwarm(tmp_path, LINK_MBIT, subnet=PUBLIC_SUBNET) as swarm:
        peers = swarm.start_bootstrap(run_args(200, inner_steps=4, round_s=2))
        swarm.start("r0", join_args(peers, 0, tmp_path, quiet=False, min_peers=1))
        wait_for_round(tmp_path, 0, JOIN_AFTER_ROUNDS - 1, timeout=90)
        swarm.start("r1", join_args(peers, 1, tmp_path, min_peers=1))
        joined_at = max(rounds_of(tmp_path, 0))
        deadline = time.monotonic() + WAIT_S
        while (late := first_contribution(tmp_path, 1)) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert late is not None, f"the late joiner never contributed:\n{swarm.log_path('r1').read_text()[-3000:]}"
        wait_for_round(tmp_path, 0, late[1] + 1, timeout=30)  # the first replica goes on past it
    first, contributed = late
    print(
        f"late joiner: first round {first}, first contribution in round {contributed} ({contributed - first} rounds "
        f"later; the first replica was past round {joined_at} when it started)"
    )
    assert contributed - first <= MAX_ROUNDS_TO_CONTRIBUTE, rounds_of(tmp_path, 1)
    early = rounds_of(tmp_path, 0)
    after = [t for t in early if t > joined_at]
    assert after == list(range(joined_at + 1, max(early) + 1)), f"the first replica skipped rounds: {sorted(early)}"
    stalled = [t for t in after if early[t]["caught_up"] == "void"]
    assert not stalled, f"nobody completed rounds {stalled}: the swarm stalled on the late joiner"
    assert early[contributed]["contributors"] == 2, early[contributed]
    assert early[contributed]["fingerprints"] == rounds_of(tmp_path, 1)[contributed]["fingerprints"]
    for name in ("r0", "r1"):
        assert "reachable from outside at" in swarm.log_path(name).read_text(), f"{name} was not reachable"
    log = swarm.log_path("r0").read_text()
    logged = [int(t) for t in re.findall(r"hetero_node\.rounds: round (\d+): \d+ steps, loss ", log)]
    assert logged == sorted(early), f"round lines {logged} for rounds {sorted(early)}"
    assert f"left the swarm after {len(early)} rounds" in log, log[-2000:]


# long: test_nat.py checks doctor on a reachable node over the same namespaced network; this one adds join's default
# host and the loopback-bind explanation
@pytest.mark.long
def test_doctor_checks_with_joins_default_host_and_names_a_loopback_bind(tmp_path: Path) -> None:
    """Without --host, doctor listens where join does (every interface) and is reachable; told to listen on
    127.0.0.1 it says that the loopback bind, not NAT, keeps peers out."""
    with LabSwarm(tmp_path, LINK_MBIT, subnet=PUBLIC_SUBNET) as swarm:
        peers = swarm.start_bootstrap(run_args(1))
        doctor = [sys.executable, "-m", "hetero_node.client.cli", "doctor", "--peers", peers]
        node = swarm.lab.add_node("volunteer", LINK_MBIT)
        ok = swarm.lab.run(node, doctor, capture_output=True, text=True, check=False, timeout=60)
        loopback = swarm.lab.run(
            node, [*doctor, "--host", "127.0.0.1"], capture_output=True, text=True, check=False, timeout=60
        )
    assert ok.returncode == 0 and "ok      reachable from outside" in ok.stdout, ok.stdout + ok.stderr
    assert loopback.returncode == 1, loopback.stdout + loopback.stderr
    assert "listens on 127.0.0.1, which only programs on this machine can reach" in loopback.stdout, loopback.stdout
    assert "behind NAT" not in loopback.stdout


def test_a_peer_restarted_on_a_new_address_is_found_again(tmp_path: Path) -> None:
    """r1 leaves and comes back with the same identity (its checkpoint directory) from another machine, i.e. another
    namespace and address: r0 has only ever dialed the old address, so it must re-learn the new one from r1's
    signed record to fetch its messages, and the two must average together again."""
    with LabSwarm(tmp_path, LINK_MBIT, subnet=PUBLIC_SUBNET) as swarm:
        peers = swarm.start_bootstrap(run_args(200, inner_steps=4, round_s=2))
        for i in range(2):
            swarm.start(f"r{i}", join_args(peers, i, tmp_path, min_peers=2))
        wait_for_round(tmp_path, 1, 1, timeout=90)
        old = swarm.lab.nodes["r1"].address
        assert swarm.stop("r1", timeout=30) == 0
        left_at = max(rounds_of(tmp_path, 1))
        swarm.start("r1-moved", join_args(peers, 1, tmp_path))  # same --checkpoint-dir: same identity and metrics
        new = swarm.lab.nodes["r1-moved"].address
        deadline = time.monotonic() + WAIT_S
        back: list[int] = []
        while not back and time.monotonic() < deadline:
            early = rounds_of(tmp_path, 0)
            back = [t for t, r in rounds_of(tmp_path, 1).items() if t > left_at and r["contributed"]]
            back = [t for t in back if t in early and early[t]["contributors"] == 2]
            time.sleep(0.5)
        log = swarm.log_path("r1-moved").read_text()
        both = {name: _round_lines(swarm.log_path(name).read_text()) for name in ("r0", "r1-moved")}
    assert old != new
    assert back, f"r1 never averaged with r0 again from {new}:\n" + "\n".join(f"{n}:\n{t}" for n, t in both.items())
    assert rounds_of(tmp_path, 0)[back[0]]["fingerprints"] == rounds_of(tmp_path, 1)[back[0]]["fingerprints"]
    assert "resumed from checkpoint" in log, "the moved node is the same peer, resuming its own state"
    assert "speed as this node's last rounds measured it" in log, "the restart probed its speed again"


def _round_lines(log: str, keep: int = 40) -> str:
    """The last rounds of a peer's log as the failure message shows them: its round lines and warnings."""
    lines = [line for line in log.splitlines() if " WARN " in line or " ERROR " in line or "rounds: round" in line]
    return "\n".join(line[:220] for line in lines[-keep:])
