"""The engine's decode step on the CPU as the context grows: the embedded model (bf16), `--batch`
sequences of `--contexts` random prompt tokens each, prefilled, then `--steps` decode steps timed
(ms a step, tokens/s). Attention over the context is the part that grows; the rest of a step is not.

    python benchmarks/cpu_context_decode.py                          # batches 1 and 8, contexts 64 to 8,000
    python benchmarks/cpu_context_decode.py --json out.json

To compare two checkouts, run it from each in turn on a quiet machine (PYTHONPATH at a folder holding
an `infercept` link to the other checkout) and read the rows side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import cpu_name  # noqa: E402


def measure(engine, batch: int, context: int, steps: int, seed: int) -> float:
    """Seconds a decode step, `batch` sequences over `context` tokens."""
    from infercept.engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(context)], params)
    while not all(r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill, and each sequence's first token
    start, timed = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        timed += 1
    return (time.perf_counter() - start) / timed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 4096, 8000])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    from infercept.engine import Engine
    from infercept.engine.download import ensure_default_model

    kv_gb = 24e3 * max(args.batches) * (max(args.contexts) + args.steps + 16) / 1e9 * 1.2  # 23 KB a token in bf16
    engine = Engine(ensure_default_model(), dtype="bfloat16", kv_cache_gb=kv_gb, num_threads=args.threads,
                    max_num_batched_tokens=2048, progress=False)
    rows = []
    print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| batch | context | ms a step | tokens/s |\n|---:|---:|---:|---:|")
    for batch in args.batches:
        for context in args.contexts:
            seconds = measure(engine, batch, context, args.steps, seed=context + batch)
            rows.append({"batch": batch, "context": context, "step_ms": 1e3 * seconds, "tok_s": batch / seconds})
            print(f"| {batch} | {context:,} | {1e3 * seconds:.1f} | {batch / seconds:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
