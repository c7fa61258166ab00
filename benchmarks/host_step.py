"""The host's work in a decode step as a GPU runs it, measured on any machine: the scheduler's plan, the
static decode buffers' inputs (`cuda_graphs.DecodeGraphs.write_inputs`, what a CUDA-graph step stages
before its replay) and the output stage (detokenization, the tool-call parse, the outputs). On a GPU the
device waits for these every step (a step's sampled ids come back before the next is planned), so they
add to the forward pass; a CPU runs the same Python, which is what lets it be measured without a GPU.

A random-weight model of two layers in the embedded model's vocabulary (`benchmarks/gpu/make_models.py`
`tiny`), `--batch` requests of `--context` random prompt tokens, each interceptible with the hermes tool
parser as a served agent turn is; after they are all decoding, `--steps` steps, each part timed.

    python benchmarks/host_step.py --batch 64 --context 1024     # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from make_models import make_model  # noqa: E402

PARTS = ("schedule", "write_inputs", "output stage")


def measure(model: str, batch: int, context: int, steps: int) -> dict:
    from infercept.engine import Engine, SamplingParams
    from infercept.engine.cuda_graphs import DecodeGraphs
    from infercept.engine.policy import Profile
    from infercept.engine.request import InterceptParams

    # A profile of a GPU-like step, not measured: nothing pauses here, so no decision reads it.
    profile = Profile(model="host_step", device="cpu", dtype="bfloat16", bytes_per_token=256, block_size=16,
                      t_fwd_samples=((1, 0.007), (256, 0.009)), d2h_bytes_per_s=4e10, h2d_bytes_per_s=4e10)
    # A pool with room for every sequence's whole context: the tiny model's KV is 256 bytes a token, and
    # 2e-6 GB a token leaves ample room, so nothing is preempted or paused while the steps are timed.
    engine = Engine(model, dtype="bfloat16", device="cpu", kv_cache_gb=max(0.05, 2e-6 * batch * (context + steps)),
                    max_num_seqs=batch, max_num_batched_tokens=batch * (context + 1), num_threads=1, progress=False,
                    profile=profile)
    # The decode buffers on the host's device, uncaptured: their inputs are written as on a GPU.
    graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.config.device, batch,
                          engine.config.scheduler.max_model_len, decode_kernel=None)
    engine.runner.graph_sets = [graphs]
    seconds: collections.Counter = collections.Counter()

    def timed(owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(graphs, "write_inputs", "write_inputs")
    timed(engine, "_update", "output stage")
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 20000) for _ in range(context)], params,
                           intercept=InterceptParams(pause_on_stop=True, tool_parser="hermes"))
    while any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    seconds.clear()
    for _ in range(steps):
        engine.step()
    ms = {part: 1e3 * seconds[part] / steps for part in PARTS}
    return {"batch": batch, "context": context, "steps": steps, "ms": ms, "host_ms": sum(ms.values()),
            "us_per_sequence": 1e3 * sum(ms.values()) / batch}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    from infercept.engine.download import ensure_default_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        make_model(ensure_default_model(), os.path.join(folder, "tiny"), "tiny")
        result = measure(os.path.join(folder, "tiny"), args.batch, args.context, args.steps)
    print(f"{args.batch} decodes over {args.context} tokens: host {result['host_ms']:.2f} ms a step "
          f"({result['us_per_sequence']:.0f} us a sequence): "
          + ", ".join(f"{part} {ms:.3f}" for part, ms in result["ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
