"""Readers for the file formats user corpora ship in, each streaming its documents so that a corpus far larger
than memory can be tokenized.

* `.txt`, `.md`: one document per file (held whole: a document is the unit the tokenizer sees);
* `.jsonl`: one document per line, from its string `"text"` field;
* `.parquet`: one document per row of its string `text` column, read one record batch at a time.

Text and JSONL files may be compressed (`.txt.gz`, `.jsonl.zst`, ...). Decompression is pyarrow's streaming
codecs rather than `gzip`/`zstandard`: one library for both, and it reports a truncated zstd file, which
`zstandard`'s stream reader ends silently, as if the corpus were shorter.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from hetero_node.protocol.errors import DataError

Document = tuple[str, str]
"""(name for messages, text)"""

CODECS = {"": None, "gz": "gzip", "zst": "zstd"}
"""Compression suffix (without its dot) -> pyarrow codec name."""
SUFFIXES = (*(f".{kind}.{ext}".rstrip(".") for kind in ("txt", "md", "jsonl") for ext in CODECS), ".parquet")
"""Suffixes of the files a data directory contributes, lower case."""
PARQUET_BATCH_ROWS = 1024
"""Rows decoded at a time: small enough to bound memory, large enough to amortise pyarrow's per-batch cost."""
_PARQUET_READ_BYTES = 1 << 20
"""Column chunks are read in pieces this size: a row group can be far larger than memory."""
MAX_LINE_BYTES = 64 << 20
"""The longest JSONL line (one document) read: a 199 KiB `.jsonl.gz` holding one huge line cost 405-605 MiB."""
MAX_TEXT_CHARS = 1 << 30
"""The longest `.txt`/`.md` document (held whole) read: a small compressed file must not expand without bound."""


def corpus_suffix(path: Path) -> str | None:
    """The corpus suffix `path` ends in (".jsonl.gz", ".txt", ...), matched case-insensitively, or None."""
    for n in (2, 1):  # Path.suffixes, not str.endswith: a hidden file named ".txt" has no suffix
        suffix = "".join(path.suffixes[-n:]).lower()
        if suffix in SUFFIXES:
            return suffix
    return None


def iter_documents(path: Path) -> Iterator[Document]:
    """The documents of one file, by its suffix; a file of no known format is one plain-text document."""
    kind, _, ext = (corpus_suffix(path) or ".txt")[1:].partition(".")
    if kind == "parquet":
        yield from _iter_parquet(path)
    elif kind == "jsonl":
        yield from _iter_jsonl(path, CODECS[ext])
    else:
        yield path.name, _read_text(path, CODECS[ext])


def _read_error(path: Path, e: OSError | pa.ArrowException, unit: str = "", count: int = 0) -> DataError:
    """Says how far reading got (a corrupt or truncated stream fails midway). pyarrow's OSErrors carry no
    strerror: their message is the detail."""
    where = f" after {unit} {count}" if count else ""
    return DataError(f"cannot read data file {path}{where}: {getattr(e, 'strerror', None) or e}")


@contextmanager
def _open(path: Path, codec: str | None) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed while they are read when `codec` is set."""
    try:
        raw = path.open("rb")
    except OSError as e:
        raise _read_error(path, e) from e
    with raw:
        if codec is None:
            yield raw
        else:
            with io.BufferedReader(pa.CompressedInputStream(raw, codec)) as stream:
                yield stream


def _read_text(path: Path, codec: str | None) -> str:
    """Decoded like `Path.read_text` (universal newlines), so plain files keep the token stream they always had."""
    try:
        with _open(path, codec) as f:
            text = io.TextIOWrapper(f, encoding="utf-8").read(MAX_TEXT_CHARS + 1)
    except OSError as e:
        raise _read_error(path, e) from e
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (bad byte at offset {e.start})") from e
    if len(text) > MAX_TEXT_CHARS:
        raise DataError(f"data file {path} holds more than {MAX_TEXT_CHARS:,} characters: split it into files")
    return text


def _jsonl_text(path: Path, lineno: int, raw: bytes) -> str:
    where = f"{path}, line {lineno}"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 (bad byte at column {e.start + 1})") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f"{where}: expected a JSON object with a string 'text' field")
    text = record["text"]
    try:
        text.encode("utf-8")  # JSON can escape lone surrogates, which no tokenizer can encode
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: 'text' holds an unpaired surrogate (\\u{ord(text[e.start]):04x})") from e
    return text


def _iter_jsonl(path: Path, codec: str | None) -> Iterator[Document]:
    lineno = 0
    with _open(path, codec) as f:
        try:
            for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(raw) > MAX_LINE_BYTES:
                    raise DataError(f"{path}, line {lineno}: longer than {MAX_LINE_BYTES:,} bytes; split the document")
                if raw.strip():
                    yield f"{path.name}:{lineno}", _jsonl_text(path, lineno, raw)
        except OSError as e:  # only reads raise it: the consumer's own errors never enter this generator
            raise _read_error(path, e, "line", lineno) from e


def _is_text_type(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def _iter_parquet(path: Path) -> Iterator[Document]:
    """Arrow strings are valid UTF-8 by construction, so unlike JSONL only nulls need a check per row."""
    try:  # pre_buffer, pyarrow's default, would hold the compressed column chunks of the whole file in memory
        parquet = pq.ParquetFile(path, buffer_size=_PARQUET_READ_BYTES, pre_buffer=False)
    except (OSError, pa.ArrowException) as e:
        raise _read_error(path, e) from e
    with parquet:
        columns = parquet.schema_arrow
        if "text" not in columns.names:
            raise DataError(f"Parquet file {path} has no 'text' column (its columns: {', '.join(columns.names)})")
        if not _is_text_type(columns.field("text").type):
            raise DataError(f"Parquet file {path}: column 'text' holds {columns.field('text').type}, not strings")
        row = 0
        try:
            batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"], use_threads=False)
            for batch in batches:  # no threads: one column has nothing to decode in parallel, only buffers to add
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text is None:
                        raise DataError(f"{path}, row {row}: 'text' is null")
                    yield f"{path.name}:{row}", text
        except (OSError, pa.ArrowException) as e:
            raise _read_error(path, e, "row", row) from e
