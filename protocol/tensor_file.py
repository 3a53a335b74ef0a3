"""Tensors and the plain values around them as bytes, without pickle: the safetensors format (a length, a JSON
header, then raw little-endian tensor data), with the structure around the tensors (dicts, lists, numbers, strings)
kept as JSON in the header's metadata.

Why not `torch.save`: a state blob comes from a peer, and `torch.load` runs an unpickler over the attacker's bytes
even with `weights_only` (a restricted one, with a history of escapes). Reading safetensors parses one bounded
JSON header and copies bytes whose offsets, dtypes and shapes it checks; nothing in the data can run.
"""

from __future__ import annotations

import json
from typing import Any

from torch import Tensor

from hetero_node.protocol.errors import PayloadError

TREE_KEY = "hetero-node.tree"
MAX_HEADER_BYTES = 16 << 20
"""A header this large would describe about 100k tensors; ours describe a few hundred."""


def dumps(tree: Any) -> bytes:
    """`tree` (dicts with string or integer keys, lists, tensors, numbers, strings, booleans, None) as bytes; tuples
    come back as lists."""
    from safetensors.torch import save

    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()

    def encode(value: Any) -> Any:
        if isinstance(value, Tensor):
            name, tensor = str(len(tensors)), value.detach().cpu().contiguous()
            if tensor.untyped_storage().data_ptr() in storages:  # a view of one already stored: the format
                tensor = tensor.clone()  # refuses shared memory, and the reader gets separate tensors anyway
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor
            return {"t": name}
        if isinstance(value, dict):  # as pairs: JSON objects would turn an optimizer's integer keys into strings
            if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
                raise TypeError("dictionary keys must be strings or integers")
            return {"d": [[k, encode(v)] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {"l": [encode(v) for v in value]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"v": value}
        raise TypeError(f"cannot store a {type(value).__name__}")

    skeleton = encode(tree)
    return save(tensors, metadata={TREE_KEY: json.dumps(skeleton, separators=(",", ":"))})


def loads(data: bytes) -> Any:
    """What `dumps` wrote; `PayloadError` for anything else (checked before any tensor is built)."""
    from safetensors.torch import load

    if len(data) < 8:
        raise PayloadError("not a tensor file: shorter than its header length")
    length = int.from_bytes(data[:8], "little")
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        raise PayloadError(f"tensor file header of {length} bytes does not fit in {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + length])
        skeleton = json.loads(header["__metadata__"][TREE_KEY])
        tensors = load(data)
    except Exception as e:  # json, key and safetensors' own errors: all mean the bytes are not ours
        raise PayloadError(f"not a tensor file: {type(e).__name__}: {e}") from None
    used: set[str] = set()

    def decode(node: Any) -> Any:
        if not (isinstance(node, dict) and len(node) == 1):
            raise PayloadError("tensor file structure is malformed")
        kind, value = next(iter(node.items()))
        if kind == "t" and isinstance(value, str) and value in tensors and value not in used:
            used.add(value)
            return tensors[value]
        if kind == "d" and isinstance(value, list) and all(_is_pair(p) for p in value):
            return {k: decode(v) for k, v in value}
        if kind == "l" and isinstance(value, list):
            return [decode(v) for v in value]
        if kind == "v" and (value is None or isinstance(value, bool | int | float | str)):
            return value
        raise PayloadError(f"tensor file structure has a malformed {kind!r} entry")

    tree = decode(skeleton)
    if used != set(tensors):
        raise PayloadError("tensor file holds tensors its structure does not name")
    return tree


def _is_pair(entry: Any) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str | int)
        and not isinstance(entry[0], bool)
    )
