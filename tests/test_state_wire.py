"""Shard-state blobs as bytes: what a peer serves parses back, and a malformed blob is refused before anyone
compares fingerprints."""

from __future__ import annotations

import pytest
import torch

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.state_wire import (
    EMBED,
    FIXED,
    encode_change,
    encode_state,
    encode_table,
    parse_change,
    parse_state,
    parse_table,
    to_bytes,
)

SHAPES = [(4, 3), (5,)]
TABLE = (6, 2)


def test_a_served_state_table_and_change_parse_back() -> None:
    tensors, fixed, shared = [torch.ones(s) for s in SHAPES], torch.zeros(TABLE), [torch.full((4, 3), 2.0)]
    state = parse_state(encode_state(3, tensors, fixed, shared), SHAPES, TABLE)
    assert state["round"] == 3 and torch.equal(state[FIXED], fixed) and torch.equal(state["shared"][0], shared[0])
    assert [tuple(t.shape) for t in state["tensors"]] == SHAPES
    assert "shared" not in parse_state(encode_state(3, tensors, None, None), SHAPES, None)
    assert torch.equal(parse_table(encode_table(3, EMBED, fixed), EMBED, TABLE), fixed)
    positions, values = parse_change(encode_change(torch.arange(2, dtype=torch.int32), torch.ones(2)))
    assert positions.tolist() == [0, 1] and values.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "state",
    [
        {"round": 3, "tensors": [torch.ones(4, 3)]},  # a shard tensor missing
        {"round": 3, "tensors": [torch.ones(4, 3), torch.ones(5, dtype=torch.float64)]},
        {"round": 3, "tensors": [torch.ones(4, 3), torch.full((5,), float("nan"))]},
        {"round": 3, "tensors": "not a list"},
        {"round": 3, "tensors": [torch.ones(4, 3), torch.ones(5)], FIXED: torch.ones(6, 3)},
    ],
)
def test_a_malformed_state_is_refused(state: dict) -> None:
    with pytest.raises(PayloadError):
        parse_state(to_bytes(state), SHAPES, None if FIXED not in state else TABLE)


def test_a_table_or_change_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(PayloadError):
        parse_table(encode_table(3, FIXED, torch.ones(TABLE)), EMBED, TABLE)
    with pytest.raises(PayloadError):
        parse_table(encode_table(3, FIXED, torch.ones(TABLE, dtype=torch.float16)), FIXED, TABLE)
    with pytest.raises(PayloadError):
        parse_change(encode_change(torch.arange(2), torch.full((2,), float("inf"))))
    with pytest.raises(PayloadError):
        parse_state(b"\x00" * 16, SHAPES, None)
