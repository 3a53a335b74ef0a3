"""Training data: tokenize a corpus once into a memory-mapped cache, cut it into disjoint shards, draw batches.

Cache layout: `<cache_dir>/tokens/<key>/{train.npy, val.npy, meta.json}`, where `key` hashes the source, the
tokenizer and the validation fraction. A cache directory appears only by an atomic rename of a complete build, and
is checked against its `meta.json` on every open, so a crash or a damaged file leads to a rebuild, never to
training on half a corpus.

Validation split: the last `val_fraction` of the joined token stream. A tail works for any source (one big file
or thousands of documents), gives the exact fraction asked for, and keeps train and val each one contiguous
range, so no training window can read validation tokens.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from hetero_node.models.corpus import BUNDLED_REQUIREMENT, BUNDLED_SHA256, bundled_corpus_archive, iter_bundled_texts
from hetero_node.models.corpus_formats import SUFFIXES, Document, corpus_suffix, iter_documents
from hetero_node.models.tokenizer import Tokenizer
from hetero_node.protocol.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bump when the cache layout or the way documents are joined changes: old caches then miss instead of lying."""
DOC_SEPARATOR = "\n\n"
"""Joins documents when the tokenizer has no end-of-document id (the byte tokenizer)."""
_META_FIELDS = {"format": int, "tokenizer": str, "dtype": str, "n_train": int, "n_val": int, "tokens_sha256": str}

Batch = tuple[torch.Tensor, torch.Tensor]
"""(x, y): int64 token ids of shape (batch_size, seq_len), y = x shifted by one."""


@dataclass(frozen=True, eq=False)
class TokenStore:
    """A tokenized corpus. `train` and `val` are read-only memory maps: opening is instant and processes on one
    machine share the page cache."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    identity: str
    """Hex sha256 of the tokenizer identity and the train and val token ids: two peers train on the same data
    exactly when their identities are equal, wherever their files live."""

    @property
    def n_tokens(self) -> int:
        """Train plus validation tokens."""
        return len(self.train) + len(self.val)


@dataclass(frozen=True)
class _Source:
    key: str  # identifies the source's content cheaply, for the cache key
    description: str  # for messages and meta.json
    documents: Callable[[], Iterator[Document]]


class _CorruptCache(DataError):
    """A token cache directory that does not match its own meta.json (only ever escapes right after a build)."""


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian explicitly: the bytes are hashed into the identity, which must agree across machines."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def _store_identity(tokenizer_identity: str, tokens_sha256: str, n_train: int, n_val: int) -> str:
    return _sha256_json({"tokenizer": tokenizer_identity, "tokens": tokens_sha256, "n_train": n_train, "n_val": n_val})


# --- user data -------------------------------------------------------------------------------------------------


def _user_files(source: Path) -> list[Path]:
    """The files behind a data path, in a fixed order (it fixes the token stream)."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(f"data path {source} does not exist (or is not a file or directory)")
    try:
        files = [p for p in source.rglob("*") if corpus_suffix(p) is not None and p.is_file()]
    except OSError as e:
        raise DataError(f"cannot list data directory {source}: {e}") from e
    if not files:
        raise DataError(f"data directory {source} holds no {', '.join('*' + s for s in SUFFIXES)} files")
    return sorted(files, key=lambda p: p.relative_to(source).as_posix())


