"""The line a bootstrap prints for volunteers, and how scripts read the address back from it.

Its own light module: the demo, the tests and the benchmark parse a bootstrap's output without importing the
node (and hivemind with it).
"""

from __future__ import annotations

import re

JOIN_LINE = re.compile(r"hetero-node join --peers\s+(\S+)")


def join_line(address: str) -> str:
    """What a bootstrap prints for volunteers to copy."""
    return f"hetero-node join --peers {address}"
