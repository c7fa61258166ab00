"""Seeded long-context agent traces: coding agents whose context grows from ~10k to
~100k tokens over tens of steps, with heavy-tailed tool times (seconds to minutes, some human approvals).

The paper's six augments (`workload.py`) keep contexts near 1k tokens; coding agents (SWE-bench-style:
read files, search, run tests, build, ask a human to approve an edit) carry the repository into the
context and grow it with every tool result. The numbers below are ASSUMPTIONS in the range public agent
traces report (SWE-agent / OpenHands trajectories: 20-60 steps, 20k-100k-token contexts, test runs of
seconds to minutes), not a measured trace; they are fixed per tool so that a duration history can learn
each tool's distribution, as it would on a real deployment.

A program: a prompt of `PROMPT_TOKENS` (system prompt, tool schemas, task, repository map); then steps,
each decoding `DECODE` tokens (a tool call or an edit) and calling one tool drawn by `TOOLS`' shares,
whose result appends that tool's returned tokens; the program ends after its drawn number of steps or
before its context would pass `--max-context` (the model's window). Same JSON-lines format as
`workload.py` (`interception.tool` names the tool; `kind` is "human" for approvals).

    python benchmarks/long_context.py --rate 0.1 --duration 600 --seed 0 --describe
    # scaled down for the CPU server (embedded 135M model, 8k window): `CPU_SCALE`, which
    # `sweep.py --workload long` replays
    python benchmarks/long_context.py --rate 0.05 --duration 120 --context-scale 0.08 --decode-scale 0.25 \\
        --interception-scale 0.05 --max-context 8192 -o long.jsonl
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import contexts_at_interceptions, lognormal, write_jsonl  # noqa: E402

# tool: (share of calls, interception kind, duration (mean, sd) s, cap s, returned tokens (mean, sd)).
# Durations are lognormal (positive, right-skewed) with that mean and sd, capped (a harness timeout).
TOOLS = {
    "read_file": (0.35, "tool", (0.15, 0.1), 2.0, (2500, 2000)),  # a source file into the context
    "search": (0.20, "tool", (0.8, 0.6), 10.0, (800, 600)),  # grep / code search hits
    "run_tests": (0.25, "tool", (12.0, 15.0), 300.0, (1500, 1500)),  # a test run's log
    "build": (0.12, "tool", (40.0, 30.0), 600.0, (1000, 1000)),  # install / compile
    "approval": (0.08, "human", (60.0, 90.0), 900.0, (50, 30)),  # a human approves an edit
}
PROMPT_TOKENS = (8_000, 20_000)  # uniform
DECODE = (150, 150)  # lognormal (mean, sd) tokens per step, at least 16
STEPS = (25, 15)  # lognormal (mean, sd) steps per program, 2..80
MAX_CONTEXT = 100_000  # a 128k-window model, with room for the last steps
# Scaled down for the 2-core CPU server (embedded 135M model, 8k window): contexts ~0.6k-8k tokens, a
# quarter of the decode per step, tool times 1/20 (a 12 s test run becomes 0.6 s, an approval 3 s).
CPU_SCALE = dict(context_scale=0.08, decode_scale=0.25, interception_scale=0.05, max_context=8192)


def sample_program(rng: random.Random, *, context_scale: float = 1.0, decode_scale: float = 1.0,
                   interception_scale: float = 1.0, max_context: int = MAX_CONTEXT) -> dict:
    names = list(TOOLS)
    shares = [TOOLS[t][0] for t in names]
    prompt = max(16, round(rng.uniform(*PROMPT_TOKENS) * context_scale))
    steps = min(80, max(2, round(lognormal(rng, *STEPS))))
    context, segments = prompt, []
    for _ in range(steps):
        decode = max(1, round(max(16.0, lognormal(rng, *DECODE)) * decode_scale))
        tool = rng.choices(names, shares)[0]
        _, kind, duration, cap, returned = TOOLS[tool]
        returned_tokens = max(1, round(lognormal(rng, *returned) * context_scale))
        if context + decode + returned_tokens + decode > max_context:
            break  # the next step would not fit the window: this one is the last
        segments.append({"decode_tokens": decode,
                         "interception": {"kind": kind, "tool": tool,
                                          "duration_s": min(cap, lognormal(rng, *duration)) * interception_scale},
                         "returned_tokens": returned_tokens})
        context += decode + returned_tokens
    segments.append({"decode_tokens": max(1, round(max(16.0, lognormal(rng, *DECODE)) * decode_scale)),
                     "interception": None, "returned_tokens": 0})
    return {"augment": "coding", "prompt_tokens": prompt, "segments": segments}


def long_context_trace(rate: float, duration: float, seed: int = 0, **scales) -> list[dict]:
    """Programs arriving as a Poisson process at `rate` per second for `duration` seconds."""
    rng = random.Random(f"long-context-{seed}")
    t, out = 0.0, []
    while (t := t + rng.expovariate(rate)) <= duration:
        out.append({"id": f"c{len(out):04d}", "arrival": round(t, 4), **sample_program(rng, **scales)})
    return out


def describe(trace: list[dict]) -> str:
    contexts = [c for r in trace for c in contexts_at_interceptions(r)]
    durations = [s["interception"]["duration_s"] for r in trace for s in r["segments"] if s["interception"]]
    steps = [len(r["segments"]) for r in trace]
    q = statistics.quantiles

    def spread(xs: list[float]) -> str:
        p = q(xs, n=10)
        return f"median {statistics.median(xs):.4g}, p10 {p[0]:.4g}, p90 {p[-1]:.4g}, max {max(xs):.4g}"

    return "\n".join([f"{len(trace)} programs, {sum(steps)} steps",
                      f"steps per program: {spread(steps)}",
                      f"context at a tool call (tokens): {spread(contexts)}",
                      f"tool time (s): {spread(durations)}, mean {statistics.fmean(durations):.3g}"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, required=True, help="Poisson arrival rate, programs/s")
    p.add_argument("--duration", type=float, required=True, help="arrival window, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-scale", type=float, default=1.0, help="multiply prompt and returned tokens")
    p.add_argument("--decode-scale", type=float, default=1.0, help="multiply decode tokens per step")
    p.add_argument("--interception-scale", type=float, default=1.0, help="multiply tool times")
    p.add_argument("--max-context", type=int, default=MAX_CONTEXT, help="no step's context passes this")
    p.add_argument("-o", "--output", default=None, help="JSON lines file (default stdout)")
    p.add_argument("--describe", action="store_true", help="print statistics instead")
    args = p.parse_args(argv)
    trace = long_context_trace(args.rate, args.duration, args.seed, context_scale=args.context_scale,
                               decode_scale=args.decode_scale, interception_scale=args.interception_scale,
                               max_context=args.max_context)
    if args.describe:
        print(describe(trace))
    else:
        write_jsonl(trace, args.output)


if __name__ == "__main__":
    main()
