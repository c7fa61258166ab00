"""Build-time check: the torch just installed is a CUDA build no newer than the base image's CUDA.

A CPU wheel (from a wrong index) would serve on the CPU without a word; a wheel for a newer CUDA than
the image declares would need a newer driver than the image asks the host for.
Usage: python check_torch_cuda.py CUDA_VERSION
"""
import sys

import torch


def major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


base = sys.argv[1]
built = torch.version.cuda
if built is None:
    sys.exit(f"torch {torch.__version__} is a CPU build: set TORCH_INDEX_URL to a CUDA index")
if major_minor(built) > major_minor(base):
    sys.exit(f"torch {torch.__version__} needs CUDA {built}, newer than the base image's {base}: "
             f"raise CUDA_VERSION or pick an older CUDA index in TORCH_INDEX_URL")
print(f"torch {torch.__version__}, CUDA {built}, base image CUDA {base}")
