"""The vLLM backend: vLLM V1 in its own environment, behind `EngineBackend` (issue 19).

`backend.py` is the server's side, `worker.py` the vLLM side (run by the vLLM environment's python),
`process.py` the connection between them, `params.py` the sampling fields vLLM takes, `scheduler.py` our
policy inside vLLM (loaded by vLLM in its engine-core process). The names below load on first use, so
vLLM's python imports `engine.vllm_backend.scheduler` without the server-side modules.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"VllmBackend": ".backend", "default_vllm_python": ".backend"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
