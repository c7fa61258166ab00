"""What one core's work loses while another core does the same: how far two one-thread servers on this
machine can get from twice one (benchmarks/replicas.py).

Two kinds of single-thread work, each timed alone and then in two processes at once:

  compute  a bf16 linear layer of the embedded model's MLP shape over a 256-token chunk (prefill-like);
  memory   a batch-1 bf16 matrix-vector product over 256 MB of weights (a decode step's weight stream).

    python benchmarks/core_scaling.py            # ~1 min; prints each rate and its ratio to alone
"""
from __future__ import annotations

import argparse
import multiprocessing
import time


def rate(kind: str, seconds: float) -> float:
    """Calls a second of `kind`'s work on one torch thread."""
    import torch

    torch.set_num_threads(1)
    if kind == "compute":
        x, w = torch.randn(256, 576, dtype=torch.bfloat16), torch.randn(1536, 576, dtype=torch.bfloat16)
    else:
        x, w = torch.randn(1, 4096, dtype=torch.bfloat16), torch.randn(32768, 4096, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(x, w)
        calls += 1
    return calls / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="timing of each run")
    args = p.parse_args()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        for kind in ("compute", "memory"):
            alone = pool.apply(rate, (kind, args.seconds))
            both = pool.starmap(rate, [(kind, args.seconds)] * 2)
            print(f"{kind}: alone {alone:.1f}/s; two at once {both[0]:.1f} and {both[1]:.1f}/s "
                  f"({both[0] / alone:.2f}x, {both[1] / alone:.2f}x of alone)")


if __name__ == "__main__":
    main()
