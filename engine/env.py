"""Environment variables the engine reads, in one place."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where converted models and profiles live: $INFERCEPT_CACHE, default ~/.cache/infercept."""
    return os.environ.get("INFERCEPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "infercept")
