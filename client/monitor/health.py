"""What `/healthz` and `/readyz` answer: the questions a supervisor (Docker's HEALTHCHECK, a Kubernetes probe, a load
balancer) asks a node that runs unattended.

`/healthz`: does the process still work? Its p2p daemon must run: hivemind does not notice when p2pd dies
(ARCHITECTURE.md, pitfall K), and a node without it can reach nobody, so a supervisor should restart it.
`/readyz`: does it do its job yet? A training node once it holds a role and finished (or caught up to) a round, a
bootstrap once its run announcement is stored. Each answer is one plain-text line saying why; the caller supplies
the checks, so this module knows nothing of roles or DHTs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Check = Callable[[], tuple[bool, str]]
"""(whether it holds, one line saying why)."""

DAEMON_GONE = "the p2p daemon (p2pd) is not running: this node can no longer reach the swarm"


@dataclass(frozen=True)
class Health:
    """`daemon_alive`: whether the node's p2pd runs; `ready`: the node's own readiness check."""

    daemon_alive: Callable[[], bool]
    ready: Check

    def healthz(self) -> tuple[bool, str]:
        return (True, "alive") if self.daemon_alive() else (False, DAEMON_GONE)

    def readyz(self) -> tuple[bool, str]:
        """Never ready while not alive: a node whose p2pd died may still look as if it trained a round."""
        alive, why = self.healthz()
        return self.ready() if alive else (False, why)
