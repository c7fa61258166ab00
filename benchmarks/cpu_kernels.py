"""Our bf16 CPU linear (engine/csrc) vs oneDNN, side by side in one run, on one decode step's matmuls.

Every linear of the embedded model's step (30 layers of qkv, o, gate_up, down, and the 49k-row
lm_head: 135M bf16 weights) at several batch sizes, ours vs oneDNN with pre-packed weights (the
engine's torch path; plain F.linear where oneDNN cannot pack bf16, as on AVX2-only CPUs), plus a 1024x1024 GEMM in fp32 and bf16 for what the CPU's bf16 support costs.
Prints a markdown table; the engine chooses between the two the same way at load, by timing.

    python benchmarks/cpu_kernels.py                 # batches 1 8 32 256
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from infercept.engine import cpu_kernels
from infercept.engine.models.llama import cpu_packing_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # SmolLM2-135M


def best_ms(fn, repeats: int) -> float:
    return cpu_kernels.fastest_seconds(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not cpu_kernels.enabled():
        raise SystemExit("our CPU kernels are not available here (neither AVX512F nor AVX2+FMA, or no C compiler)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES]
    if cpu_packing_available(torch.bfloat16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        theirs_name, theirs = "oneDNN packed", lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], "")
    else:
        theirs_name, theirs = "F.linear", lambda x, i: F.linear(x, weights[i])
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, kernels for {cpu_kernels.cpu_isa()}\n")
    print(f"| batch | ours ms | {theirs_name} ms | ratio |\n|---:|---:|---:|---:|")
    with torch.inference_mode():
        for batch in args.batches:
            xs = {k: torch.randn(batch, k, dtype=torch.bfloat16) for _, k in SHAPES}
            ours = best_ms(lambda: [cpu_kernels.linear_bf16(xs[w.shape[1]], w, None) for w in weights], args.repeats)
            other = best_ms(lambda: [theirs(xs[w.shape[1]], i) for i, w in enumerate(weights)], args.repeats)
            print(f"| {batch} | {ours:.1f} | {other:.1f} | {other / ours:.2f}x |")
        print("\n| 1024x1024 GEMM | GFLOP/s |\n|---|---:|")
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
            print(f"| {str(dtype).removeprefix('torch.')} | {2 * 1024 ** 3 / best_ms(lambda: a @ b, 5) / 1e6:.0f} |")


if __name__ == "__main__":
    main()
