"""A node that trains honestly and sends −3 × its own Δ: a negating attacker in a real process.

Usage: `python -m hetero_node.bench.negating_peer <hetero-node args...>`. It patches the outer method's encoder (the
message stays well formed: error feedback, top-k and the 2-bit codec are the honest ones, so strict decoding, the
claims judge and the size caps all pass it), then runs the real CLI. `make bench-admission` and the loss-admission
tests put it beside honest replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from hetero_node.client.cli import app
from hetero_node.protocol.outer_methods import Encoded, SparseLoCoMethod

NEGATION = -3.0
"""What the attacker multiplies its Δ by before encoding it."""

honest_encode = SparseLoCoMethod.encode


def negated_encode(self: SparseLoCoMethod, deltas: Sequence[Tensor]) -> Encoded:
    return honest_encode(self, [NEGATION * d for d in deltas])


def main() -> None:
    SparseLoCoMethod.encode = negated_encode  # type: ignore[method-assign]
    app.main()


if __name__ == "__main__":
    main()
