"""Environment variables the engine reads, in one place."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where converted models and profiles live: $INFERCEPT_CACHE, default ~/.cache/infercept."""
    return os.environ.get("INFERCEPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "infercept")


def step_log_path() -> str | None:
    """$INFERCEPT_STEP_LOG: append one JSON line per engine step (what it ran, how long it took) to
    this file, for benchmarks that explain a result by the batches behind it. Unset: no log."""
    return os.environ.get("INFERCEPT_STEP_LOG") or None
