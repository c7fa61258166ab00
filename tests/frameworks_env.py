"""Agent libraries the suite's own environment cannot hold run in .venv-frameworks (`make frameworks-env`;
the Makefile says why and pins them): a test runs a script of this folder there against the live server
and reads the JSON object the script prints last."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYTHON = HERE.parent / ".venv-frameworks" / "bin" / "python"
needs_frameworks_env = pytest.mark.skipif(not PYTHON.exists(),
                                          reason="needs .venv-frameworks (make frameworks-env: PyPI)")


def run_script(name: str, url: str, model: str, timeout: float = 300) -> dict:
    """`python tests/<name> URL MODEL` in .venv-frameworks: the JSON object it printed last."""
    done = subprocess.run([str(PYTHON), str(HERE / name), url, model], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
