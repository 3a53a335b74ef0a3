"""State blobs from peers are read without unpickling: what `tensor_file` keeps, and what it refuses."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

from hetero_node.protocol.errors import PayloadError
from hetero_node.protocol.tensor_file import TREE_KEY, dumps, loads


def test_a_state_comes_back_with_its_structure_values_and_dtypes() -> None:
    table = torch.randn(5, 3)
    state = {
        "round": 7, "tensors": [torch.randn(4, 3), torch.arange(6)], "shared": [], "fixed": table, "note": None,
        "lr": 0.5, "ok": True, "half": torch.ones(2, dtype=torch.bfloat16), "view": table[:2],
    }  # fmt: skip
    back = loads(dumps(state))
    assert back.keys() == state.keys() and back["round"] == 7 and back["shared"] == [] and back["note"] is None
    for key in ("fixed", "half", "view"):
        assert torch.equal(back[key], state[key]) and back[key].dtype == state[key].dtype
    assert all(torch.equal(a, b) for a, b in zip(back["tensors"], state["tensors"], strict=True))


def test_pickles_truncations_and_forged_headers_are_refused() -> None:
    blob = dumps({"tensors": [torch.ones(3)]})
    buffer = io.BytesIO()
    torch.save({"tensors": [torch.ones(3)]}, buffer)
    for bad in (buffer.getvalue(), pickle.dumps({"a": 1}), blob[:-1], blob[:7], b"", (1 << 40).to_bytes(8, "little")):
        with pytest.raises(PayloadError):
            loads(bad)
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    header["__metadata__"][TREE_KEY] = json.dumps({"d": [["tensors", {"l": [{"v": 0}]}]]})  # names no tensor
    forged = json.dumps(header).encode()
    with pytest.raises(PayloadError, match="does not name"):
        loads(len(forged).to_bytes(8, "little") + forged + blob[8 + length :])


def test_only_plain_values_and_tensors_are_written() -> None:
    with pytest.raises(TypeError):
        dumps({"f": lambda: 0})
    with pytest.raises(TypeError):
        dumps({(1, 2): torch.ones(1)})
    back = loads(dumps({0: {"step": torch.tensor(3.0)}, "betas": (0.9, 0.95)}))  # an optimizer's state_dict
    assert list(back) == [0, "betas"] and back["betas"] == [0.9, 0.95] and back[0]["step"].item() == 3.0
