"""`LocalSwarm` in the netlab: every peer in a network namespace of its own on a `tc tbf`-shaped link.

The long benches and the real-network tests run the demo's scenario over home-like links this way; `behind_nat`
puts some peers behind a NAT router of their own (bench/netns.py).
"""

from __future__ import annotations

from pathlib import Path

from hetero_node.bench.netns import SUBNET, LabNode, NetLab
from hetero_node.client.cli.local_swarm import LocalSwarm
from hetero_node.client.cli.options import env_name


class LabSwarm(LocalSwarm):
    """Peers on shaped links of `link_mbit`; `behind_nat`: those that cannot be dialed; `subnet`: where the lab's
    addresses come from."""

    def __init__(
        self,
        workdir: Path,
        link_mbit: float,
        behind_nat: frozenset[str] = frozenset(),
        subnet: str = SUBNET,
        threads_per_peer: int = 1,
    ) -> None:
        super().__init__(workdir, threads_per_peer)
        self.link_mbit = link_mbit
        self.behind_nat = behind_nat
        self.subnet = subnet
        self.lab: NetLab | None = None
        del self.env[env_name("host")]  # each node listens on its own namespace's address (`host`)

    def __enter__(self) -> LabSwarm:
        super().__enter__()
        self.lab = NetLab(subnet=self.subnet)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self.lab is not None:
                self.lab.close()

    def host(self, name: str) -> str:
        return self._lab_node(name).address

    def placed(self, name: str, argv: list[str]) -> list[str]:
        # `ip netns exec` execs the command: the pid and process group stay the peer's
        return ["ip", "netns", "exec", self._lab_node(name).namespace, *argv]

    def _lab_node(self, name: str) -> LabNode:
        """Peer `name`'s namespace and shaped link, made on first use."""
        assert self.lab is not None, "use LabSwarm as a context manager"
        if name in self.lab.nodes:
            return self.lab.nodes[name]
        add = self.lab.add_nat_node if name in self.behind_nat else self.lab.add_node
        return add(name, self.link_mbit)
