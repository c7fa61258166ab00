"""The accelerator a GPU check ran on: its name, driver, a slug for the results folder, and its HBM
bandwidth (datasheet), which bounds batch-1 decode: every step streams all weights once, so
tokens/s <= bandwidth / weight bytes. The check reports that bound beside what the engine reaches.

    python3 benchmarks/gpu/card.py --slug      # e.g. h100-80gb-hbm3 (cpu without a GPU)
"""
from __future__ import annotations

import re
import subprocess
import sys

# Datasheet HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name(); first match wins.
HBM_BYTES_PER_S = (
    ("H200", 4.8e12),            # H200 SXM and NVL: HBM3e
    ("H100 PCIe", 2.0e12),       # HBM2e
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),           # H100 SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3")
)


def hbm_bytes_per_s(name: str) -> float | None:
    return next((bw for key, bw in HBM_BYTES_PER_S if key in name), None)


def card_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def slug(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s.removeprefix("nvidia-") or "unknown"


if __name__ == "__main__":
    print(slug(card_name()) if sys.argv[1:] == ["--slug"] else card_name())
