"""The run's tokenizer as Hugging Face tokenizer files, giving the ids the model was trained on.

A run names its tokenizer only by identity (`Tokenizer.identity`), so the file is checked against it: a
`tokenizer.json` of another tokenizer would load fine and give silently wrong ids. The byte-level tokenizer has no
file; its equivalent is built here: a BPE without merges over GPT-2's byte-to-character alphabet, whose vocabulary
maps the character of byte b to id b, so every text encodes to exactly its UTF-8 bytes.

Training never adds special tokens (documents are separated by the EOS id), so `tokenizer_config.json` asks for
none by default; a copied `tokenizer.json` keeps its own post-processor, which `add_special_tokens=True` applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from hetero_node.models.tokenizer import ByteTokenizer, HFTokenizer
from hetero_node.protocol.errors import ConfigError


@dataclass(frozen=True)
class TokenizerFiles:
    """File name → text of the tokenizer files, and the EOS id config.json names."""

    files: dict[str, str]
    eos_id: int | None


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what `pre_tokenizers.ByteLevel` emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + n) for n, b in enumerate(others)},
    }


def byte_tokenizer_json() -> str:
    """A `tokenizer.json` that encodes text to its UTF-8 bytes as ids, like `ByteTokenizer`."""
    vocab = {char: byte for byte, char in gpt2_byte_alphabet().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def tokenizer_files(run_identity: str, path: Path | None, max_seq_len: int) -> TokenizerFiles:
    """The files for the run's tokenizer: built for the byte-level one, else `path`'s, checked against the run."""
    if path is None:
        if run_identity != ByteTokenizer.identity:
            raise ConfigError(
                f"this run trained with a tokenizer.json (identity {run_identity[:12]}…): pass it with --tokenizer"
            )
        text, eos_id, eos_token = byte_tokenizer_json(), None, None
    else:
        tokenizer = HFTokenizer(path)
        if tokenizer.identity != run_identity:
            raise ConfigError(
                f"--tokenizer {path} is not the run's tokenizer (identity {tokenizer.identity[:12]}…, "
                f"the run's: {run_identity[:12]}…)"
            )
        text, eos_id = path.read_text(encoding="utf-8"), tokenizer.eos_id
        eos_token = None if eos_id is None else tokenizers.Tokenizer.from_str(text).id_to_token(eos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the file as is: no model-specific rules on top of it
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
    }
    return TokenizerFiles(
        {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}, eos_id
    )
