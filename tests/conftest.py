"""Shared pytest fixtures. Keep each one small and named for what it provides."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_node.models.corpus import bundled_corpus_archive
from hetero_node.models.paths import default_cache_dir
from hetero_node.protocol.errors import DataError


@pytest.fixture(scope="session")  # a module's live swarm needs it too
def bundled_cache_dir() -> Path:
    """The cache directory holding the verified bundled corpus ($HETERO_NODE_CACHE honoured); tests never
    download, so without it the test is skipped with the command that fetches it."""
    cache_dir = default_cache_dir()
    try:
        bundled_corpus_archive(cache_dir)
    except DataError as e:
        pytest.skip(f"bundled corpus not available ({e}); run `make data` (`make test` fetches it first)")
    return cache_dir
