"""Seeded agent-workload traces from the paper's augment profiles (`augments.json`).

Six augment types (paper §2.2, Table 1): math (calculator), qa (Wikipedia), ve (ALFWorld), chatbot
(human turns), image (Stable Diffusion + human), tts (Bark + human); one of them alone or the paper's
headline workload, the uniform mix (`--augment mixed`). Arrivals are Poisson at `--rate` requests/s.

    python benchmarks/workload.py --augment mixed --rate 2 --duration 1800 --seed 0 -o trace.jsonl
    python benchmarks/workload.py --augment qa --rate 1 --num-requests 200 --describe
    # shrunk for a CPU engine: a quarter of the context, 1/20 of the interception time
    python benchmarks/workload.py --rate 0.5 --duration 60 --context-scale 0.25 --decode-scale 0.2 \\
        --interception-scale 0.05 --max-interceptions 4 -o small.jsonl
    # the preset the real-server sweep uses (embedded 135M model, 2 CPU cores), one augment alone
    python benchmarks/workload.py --augment tts --rate 0.5 --duration 60 --cpu-scale -o tts.jsonl

Trace format: JSON lines, one agent request per line, sorted by arrival::

    {"id": "r00012",                 # unique request id
     "augment": "qa",                # augment type it was drawn from
     "arrival": 5.83,                # seconds since the start of the trace
     "prompt_tokens": 1622,          # tokens of the initial prompt
     "segments": [                   # decode, interception, resume ... ; the last segment finishes
        {"decode_tokens": 41,        # tokens the model generates in this segment, then it is intercepted
         "interception": {"kind": "tool",      # augments.json kind: tool / env / human / model
                          "tool": "qa",        # which tool (duration history is kept per tool)
                          "duration_s": 0.71}, # seconds from the pause until the result arrives
         "returned_tokens": 162},    # tokens the interception appends before the next segment
        ...,
        {"decode_tokens": 37, "interception": null, "returned_tokens": 0}]}

How each field is drawn from augments.json (every (mean, spread) pair is read as mean and standard
deviation, see its "about"; positive quantities are drawn from a lognormal with that mean and standard
deviation, because they are positive and right-skewed, e.g. chatbot contexts 753 +- 703):

- number of interceptions: "interceptions", rounded, at least 1 (`--max-interceptions` caps it);
  the request has that many interceptions and one more segment after the last;
- decode tokens per segment: "decode_tokens_assumed", at least 1;
- returned tokens per interception: "return_tokens_assumed", at least 1;
- interception duration: "interception_s";
- context: "context_tokens" is the context length *when an interception happens*. One draw per request
  is that request's mean context at its interceptions; the prompt is sized so that the contexts at its
  interceptions (prompt + decoded + returned tokens so far) average that draw, floored at
  `MIN_PROMPT_TOKENS`. (The context grows during a request, so one draw per interception would not be
  a consistent request.)

Knobs to fit a smaller target: `--context-scale` multiplies the context draw and the returned tokens
(the context that enters the model from outside), `--decode-scale` the decode tokens,
`--interception-scale` the durations, `--max-context` truncates prompts to 3/4 of it and drops
trailing segments so that no context exceeds it (the model's window). All scales default to 1 (the paper's profile).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

AUGMENTS = ("math", "qa", "ve", "chatbot", "image", "tts")
MIN_PROMPT_TOKENS = 8
# `--cpu-scale`: the paper's profile shrunk to what the embedded 135M model on 2 CPU cores serves in
# minutes (~1k prompt tokens/s prefill, ~100 tokens/s batched decode): contexts ~200 tokens instead of
# ~1.5k, ~10 decode tokens per segment, interceptions 1/20 as long (a 0.7 s Wikipedia call becomes
# 35 ms, a 30 s human turn 1.5 s), at most 4 interceptions, contexts within 640 tokens.
CPU_SCALE = dict(context_scale=0.12, decode_scale=0.25, interception_scale=0.05, max_interceptions=4,
                 max_context=640)
DEFAULT_PROFILES = Path(__file__).with_name("augments.json")


def load_profiles(path: str | os.PathLike | None = None) -> dict:
    """The augments.json document (the project's copy beside this file unless `path` is given)."""
    with open(path or DEFAULT_PROFILES) as f:
        return json.load(f)


def lognormal(rng: random.Random, mean: float, sd: float) -> float:
    """A positive draw with the given mean and standard deviation (mean itself if sd == 0)."""
    if sd <= 0:
        return mean
    sigma2 = math.log1p((sd / mean) ** 2)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


def _count(rng: random.Random, pair, scale: float = 1.0, minimum: int = 1) -> int:
    return max(minimum, round(lognormal(rng, *pair) * scale))


def sample_request(rng: random.Random, augment: str, profile: dict, *, context_scale: float = 1.0,
                   decode_scale: float = 1.0, interception_scale: float = 1.0,
                   max_interceptions: int | None = None, max_context: int | None = None) -> dict:
    """One agent request of type `augment` (no id or arrival yet)."""
    n = _count(rng, profile["interceptions"])
    if max_interceptions is not None:
        n = max(1, min(n, max_interceptions))
    decode = [_count(rng, profile["decode_tokens_assumed"], decode_scale) for _ in range(n + 1)]
    returned = [_count(rng, profile["return_tokens_assumed"], context_scale) for _ in range(n)]
    durations = [lognormal(rng, *profile["interception_s"]) * interception_scale for _ in range(n)]
    # Context at interception j, not counting the prompt: decode_1..j + returned_1..j-1.
    growth, total = [], 0
    for j in range(n):
        total += decode[j]
        growth.append(total)
        total += returned[j]
    target = lognormal(rng, *profile["context_tokens"]) * context_scale
    prompt = max(MIN_PROMPT_TOKENS, round(target - statistics.fmean(growth)))
    segments = [{"decode_tokens": decode[j],
                 "interception": {"kind": profile["kind"], "tool": augment, "duration_s": round(durations[j], 6)},
                 "returned_tokens": returned[j]} for j in range(n)]
    segments.append({"decode_tokens": decode[n], "interception": None, "returned_tokens": 0})
    if max_context is not None:
        if max_context < 2 * MIN_PROMPT_TOKENS:
            raise ValueError(f"max_context={max_context} is too small")
        prompt = min(prompt, max_context * 3 // 4)  # truncated, like the paper's long contexts (App. A)
        segments = _fit_context(prompt, segments, max_context)
    return {"augment": augment, "prompt_tokens": prompt, "segments": segments}


def _fit_context(prompt: int, segments: list[dict], max_context: int) -> list[dict]:
    """Keep the longest prefix of segments whose context stays within `max_context`; the last one kept
    becomes the final segment (and is shortened if even it would not fit)."""
    kept, context = [], prompt
    for seg in segments:
        room = max_context - context
        if seg["decode_tokens"] >= room or not seg["interception"]:
            kept.append({"decode_tokens": max(1, min(seg["decode_tokens"], room - 1)), "interception": None,
                         "returned_tokens": 0})
            return kept
        context += seg["decode_tokens"]
        if context + seg["returned_tokens"] + 1 >= max_context:
            kept.append({**seg, "interception": None, "returned_tokens": 0})
            return kept
        kept.append(seg)
        context += seg["returned_tokens"]
    return kept


def generate_trace(rate: float, *, duration: float | None = None, num_requests: int | None = None,
                   augment: str = "mixed", seed: int = 0, profiles: dict | None = None,
                   context_scale: float = 1.0, decode_scale: float = 1.0, interception_scale: float = 1.0,
                   max_interceptions: int | None = None, max_context: int | None = None) -> list[dict]:
    """Poisson arrivals at `rate`/s for `duration` seconds (or `num_requests` requests, or both: first
    limit reached). `augment` is one of AUGMENTS or "mixed" (the mix's weights from augments.json)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    if duration is None and num_requests is None:
        raise ValueError("give a duration or a number of requests")
    doc = profiles or load_profiles()
    if augment == "mixed":
        weights = doc["mixed"]["weights"]
        names, w = list(weights), list(weights.values())
    elif augment in doc["augments"]:
        names, w = [augment], [1]
    else:
        raise ValueError(f"unknown augment {augment!r}; choose mixed or one of {', '.join(doc['augments'])}")
    # Separate streams, so arrivals do not shift when a knob changes how much a request draws.
    arrivals_rng = random.Random(f"{seed}-arrivals")
    rng = random.Random(f"{seed}-requests")
    trace, t = [], 0.0
    while num_requests is None or len(trace) < num_requests:
        t += arrivals_rng.expovariate(rate)
        if duration is not None and t >= duration:
            break
        name = rng.choices(names, weights=w)[0]
        request = sample_request(rng, name, doc["augments"][name], context_scale=context_scale,
                                 decode_scale=decode_scale, interception_scale=interception_scale,
                                 max_interceptions=max_interceptions, max_context=max_context)
        trace.append({"id": f"r{len(trace):05d}", "augment": name, "arrival": round(t, 6), **request})
    return trace


def write_jsonl(trace: Iterable[dict], path: str | os.PathLike | None) -> None:
    out = sys.stdout if path in (None, "-") else open(path, "w")
    try:
        for request in trace:
            out.write(json.dumps(request, separators=(",", ":")) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def contexts_at_interceptions(request: dict) -> list[int]:
    ctx, out = request["prompt_tokens"], []
    for seg in request["segments"]:
        ctx += seg["decode_tokens"]
        if seg["interception"]:
            out.append(ctx)
        ctx += seg["returned_tokens"]
    return out


def describe(trace: list[dict]) -> str:
    """Markdown table of what the trace drew, per augment, to compare with augments.json."""
    rows = ["| augment | requests | interceptions/req | interception s | context at interception | "
            "decode tokens/segment | returned tokens |", "|---|---|---|---|---|---|---|"]
    for name in sorted({r["augment"] for r in trace}, key=lambda a: AUGMENTS.index(a) if a in AUGMENTS else 99):
        reqs = [r for r in trace if r["augment"] == name]
        inter = [len([s for s in r["segments"] if s["interception"]]) for r in reqs]
        durs = [s["interception"]["duration_s"] for r in reqs for s in r["segments"] if s["interception"]]
        ctx = [c for r in reqs for c in contexts_at_interceptions(r)]
        dec = [s["decode_tokens"] for r in reqs for s in r["segments"]]
        ret = [s["returned_tokens"] for r in reqs for s in r["segments"] if s["interception"]]

        def ms(xs, fmt="{:.3g}"):
            if not xs:
                return "-"
            sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
            return f"{fmt.format(statistics.fmean(xs))} ± {fmt.format(sd)}"

        rows.append(f"| {name} | {len(reqs)} | {ms(inter)} | {ms(durs)} | {ms(ctx)} | {ms(dec)} | {ms(ret)} |")
    return "\n".join(rows)


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-scale", type=float, default=1.0,
                        help="multiply context lengths and returned tokens (default 1: the paper's profile)")
    parser.add_argument("--decode-scale", type=float, default=1.0, help="multiply decode tokens per segment")
    parser.add_argument("--interception-scale", type=float, default=1.0, help="multiply interception durations")
    parser.add_argument("--max-interceptions", type=int, default=None, help="cap interceptions per request")
    parser.add_argument("--max-context", type=int, default=None, help="drop trailing segments beyond this context")
    parser.add_argument("--cpu-scale", action="store_true",
                        help=f"use the 2-core CPU preset {CPU_SCALE} (explicit knobs given after it still apply)")


def scale_knobs(args: argparse.Namespace) -> dict:
    """The generate_trace keyword arguments the scale flags of `add_scale_args` ask for. With
    `--cpu-scale`, a knob left at its default takes the CPU preset's value."""
    knobs = {k: getattr(args, k) for k in CPU_SCALE}
    if args.cpu_scale:
        defaults = dict(context_scale=1.0, decode_scale=1.0, interception_scale=1.0, max_interceptions=None,
                        max_context=None)
        knobs = {k: CPU_SCALE[k] if v == defaults[k] else v for k, v in knobs.items()}
    return knobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--augment", default="mixed", choices=("mixed",) + AUGMENTS)
    parser.add_argument("--rate", type=float, required=True, help="Poisson arrival rate, requests/s")
    parser.add_argument("--duration", type=float, default=None, help="arrival window, seconds")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profiles", default=None, help=f"augments.json (default {DEFAULT_PROFILES})")
    add_scale_args(parser)
    parser.add_argument("-o", "--output", default=None, help="JSON lines file (default stdout)")
    parser.add_argument("--describe", action="store_true", help="print per-augment statistics instead")
    args = parser.parse_args(argv)
    if args.duration is None and args.num_requests is None:
        parser.error("give --duration or --num-requests")
    trace = generate_trace(args.rate, duration=args.duration, num_requests=args.num_requests,
                           augment=args.augment, seed=args.seed, profiles=load_profiles(args.profiles),
                           **scale_knobs(args))
    if args.describe:
        print(describe(trace))
    else:
        write_jsonl(trace, args.output)


if __name__ == "__main__":
    main()