def _stat_key(source: Path, files: list[Path]) -> str:
    """Hash of (relative path, size, mtime_ns) per file: costs a stat, not a read of the whole corpus.

    Any edit changes size or mtime (nanosecond resolution), and moving or copying the data with `cp -p`/`rsync`
    keeps the cache valid. The key only decides whether to re-tokenize locally; what the swarm compares is
    `TokenStore.identity`, which hashes the tokens themselves.
    """
    root = source if source.is_dir() else source.parent
    entries = []
    for path in files:
        try:
            st = path.stat()
        except OSError as e:
            raise DataError(f"cannot read data file {path}: {e.strerror or e}") from e
        entries.append([path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    return _sha256_json(entries)


def _resolve_source(source: Path | None, cache_dir: Path) -> _Source:
    if source is None:
        return _Source(
            key=f"bundled:{BUNDLED_SHA256}",
            description=f"bundled corpus {BUNDLED_REQUIREMENT}",
            # the archive is only needed (and checked) when there is no valid cache yet
            documents=lambda: iter_bundled_texts(bundled_corpus_archive(cache_dir)),
        )
    files = _user_files(source)
    return _Source(
        key=f"user:{_stat_key(source, files)}",
        description=f"user data {source}",
        documents=lambda: itertools.chain.from_iterable(map(iter_documents, files)),
    )


# --- token cache -----------------------------------------------------------------------------------------------


def _tokenize(
    documents: Iterable[Document], tokenizer: Tokenizer, dtype: np.dtype, out: BinaryIO
) -> tuple[int, int, str]:
    """Append the joined token ids to `out` one document at a time, so memory holds one document, never the
    corpus; return (tokens, documents, sha256 of the bytes written)."""
    ids = tokenizer.encode(DOC_SEPARATOR) if tokenizer.eos_id is None else [tokenizer.eos_id]
    separator = np.asarray(ids, dtype=dtype).tobytes()
    digest = hashlib.sha256()
    n_bytes = n_docs = 0
    for name, text in documents:
        if not text:
            continue
        block = np.asarray(tokenizer.encode(text), dtype=dtype).tobytes()
        logger.debug("%s: %d tokens", name, len(block) // dtype.itemsize)
        if n_docs:
            block = separator + block
        out.write(block)
        digest.update(block)
        n_bytes += len(block)
        n_docs += 1
    return n_bytes // dtype.itemsize, n_docs, digest.hexdigest()


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """What `np.save` writes before a 1-D array. Its length does not depend on `length` (numpy pads the shape
    so that a file can grow in place), which lets `_write_cache` stream tokens in before their count is known."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": dtype.str, "fortran_order": False, "shape": (length,)})
    return header.getvalue()


def _split_off_val(train_path: Path, val_path: Path, dtype: np.dtype, n_train: int, n_val: int) -> None:
    """Move the last `n_val` tokens of the stream in `train_path` into `val_path` and give both their final
    headers. Plain reads and writes, not a memory map: mapping the stream would page it into this process."""
    placeholder = _npy_header(dtype, 0)
    train_end = len(placeholder) + n_train * dtype.itemsize
    with train_path.open("r+b") as train:
        train.seek(train_end)
        with val_path.open("wb") as val:
            val.write(_npy_header(dtype, n_val))
            shutil.copyfileobj(train, val)
        train.truncate(train_end)
        header = _npy_header(dtype, n_train)
        if len(header) != len(placeholder):
            raise RuntimeError(f"numpy's .npy header for {n_train} tokens no longer fits the space reserved for it")
        train.seek(0)
        train.write(header)


def _write_cache(source: _Source, tokenizer: Tokenizer, val_fraction: float, dest: Path) -> None:
    """Tokenize `source` into the empty directory `dest` (which is renamed into place afterwards).

    Tokens stream straight into train.npy behind a placeholder header; the validation tail is split off once the
    total is known. Memory stays bounded by the largest document, disk by the tokens plus the validation split.
    """
    dtype = _token_dtype(tokenizer.vocab_size)
    train_path = dest / "train.npy"
    start = time.perf_counter()
    with train_path.open("wb") as out:
        out.write(_npy_header(dtype, 0))
        n_tokens, n_docs, tokens_sha256 = _tokenize(source.documents(), tokenizer, dtype, out)
    if n_tokens < 2:
        raise DataError(f"{source.description} holds too little text ({n_tokens} tokens)")
    n_val = min(n_tokens - 1, max(1, math.ceil(n_tokens * val_fraction)))
    n_train = n_tokens - n_val
    _split_off_val(train_path, dest / "val.npy", dtype, n_train, n_val)
    meta = {
        "format": CACHE_FORMAT,
        "source": source.description,
        "tokenizer": tokenizer.identity,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.str,
        "val_fraction": val_fraction,
        "n_documents": n_docs,
        "n_train": n_train,
        "n_val": n_val,
        "tokens_sha256": tokens_sha256,
        "identity": _store_identity(tokenizer.identity, tokens_sha256, n_train, n_val),
    }
    (dest / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info(
        "tokenized %s: %d documents, %d train + %d val tokens in %.1f s",
        source.description,
        n_docs,
        n_train,
        n_val,
        time.perf_counter() - start,
    )


def _build_cache(source: _Source, tokenizer: Tokenizer, val_fraction: float, final: Path) -> None:
    """Build in a temporary sibling directory and rename it into place: readers see all of a cache or none."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".build-{final.name[:16]}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()  # not mkdtemp: its 0700 mode would survive the rename and hide a shared cache from other users
    try:
        _write_cache(source, tokenizer, val_fraction, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("another process built %s first; using its cache", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _open_cache(path: Path, tokenizer: Tokenizer) -> TokenStore:
    """Memory-map a cache, raising `_CorruptCache` unless every file matches meta.json and the tokenizer."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _CorruptCache(f"meta.json is unreadable: {e}") from e
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in _META_FIELDS.items()):
        raise _CorruptCache("meta.json lacks required fields")
    dtype = _token_dtype(tokenizer.vocab_size)
    if meta["format"] != CACHE_FORMAT or meta["tokenizer"] != tokenizer.identity or meta["dtype"] != dtype.str:
        raise _CorruptCache("meta.json does not match this cache format or tokenizer")
    expected_identity = _store_identity(meta["tokenizer"], meta["tokens_sha256"], meta["n_train"], meta["n_val"])
    if meta.get("identity") != expected_identity:
        raise _CorruptCache("meta.json identity does not match its own fields")
    splits = {}
    for split in ("train", "val"):
        try:
            array = np.load(path / f"{split}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise _CorruptCache(f"{split}.npy is unreadable: {e}") from e
        expected = (meta[f"n_{split}"],)
        if array.dtype != dtype or array.shape != expected:
            raise _CorruptCache(f"{split}.npy holds {array.dtype}{array.shape}, meta.json says {dtype}{expected}")
        splits[split] = array
    return TokenStore(splits["train"], splits["val"], tokenizer.vocab_size, meta["identity"])


def build_token_store(
    source: Path | None, tokenizer: Tokenizer, cache_dir: Path, val_fraction: float = 0.01
) -> TokenStore:
    """Open the token cache for (source, tokenizer, val_fraction), tokenizing first if there is no valid one.

    `source` None means the bundled corpus, which must have been fetched into `cache_dir` beforehand.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    resolved = _resolve_source(source, cache_dir)
    key = _sha256_json(
        {"format": CACHE_FORMAT, "source": resolved.key, "tokenizer": tokenizer.identity, "val": val_fraction}
    )
    final = cache_dir / "tokens" / key
    if final.exists():
        try:
            return _open_cache(final, tokenizer)
        except _CorruptCache as e:
            logger.warning("token cache %s is corrupt (%s); discarding and rebuilding it", final, e)
            shutil.rmtree(final)
    _build_cache(resolved, tokenizer, val_fraction, final)
    return _open_cache(final, tokenizer)


# --- shards and batches ----------------------------------------------------------------------------------------


def data_shard(store: TokenStore, shard_id: int, n_shards: int) -> tuple[int, int]:
    """Token range [start, end) of `store.train` owned by a shard; shards 0..n_shards-1 partition train."""
    if n_shards < 1 or not 0 <= shard_id < n_shards:
        raise ValueError(f"shard {shard_id} of {n_shards} does not exist")
    n = len(store.train)
    return shard_id * n // n_shards, (shard_id + 1) * n // n_shards


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """One row per start: tokens [s, s + seq_len) as x and [s + 1, s + seq_len] as y."""
    block = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


class ShardBatches:
    """Endless batches of random windows from one shard; window [s, s + seq_len] always lies inside the shard.

    Batch number `step` depends only on (seed, shard_id, n_shards, step), so a resumed trainer continues the exact
    sequence by passing `start_step` (or calling `skip`), without replaying the batches it already used.
    """

    def __init__(
        self,
        store: TokenStore,
        shard_id: int,
        n_shards: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        start_step: int = 0,
    ) -> None:
        if min(batch_size, seq_len) < 1 or seed < 0 or start_step < 0:
            raise ValueError("batch_size and seq_len must be positive, seed and start_step non-negative")
        self.start, self.end = data_shard(store, shard_id, n_shards)
        if self.end - self.start < seq_len + 1:
            raise ConfigError(
                f"data shard {shard_id}/{n_shards} holds {self.end - self.start} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use more data, fewer shards or shorter sequences"
            )
        self._tokens = store.train
        self._seed = (seed, shard_id, n_shards)
        self.batch_size, self.seq_len, self.step = batch_size, seq_len, start_step

    def batch(self, step: int) -> Batch:
        """The batch at position `step` of this stream (random access, no side effects)."""
        rng = np.random.default_rng([*self._seed, step])
        starts = rng.integers(self.start, self.end - self.seq_len, size=self.batch_size)
        return _windows(self._tokens, starts, self.seq_len)

    def skip(self, n: int) -> None:
        """Advance past `n` batches without materialising them."""
        self.step += n

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.step)
        self.step += 1
        return batch


def probe_batches(
    store: TokenStore, data_shards: int, batch_size: int, seq_len: int, seed: int, draw: int, count: int
) -> list[Batch]:
    """The `count` batches judges score messages on under `--admission loss`: from the last data shard, which no
    replica trains on then (`RunConfig.training_shards`), chosen by `draw` (a round's `protocol/admission.py:
    probe_draw`, the same for every judge of it)."""
    stream = ShardBatches(store, data_shards - 1, data_shards, batch_size, seq_len, seed + 7)
    return [stream.batch(draw * count + k) for k in range(count)]


def val_batches(store: TokenStore, batch_size: int, seq_len: int, n_batches: int) -> list[Batch]:
    """Fixed validation batches: windows evenly spaced over the whole validation split, no randomness, so every
    evaluation (and every peer) scores the same tokens."""
    n = len(store.val)
    if n < seq_len + 1:
        raise ConfigError(f"the validation split holds {n} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    starts = np.linspace(0, n - seq_len - 1, num=n_batches * batch_size).round().astype(np.int64)
    return [_windows(store.val, chunk, seq_len) for chunk in starts.reshape(n_batches, batch_size)]
