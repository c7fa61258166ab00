"""An agent workload through the REAL engine, in wall-clock time, every policy side by side.

The same kind of trace as `policy_sim.py` (`benchmarks/workload.py`, scaled down to what a CPU runs in
a few minutes) is replayed against `infercept.engine.Engine` with the embedded model in bf16 and the
engine's own measured profile, once per policy in one process: a driver loop delivers arrivals and
tool results by the wall clock, calls `engine.step()` while there is work, and sleeps until the next
event otherwise. Prompts and tool results are random token ids; every turn is greedy with
`ignore_eos`, so each segment decodes exactly its `decode_tokens`; each request is interceptible
(`InterceptParams(pause_on_stop=True)`), so the end of a segment pauses it and the driver resumes it
when the simulated tool returns. The end of the last segment also pauses it (the engine cannot know it
is the last); the driver then records it as finished and aborts it, which releases its blocks.

    python benchmarks/engine_trace.py                     # ~5 min on 2 cores, 6 policies
    python benchmarks/engine_trace.py --policies infercept discard --rate 0.5 --window 30
    python benchmarks/engine_trace.py --policies all --out benchmarks/results/engine_trace.md
    python benchmarks/engine_trace.py --smoke             # < 60 s: 2 policies, 4 requests
    python benchmarks/engine_trace.py --model DIR --json rows.json   # another model folder; rows as JSON
    python benchmarks/engine_trace.py --simulate profile.json ...    # the same trace simulated on a profile

Metrics as in `policy_sim.py`: normalized latency (median over requests of (e2e - interception time) /
output tokens), completed requests/s (finished by the end of the arrival window + drain / that time),
recompute share of forward tokens and of forward wall time (each step's time split pro rata over its
tokens), memory waste (paused KV held on the device x time, over pool bytes x run time; idle gaps
included). Absolute numbers are only comparable within one run on one machine.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import CPU_SCALE, add_scale_args, generate_trace  # noqa: E402

DEFAULT_POLICIES = ("discard", "improved-discard", "preserve", "swap", "prefix-cache", "infercept")
TOKEN_ID_RANGE = (100, 20000)


def run_policy(policy: str, trace: list[dict], *, kv_cache_gb: float, host_kv_gb: float,
               max_num_batched_tokens: int, max_num_seqs: int, threads: int, seed: int = 0,
               until_s: float | None = None, model: str | None = None, step_log: str | None = None,
               async_scheduling: bool | None = None, log=None) -> dict:
    """Replay `trace` through a fresh Engine under `policy`; returns the summary row. `step_log`: a folder
    for the engine's step log of this policy (`POLICY.jsonl`, as $INFERCEPT_STEP_LOG writes it);
    `async_scheduling`: the engine's (None: its default, on a GPU)."""
    from infercept.engine import Engine, SamplingParams
    from infercept.engine.request import InterceptParams

    saved = os.environ.get("INFERCEPT_STEP_LOG")
    if step_log:  # the engine opens $INFERCEPT_STEP_LOG when it starts, and appends: one run per file
        os.makedirs(step_log, exist_ok=True)
        path = os.path.join(step_log, f"{policy}.jsonl")
        if os.path.exists(path):
            os.remove(path)
        os.environ["INFERCEPT_STEP_LOG"] = path
    try:
        engine = Engine(model, dtype="bfloat16", kv_cache_gb=kv_cache_gb, host_kv_gb=host_kv_gb,
                        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        num_threads=threads, policy=policy, progress=False, seed=seed,
                        async_scheduling=async_scheduling)
    finally:
        if saved is None:
            os.environ.pop("INFERCEPT_STEP_LOG", None)
        else:
            os.environ["INFERCEPT_STEP_LOG"] = saved
    rng = random.Random(f"{seed}-tokens")
    lo, hi = TOKEN_ID_RANGE

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    specs = {r["id"]: r for r in trace}
    recs = {rid: {"arrival": None, "finish": None, "first": None, "intercepted": 0.0, "tokens": 0, "segment": 0}
            for rid in specs}
    seq = itertools.count()
    start = time.monotonic()
    events = [(start + r["arrival"], next(seq), "arrive", r["id"]) for r in trace]
    heapq.heapify(events)
    bm, stats = engine.block_manager, engine.stats
    pool_bytes = bm.device.num_blocks * bm.block_size * engine.profile.bytes_per_token

    def tool_of(spec):
        inter = next((s["interception"] for s in spec["segments"] if s["interception"]), None)
        return (inter or {}).get("tool") or spec.get("augment") or "tool"

    while True:
        now = time.monotonic()
        if until_s is not None and now - start >= until_s:
            break
        while events and events[0][0] <= now:
            _, _, kind, rid = heapq.heappop(events)
            spec, rec = specs[rid], recs[rid]
            seg = spec["segments"][rec["segment"]]
            if kind == "arrive":
                rec["arrival"] = now
                engine.add_request(ids(spec["prompt_tokens"]), params(seg["decode_tokens"]), request_id=rid,
                                   arrival_time=now,
                                   intercept=InterceptParams(pause_on_stop=True, expected_s=None, kind=tool_of(spec)))
            else:
                engine.resume(rid, ids(spec["segments"][rec["segment"] - 1]["returned_tokens"]),
                              params(seg["decode_tokens"]))
        if engine.has_unfinished_requests():
            computed, swaps = stats.num_computed_tokens, stats.num_swapped_in_blocks + stats.num_swapped_out_blocks
            outputs = engine.step()
            now = time.monotonic()
            d_computed = stats.num_computed_tokens - computed
            for out in outputs:
                rec = recs[out.request_id]
                if rec["first"] is None:
                    rec["first"] = now
                if not out.turn_done:
                    continue
                rec["tokens"] += len(out.token_ids)
                spec = specs[out.request_id]
                segments = spec["segments"]
                interception = segments[rec["segment"]]["interception"]
                if out.finished or rec["segment"] == len(segments) - 1 or not interception:
                    rec["finish"] = now
                    engine.abort(out.request_id)  # the last turn's pause: done, release it
                else:
                    rec["intercepted"] += interception["duration_s"]
                    rec["segment"] += 1
                    heapq.heappush(events, (now + interception["duration_s"], next(seq), "resume", out.request_id))
            progressed = d_computed or swaps != stats.num_swapped_in_blocks + stats.num_swapped_out_blocks
            if not progressed and events:
                # Nothing could be scheduled (the pool is held by paused requests): wait a little.
                _sleep_until(min(events[0][0], now + 0.005))
        elif events:
            _sleep_until(events[0][0])
        else:
            break
    duration = time.monotonic() - start
    held = stats.memory_waste_until(engine.scheduler.clock())  # over wall-clock time, idle gaps included
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    bm.check_integrity()
    leaked = (bm.device.num_blocks - bm.num_free_blocks) + (bm.host.num_blocks - bm.num_free_host_blocks)
    norm = []
    for rid, rec in recs.items():
        if rec["arrival"] is None or rec["tokens"] == 0:
            norm.append(math.inf)
            continue
        end = rec["finish"] if rec["finish"] is not None else start + duration
        norm.append((end - rec["arrival"] - rec["intercepted"]) / rec["tokens"])
    ttft = [r["first"] - r["arrival"] for r in recs.values() if r["first"] is not None]
    finished = sum(r["finish"] is not None for r in recs.values())
    row = {
        "policy": policy,
        "requests": len(trace),
        "finished": finished,
        "normalized_latency": statistics.median(norm) if norm else math.nan,
        "ttft_median": statistics.median(ttft) if ttft else math.nan,
        "completed_per_s": finished / duration,
        "recompute_token_share": stats.recompute_token_share,
        "recompute_time_share": stats.recompute_time_share,
        "held_waste_pct": 100 * held / (pool_bytes * duration),
        "swapped_out_blocks": stats.num_swapped_out_blocks,
        "discarded_tokens": stats.num_discarded_tokens,
        "steps": stats.num_steps,
        **step_times(stats),
        "duration_s": duration,
        "output_tokens": sum(r["tokens"] for r in recs.values()),
        "expected_output_tokens": sum(s["decode_tokens"] for r in trace for s in r["segments"]),
        "leaked_blocks": leaked,
        "device_blocks": bm.device.num_blocks,
        "async_scheduling": engine.async_scheduling,
    }
    if log:
        log(f"  {policy:>18}: {finished}/{len(trace)} finished in {duration:.1f} s, {stats.num_steps} steps")
    return row


