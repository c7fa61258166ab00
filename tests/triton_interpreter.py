"""Runs a test file's kernels under Triton's interpreter, in a child process.

TRITON_INTERPRET=1 is read when `triton.jit` decorates, Triton's own library functions included, so it
cannot be flipped inside the pytest process (test_triton_decode.py's docstring says what breaks): the
test file, run as a script with an output path, computes its cases in a child started with it set, and
saves them with torch.save; the parent compares them with references it computes itself."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch


def interpreted_outputs(test_file: str, out_dir) -> dict:
    """`python test_file OUT` under TRITON_INTERPRET=1; what it saved to OUT (skips without Triton)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the `test` extra)")
    out_path = str(out_dir / "outputs.pt")
    child = subprocess.run([sys.executable, test_file, out_path], env={**os.environ, "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    return torch.load(out_path)
