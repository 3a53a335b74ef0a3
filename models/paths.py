"""Where hetero-node keeps downloaded corpora and token caches, shared by setup commands and training."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "HETERO_NODE_CACHE"
"""Environment variable that overrides the cache directory (e.g. to put it on a bigger disk)."""


def default_cache_dir() -> Path:
    """`$HETERO_NODE_CACHE` if set, else `~/.cache/hetero-node`: one place so setup and training agree."""
    override = os.environ.get(CACHE_ENV_VAR)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "hetero-node"
