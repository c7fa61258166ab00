"""The vLLM backend's start-up without vLLM: `VllmBackend.create` up to the worker's start, which raises
`WorkerStarted` instead (the `worker_configs` fixture in conftest.py records what the worker was handed)."""
from __future__ import annotations


class WorkerStarted(Exception):
    """Raised where the vLLM worker would start: the test has what it came for."""


def record_worker_configs(monkeypatch) -> list[dict]:
    """Replace the worker process: each start records its configuration and raises `WorkerStarted`."""
    from infercept.engine.vllm_backend import backend

    seen: list[dict] = []

    class Recorder:
        def __init__(self, python, config, env):
            seen.append(config)

        def start(self, timeout):
            raise WorkerStarted

    monkeypatch.setattr(backend, "WorkerProcess", Recorder)
    return seen
