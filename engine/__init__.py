"""InferCept engine: a paged-KV, continuously batched Llama-family engine.

The names below load on first use, so `import infercept.engine.policy` (the cost model, waste
equations, duration estimate and KV decisions), the scheduler, its configs and the simulation import
without torch; only the engine that runs a model needs it.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"AsyncEngine": ".async_engine", "Engine": ".engine", "LLM": ".llm", "RequestOutput": ".outputs",
            "SamplingParams": ".sampling_params", "NativeBackend": ".native_backend", "EngineBackend": ".backend",
            "VllmBackend": ".vllm_backend.backend", "default_vllm_python": ".vllm_backend.backend",
            "REASONING_PARSERS": ".reasoning_parsers", "CacheConfig": ".config",
            "SHARED_KV_CACHE_FRACTION": ".config", "ensure_default_model": ".download", "resolve_model": ".download",
            "profile_model": ".engine"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
