"""Tokenizers: byte-level by default (no file to distribute), or a user's Hugging Face `tokenizer.json`.

Every tokenizer carries an `identity` hash: token ids only mean something relative to the exact tokenizer that
produced them, so caches and the swarm's run config key on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers

from hetero_node.protocol.errors import DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
"""End-of-document tokens recognised in a `tokenizer.json`, in order of preference (GPT-2, Llama/T5, Gemma, Llama 3)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids; every id is in [0, vocab_size)."""
        ...

    @property
    def identity(self) -> str:
        """Hex sha256 that identifies this tokenizer exactly (same hash ⇔ same ids for the same text)."""
        ...

    @property
    def eos_id(self) -> int | None:
        """Id that separates documents, or None if the tokenizer has none."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: exact round trip for any text, nothing to download, 256-entry embedding."""

    vocab_size = 256
    identity = hashlib.sha256(b"hetero-node/byte-v1").hexdigest()
    eos_id = None  # all 256 ids are bytes; documents are separated by a blank line instead

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid byte sequences (a model can emit any bytes) decode to U+FFFD rather than raising."""
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A user-supplied `tokenizer.json`, identified by the sha256 of its bytes."""

    def __init__(self, path: Path) -> None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read tokenizer file {path}: {e.strerror or e}") from e
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # bad UTF-8, bad JSON, or the Rust parser's bare Exception
            raise DataError(f"tokenizer file {path} is not a valid tokenizer.json: {e}") from e
        self.path = path
        self.identity = hashlib.sha256(raw).hexdigest()  # hash of the bytes actually parsed, not a re-read
        # max id + 1 rather than the vocab's length: ids need not be contiguous in a hand-edited file
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eos_id = next(
            (i for i in map(self._tok.token_to_id, EOS_CANDIDATES) if i is not None),
            None,
        )

    def encode(self, text: str) -> list[int]:
        """No special tokens added: document boundaries are the data layer's job (it inserts `eos_id`)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer in `path`, or the byte-level one when no file is given."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
