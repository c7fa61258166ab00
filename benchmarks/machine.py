"""What machine a result was measured on, for the header of every result file (numbers differ by CPU)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

# The instruction sets that decide our CPU kernels' speed, from weakest to strongest.
_FEATURES = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))


def cpu_name() -> str:
    """E.g. "Intel(R) Xeon(R) Processor, AVX512, 2 cores"."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    best = next((label for flag, label in _FEATURES if flag in flags), None)
    return ", ".join(x for x in (name, best, f"{os.cpu_count()} cores") if x)


def today() -> str:
    return time.strftime("%Y-%m-%d")