def simulate_policy(policy: str, trace: list[dict], profile_path: str, *, kv_cache_gb: float, host_kv_gb: float,
                    max_num_batched_tokens: int, max_num_seqs: int, until_s: float | None = None,
                    host_ms: tuple[float, float, float] | None = None, host_overlapped: bool = False,
                    log=None, **_) -> dict:
    """The same trace through `SimulatedEngine` on a measured profile (the scheduler's code, a modeled
    runner, a virtual clock), pools sized from the same GiB: what the simulations predict for the run the
    engine made, in the same row. `schedule_ms` is the scheduler's host time on this machine, which the
    virtual clock does not charge; `host_ms` (fixed, per sequence, per step with copies) is the engine's
    host time a step that the clock does charge (`HostCost`), none by default; `host_overlapped`: only
    what of it outlasts the device's time (asynchronous scheduling)."""
    from infercept.engine.modeled_runner import HostCost
    from infercept.engine.policy import Profile
    from infercept.engine.simulation import SimulatedEngine

    profile = Profile.load(profile_path)
    block_bytes = profile.block_size * profile.bytes_per_token
    engine = SimulatedEngine(policy, profile, int(kv_cache_gb * 2**30 // block_bytes),
                             int(host_kv_gb * 2**30 // block_bytes), max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs,
                             host_cost=host_ms and HostCost(*(ms / 1e3 for ms in host_ms), overlapped=host_overlapped))
    row = engine.run_trace(trace, until=until_s).summary() | step_times(engine.stats)
    if log:
        log(f"  {policy:>18}: {row['finished']}/{len(trace)} finished in {row['duration_s']:.1f} virtual s, "
            f"{row['steps']} steps (simulated)")
    return row


def step_times(stats) -> dict:
    """A run's mean step time, the device's share of it (the forward pass to its sampled ids; the rest
    is the host's), the scheduler's host share and the forward passes' waits for swap copies
    (`EngineStats`; in a simulation the modeled passes and waits), ms."""
    steps = max(stats.num_steps, 1)
    return {"step_ms": 1e3 * stats.forward_seconds / steps, "device_ms": 1e3 * stats.device_seconds / steps,
            "schedule_ms": 1e3 * stats.schedule_host_seconds / steps,
            "copy_wait_ms": 1e3 * stats.copy_wait_seconds / steps}


def _sleep_until(t: float) -> None:
    """Sleep until monotonic time `t`."""
    time.sleep(max(t - time.monotonic(), 0.0))


def fmt(x, digits=3) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    if isinstance(x, float) and math.isnan(x):
        return "–"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def optional_ms(row: dict, key: str) -> str:
    """A step time rows of older result files may lack."""
    return "–" if row.get(key) is None else format(row[key], ".2f")


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["policy"] in ("discard", "vllm")), None)
    lines = ["| policy | finished | normalized latency (s/tok) | vs discard | completed req/s | vs discard | "
             "recompute % tokens | recompute % fwd time | held waste % | TTFT median (s) | swapped-out blocks | "
             "steps | step ms (device's, scheduler's, copy waits) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lat_ratio = tput_ratio = "–"
        if base is not None and base is not r:
            if r["normalized_latency"] > 0 and math.isfinite(base["normalized_latency"]):
                lat_ratio = f"{base['normalized_latency'] / r['normalized_latency']:.2f}x lower"
            if base["completed_per_s"] > 0:
                tput_ratio = f"{r['completed_per_s'] / base['completed_per_s']:.2f}x"
        lines.append(
            f"| {r['policy']} | {r['finished']}/{r['requests']} | {fmt(r['normalized_latency'])} | {lat_ratio} | "
            f"{fmt(r['completed_per_s'])} | {tput_ratio} | {100 * r['recompute_token_share']:.1f} | "
            f"{100 * r['recompute_time_share']:.1f} | {fmt(r['held_waste_pct'])} | {fmt(r['ttft_median'])} | "
            f"{r['swapped_out_blocks']} | {r['steps']} | {r['step_ms']:.2f} ({optional_ms(r, 'device_ms')}, "
            f"{r['schedule_ms']:.2f}, {optional_ms(r, 'copy_wait_ms')}) |")
    return "\n".join(lines)


def smoke(policies=("infercept", "discard"), log=None) -> list[dict]:
    """A few requests, tiny contexts and interceptions: well under a minute with the model cached."""
    trace = generate_trace(2.0, num_requests=4, seed=1, augment="mixed", context_scale=0.05, decode_scale=0.08,
                           interception_scale=0.01, max_interceptions=2, max_context=128)
    return _run_all(policies, trace, dict(kv_cache_gb=0.004, host_kv_gb=0.01, max_num_batched_tokens=64,
                                          max_num_seqs=16, threads=1, until_s=120.0), log)


def _run_all(policies, trace, kw, log=None) -> list[dict]:
    import torch

    threads = torch.get_num_threads()
    try:
        return [run_policy(p, trace, **kw, log=log) for p in policies]
    finally:
        torch.set_num_threads(threads)  # Engine(num_threads=...) sets it process-wide


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), help="or 'all'")
    parser.add_argument("--augment", default="mixed")
    parser.add_argument("--rate", type=float, default=0.4, help="Poisson arrivals, requests/s")
    parser.add_argument("--window", type=float, default=25.0, help="arrival window, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gb", type=float, default=0.03,
                        help="device KV pool, GiB (small on purpose: paused requests must compete for it)")
    parser.add_argument("--host-kv-gb", type=float, default=0.1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (machine is shared)")
    parser.add_argument("--until", type=float, default=240.0, help="stop a policy's run after this many seconds")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--step-log", metavar="DIR", default=None,
                        help="write each policy's engine step log (one JSON line a step) to DIR/POLICY.jsonl")
    parser.add_argument("--simulate", metavar="PROFILE_JSON", default=None,
                        help="replay the trace in SimulatedEngine on this measured profile instead of the engine "
                             "(e.g. a GPU check's profile.json), pools from the same --kv-cache-gb / --host-kv-gb")
    parser.add_argument("--host-ms", nargs=3, type=float, metavar=("FIXED", "PER_SEQUENCE", "SWAP_STEP"), default=None,
                        help="with --simulate: charge each step the host's time the device does not hide, ms "
                             "(a fit to an engine's step logs: benchmarks/gpu/host_cost.py); default none")
    parser.add_argument("--host-overlapped", action="store_true",
                        help="with --host-ms: the host's time runs while the step before computes (the native "
                             "engine's --async-scheduling); a step is charged only what outlasts its device time")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine plans each step while the one before computes (default: the engine's "
                             "own, on a GPU); --no-async-scheduling for the synchronous plan side by side")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--json", default=None, help="also write the rows and the command (JSON) to this file")
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    add_scale_args(parser)
    parser.set_defaults(**CPU_SCALE)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.policies == ["all"]:
        from infercept.engine.policy import POLICIES
        args.policies = list(dict.fromkeys(n for n in POLICIES if n != "vllm"))
    if args.smoke:
        explicit = args.policies != list(DEFAULT_POLICIES)
        rows = smoke(tuple(args.policies) if explicit else ("discard", "infercept"), log=log)
    else:
        trace = generate_trace(args.rate, duration=args.window, seed=args.seed, augment=args.augment,
                               context_scale=args.context_scale, decode_scale=args.decode_scale,
                               interception_scale=args.interception_scale,
                               max_interceptions=args.max_interceptions, max_context=args.max_context)
        log(f"{len(trace)} requests, {sum(len(r['segments']) - 1 for r in trace)} interceptions, "
            f"{sum(s['decode_tokens'] for r in trace for s in r['segments'])} output tokens")
        kw = dict(kv_cache_gb=args.kv_cache_gb, host_kv_gb=args.host_kv_gb,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  threads=args.threads, until_s=args.until, model=args.model)
        if args.async_scheduling is not None and not args.simulate:
            kw["async_scheduling"] = args.async_scheduling
        if args.step_log and not args.simulate:
            kw["step_log"] = args.step_log
        if args.simulate:
            rows = [simulate_policy(p, trace, args.simulate, **kw, host_ms=args.host_ms,
                                    host_overlapped=args.host_overlapped, log=log)
                    for p in args.policies]
        else:
            rows = _run_all(args.policies, trace, kw, log)
    text = table(rows)
    print(text)
    config = " ".join(sys.argv[1:] if argv is None else argv) or "(defaults)"
    if args.out:
        with open(args.out, "w") as f:
            kind = "simulated on a measured profile, virtual clock" if args.simulate else "real engine, wall clock"
            f.write(f"# Engine trace ({kind})\n\n`python benchmarks/engine_trace.py {config}`\n\n{text}\n")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"command": f"python benchmarks/engine_trace.py {config}", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
