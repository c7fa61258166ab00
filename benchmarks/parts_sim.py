"""The policy parts beyond the paper side by side at GPU scale, simulated: `infercept-paper`, each part alone, the
combination, and the default `infercept`, in one run, on the same traces and seeds.

The real scheduler and block manager on the modeled runner (`infercept.engine.simulation`), as in
`policy_sim.py`. Workloads (`--workloads`):

- `mix@R`: the paper's six-augment mix (`workload.py`, augments.json) at R programs/s, Poisson, on the
  H100 + Llama-3-8B setup of `policy_sim.py` (its pools), `--window` s of arrivals, `--drain` s more to
  finish, token scale `--token-scale`.
- `burst`: the ample-memory burst of `burst.py`: 24 agents, 1,000-token prompts, 5 steps of 32 tokens with a
  0.5 s tool between them (32 tokens returned), H100 setup, exact (token scale 1); arrivals spread over
  the first 0.1 s by the seed. `burst240`: 240 such agents, where resumed turns compete with new
  programs' prefill at H100 speed (24 agents' prefill takes 0.8 s there, shorter than the backlog
  measured on a CPU: benchmarks/README.md, "Ample memory").
- `burst-cpu`: the 24-agent burst on this machine's measured CPU profile (SmolLM2-135M bf16, one
  thread; `benchmarks/results/parts_sim_2026-11-24/cpu_profile.json`) with a 4 GiB pool: the cost model of
  the CPU server of benchmarks/README.md's "Ample memory" burst.
- `long@R`: coding agents (`long_context.py`: 8k-20k-token prompts growing to ~100k over ~25 steps,
  tool times from 0.15 s file reads to minutes-long builds and human approvals) at R programs/s, Poisson,
  `--long-window` s of arrivals + `--long-drain` s, on the H100 setup with attention over the context
  charged (`h100_llama3_8b(attention=True)`, `Profile.t_attention`: T_fwd alone ignores it, fine at 2k
  tokens, not at 50k), token scale
  `--token-scale`.
- `long-tight@R`: `long@R`'s traces, profile, window and drain, with a quarter of its device KV pool
  (7,045 blocks, ~113k tokens; the host pool as it is): the 8B model's compute with a quarter of its KV
  pool: a stand-in for a GPU whose memory is mostly taken by bigger weights or other tenants, not a
  measured configuration. Stated before any measurement, for a setup where KV, not compute, binds
  (`long@R` is compute-bound: `unbounded-memory` sustains only 1.2x `infercept-paper`'s programs/s).
  Rates 0.025, 0.05, 0.075, 0.1, chosen before any run from capacity alone: `long@R`'s compute bound
  sustains ~0.125 programs/s, which less memory cannot pass; at 0.025 about 8 programs are active (each
  ~300 s in its tools plus its compute), one or two of them running at a time, whose contexts (~35k
  tokens at a tool call on average) fit the pool while the paused ones' (~300k tokens) do not, so KV
  decisions matter from the lowest rate. Not in the default matrix.
- `approval@R`: agents whose tool returns in 20-100 ms nine times in ten and waits 20-40 s for an
  approval otherwise (a bimodal duration, where a mean residual and a distribution disagree), H100
  setup with no host pool (preserve or discard only).

`--profile PATH` runs every H100 workload on a profile file (`Profile.load`; `policy_sim.setup_named`)
instead of the hand-written `h100_llama3_8b()`, with the same pools; `burst-cpu` keeps its CPU profile.
A profile without attention terms (e.g. the one measured on an H100,
`benchmarks/profiles/h100_llama3_8b_measured_2026-11-26.json`) gets the hand-written ones for
`long@R` and `long-tight@R` (`with_h100_attention`): measured T_fwd and copies, the roofline's attention.

Metrics per program (= agent request): median normalized latency (the paper's), completed programs/s
within the window, p50 / p90 completion time (finish - arrival; unfinished = inf), first-turn TTFT,
resumed-step TTFT, share of resumes that found their KV on the device, recompute share of modeled
forward time, held memory waste. For every workload swept over two or more rates, the sustainable
programs/s: per seed, the highest rate whose median normalized latency stays within the SLO (2x the best
policy's latency at the lowest rate, as `policy_sim.py`), interpolated between the bracketing rates.

Bounds, not policies, run only when named in `--policies`: `unbounded-memory` (every paused context
stays, in a 20x device pool: only compute limits it), `paused-kv-free` (KV not running this step costs
nothing: free copies to a 20x host pool; the running contexts alone fill the device pool): what any
pause-time policy could reach lies below the second; `srpt-oracle` (the default with every queue ordered
by the tokens each program has left, read from the trace: what a queue order could reach if the server
knew each agent's remaining work).

    python benchmarks/parts_sim.py                                   # the default matrix, ~30 min, --jobs 2 on an idle machine
    python benchmarks/parts_sim.py --table benchmarks/results/parts_sim_2026-11-24/parts_sim.json
    python benchmarks/parts_sim.py --workloads burst --seeds 0 --policies infercept-paper prefix-cache
    python benchmarks/parts_sim.py --workloads long-tight@0.025 long-tight@0.05 long-tight@0.075 long-tight@0.1 \\
        --out benchmarks/results/parts_sim_DATE/long_tight.json     # the KV-bound setup, every policy
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import cpu_name, today  # noqa: E402
from policy_sim import MAX_CONTEXT, MAX_NUM_SEQS, setup_named  # noqa: E402
from long_context import long_context_trace  # noqa: E402
from sustain import sustainable_rate  # noqa: E402
from workload import generate_trace  # noqa: E402

from infercept.engine.policy import Profile  # noqa: E402
from infercept.engine.policy.profile import h100_llama3_8b  # noqa: E402
from infercept.engine.simulation import SimulatedEngine, coarsen_profile  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "parts_sim_2026-11-24"
CPU_PROFILE = RESULTS / "cpu_profile.json"
GIB = 1024 ** 3

# Each part alone on the paper's policy, the default `infercept` (infercept-paper + expected-waste +
# prefetch + deferred-swap, + ample-preserve where copies stall, + ample-no-discard where they overlap),
# and today's servers; the bounds only where they are asked for.
POLICIES = ("infercept-paper", "infercept-paper+program-arrival-priority", "infercept-paper+las-priority",
            "infercept-paper+expected-waste", "infercept-paper+prefetch", "infercept-paper+context-cost",
            "infercept-paper+admission", "infercept-paper+ample-preserve", "infercept-paper+ample-no-discard",
            "infercept-paper+deferred-swap",
            "infercept", "prefix-cache")
# What no KV policy can beat: `preserve` with a device pool 20x as large, so that no context is ever
# swapped, discarded or preempted; only compute limits it (`--policies unbounded-memory`).
UNBOUNDED = "unbounded-memory"
# What no pause-time KV policy can beat: `swap+swap-preemption` whose copies take no time, with a host
# pool 20x the device pool: KV that is not running this step holds no device memory, is never
# recomputed and never waits for a copy; the running contexts alone fill the device pool
# (`--policies paused-kv-free`). Between it and `unbounded-memory` is what only running KV costs.
PAUSED_KV_FREE = "paused-kv-free"
FREE_COPY_BYTES_PER_S = 1e18
# What no queue order can beat by much: the default `infercept` with every queue ordered by the tokens
# each program has left to compute, read from the trace (shortest remaining first, an oracle: no server
# knows how many steps an agent has left; `--policies srpt-oracle`). Least attained service
# (`+las-priority`) is what a server without the oracle can do.
SRPT_ORACLE = "srpt-oracle"
# Rate sweeps (two or more rates of one workload) also give the sustainable programs/s at the SLO.
WORKLOADS = ("mix@14", "mix@22", "mix@30", "long@0.05", "long@0.1", "long@0.15", "long@0.2", "burst", "burst240",
             "burst-cpu", "approval@10")
# long-tight@R's device pool is long@R's divided by this (module docstring).
LONG_TIGHT_POOL_DIVISOR = 4


def burst_trace(seed: int, n: int = 24, prompt: int = 1000, steps: int = 5, decode: int = 32, tool_s: float = 0.5,
                returned: int = 32, spread_s: float = 0.1) -> list[dict]:
    rng = random.Random(f"burst-{seed}")
    return [{"id": f"a{i:03d}", "augment": "burst", "arrival": rng.uniform(0, spread_s), "prompt_tokens": prompt,
             "segments": [{"decode_tokens": decode,
                           "interception": {"kind": "tool", "tool": "t", "duration_s": tool_s} if j < steps - 1 else None,
                           "returned_tokens": returned if j < steps - 1 else 0} for j in range(steps)]}
            for i in range(n)]


def approval_trace(seed: int, rate: float, window: float) -> list[dict]:
    rng = random.Random(f"approval-{seed}")
    t, out = 0.0, []
    while (t := t + rng.expovariate(rate)) <= window:
        steps = rng.randint(3, 8)
        out.append({"id": f"b{len(out)}", "augment": "approval", "arrival": t, "prompt_tokens": rng.randint(1000, 3000),
                    "segments": [{"decode_tokens": rng.randint(20, 60),
                                  "interception": ({"kind": "tool", "tool": "approve",
                                                    "duration_s": rng.uniform(20, 40) if rng.random() < 0.1
                                                    else rng.uniform(0.02, 0.1)} if j < steps - 1 else None),
                                  "returned_tokens": rng.randint(20, 100) if j < steps - 1 else 0}
                                 for j in range(steps)]})
    return out


@dataclass
class Workload:
    """What one workload runs: its trace, on the (coarsened) profile and pools, with its clock."""

    trace: list[dict]
    profile: Profile
    device_blocks: int
    host_blocks: int
    token_scale: int = 1
    window: float | None = None  # arrival window (s); None: a burst
    until: float | None = None  # cut-off (s); None: run until every program is done
    # The device pool `unbounded-memory` multiplies, if not its own: long-tight@R's is long@R's, so both
    # families share one compute bound, whatever the pool.
    bound_device_blocks: int | None = None


def with_h100_attention(profile: Profile) -> Profile:
    """`profile` with attention over the context charged: its own terms if it has them, else the
    hand-written H100 ones (`h100_llama3_8b(attention=True)`) on top of its T_fwd and copies. On
    `h100_llama3_8b()` this is `h100_llama3_8b(attention=True)`."""
    if profile.has_attention:
        return profile
    hand = h100_llama3_8b(attention=True)
    return dataclasses.replace(profile, attention_read_s_per_token=hand.attention_read_s_per_token,
                               attention_pair_s=hand.attention_pair_s)


def build_workload(workload: str, seed: int, args: dict) -> Workload:
    name, _, rate_text = workload.partition("@")
    rate = float(rate_text) if rate_text else None
    h100 = setup_named("h100_llama3_8b", args.get("profile"))
    device_blocks, host_blocks = h100.pool_blocks()
    profile, k, until, window = h100.profile(), 1, None, None
    bound_blocks = None
    if name in ("long", "long-tight"):
        trace = long_context_trace(rate, args["long_window"], seed)
        k, window, until = args["token_scale"], args["long_window"], args["long_window"] + args["long_drain"]
        profile = coarsen_profile(with_h100_attention(profile), k)
        if name == "long-tight":
            bound_blocks, device_blocks = device_blocks, device_blocks // LONG_TIGHT_POOL_DIVISOR
    elif name == "mix":
        trace = generate_trace(rate, duration=args["window"], seed=seed, max_context=MAX_CONTEXT)
        k, window, until = args["token_scale"], args["window"], args["window"] + args["drain"]
        profile = coarsen_profile(profile, k)
    elif name in ("burst", "burst240"):
        trace = burst_trace(seed, n=240 if name == "burst240" else 24)
    elif name == "burst-cpu":
        trace = burst_trace(seed)
        profile = Profile.load(CPU_PROFILE)
        device_blocks = 4 * GIB // (profile.bytes_per_token * profile.block_size)
        host_blocks = device_blocks
    elif name == "approval":
        trace = approval_trace(seed, rate, args["window"])
        k, window, until = args["token_scale"], args["window"], args["window"] + args["drain"]
        profile, host_blocks = coarsen_profile(profile, k), 0
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return Workload(trace, profile, device_blocks, host_blocks, k, window, until, bound_blocks)


def order_by_remaining_tokens(engine: SimulatedEngine, trace: list[dict], token_scale: int) -> None:
    """`SRPT_ORACLE`: the scheduler's queues (and who gives way to whom) ordered by the tokens the program
    has left to compute when it is queued: its whole trace's context (prompt, every step's decode and
    tool result, scaled as `run_trace` scales them) minus the tokens it has now. Ties by program arrival.
    The policy is a non-"arrival" one so that, as under least attained service, a waiting program ahead
    of a running one is admitted before it is served."""
    def scaled(n) -> int:
        return max(1, round(int(n) / token_scale))

    total = {}
    for i, spec in enumerate(sorted(trace, key=lambda r: r["arrival"])):  # run_trace's request ids
        segments = spec["segments"]
        turns = next((j + 1 for j, seg in enumerate(segments) if not seg.get("interception")), len(segments))
        total[str(spec.get("id", f"r{i}"))] = (scaled(spec["prompt_tokens"])
                                               + sum(scaled(seg["decode_tokens"]) for seg in segments[:turns])
                                               + sum(scaled(seg.get("returned_tokens", 1)) for seg in segments[:turns - 1]))
    engine.scheduler._priority = lambda request: (total[request.request_id] - request.num_tokens,
                                                  request.program_arrival)


def run_one(task: tuple[str, str, int, dict]) -> dict:
    workload, policy, seed, args = task
    s = build_workload(workload, seed, args)
    if policy == UNBOUNDED:  # a bound, not a policy: every paused context stays, in a 20x device pool
        engine = SimulatedEngine("preserve", s.profile, 20 * (s.bound_device_blocks or s.device_blocks),
                                 s.host_blocks, max_num_seqs=MAX_NUM_SEQS, token_scale=s.token_scale)
    elif policy == PAUSED_KV_FREE:  # a bound too: free copies to a 20x host pool
        free_copies = dataclasses.replace(s.profile, d2h_bytes_per_s=FREE_COPY_BYTES_PER_S,
                                          h2d_bytes_per_s=FREE_COPY_BYTES_PER_S)
        engine = SimulatedEngine("swap+swap-preemption", free_copies, s.device_blocks, 20 * s.device_blocks,
                                 max_num_seqs=MAX_NUM_SEQS, token_scale=s.token_scale)
    elif policy == SRPT_ORACLE:
        engine = SimulatedEngine("infercept+program-arrival-priority", s.profile, s.device_blocks, s.host_blocks,
                                 max_num_seqs=MAX_NUM_SEQS, token_scale=s.token_scale)
        order_by_remaining_tokens(engine, s.trace, s.token_scale)
    else:
        engine = SimulatedEngine(policy, s.profile, s.device_blocks, s.host_blocks, max_num_seqs=MAX_NUM_SEQS,
                                 token_scale=s.token_scale)
    start = time.perf_counter()
    summary = engine.run_trace(s.trace, until=s.until, window=s.window).summary()
    engine.block_manager.check_integrity()
    summary.update(workload=workload, policy=policy, seed=seed, wall_s=time.perf_counter() - start)
    if s.window is None:
        summary["completed_per_s"] = None  # a burst has no arrival window
    print(f"  {workload:>16} {policy:>45} seed {seed}: norm. {summary['normalized_latency'] * 1e3:.3g} ms/tok, "
          f"{summary['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return summary


# -- the table --------------------------------------------------------------------------------------
COLUMNS = (  # (heading, key, scale, digits)
    ("norm. latency (ms/tok)", "normalized_latency", 1e3, 3),
    ("done/s", "completed_per_s", 1, 3),
    ("completion p50 (s)", "completion_p50", 1, 3),
    ("completion p90 (s)", "completion_p90", 1, 3),
    ("first-turn TTFT (s)", "first_ttft_median", 1, 3),
    ("resumed TTFT (s)", "resumed_ttft_median", 1, 3),
    ("resumes on device", "resumes_on_device_share", 100, 3),
    ("recompute % time", "recompute_time_share", 100, 2),
    ("held waste %", "held_waste_pct", 1, 2),
)


def _fmt(x, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


def table(doc: dict) -> str:
    """One markdown table per workload: mean over seeds (min-max in brackets when they differ)."""
    rows = doc["results"]
    lines = [f"Measured {doc['date']} on {doc['machine']} (`parts_sim.py`; simulated: a model, not a measurement"
             f"{'; H100 profile ' + doc['profile'] if doc.get('profile') else ''}). Mean over seeds {', '.join(map(str, doc['seeds']))} [min-max].", ""]
    for workload in doc["workloads"]:
        lines += [f"**{workload}**", "", "| policy | " + " | ".join(c[0] for c in COLUMNS) + " |",
                  "|---|" + "---|" * len(COLUMNS)]
        for policy in doc["policies"]:
            cells = []
            for _, key, scale, digits in COLUMNS:
                vals = [r[key] * scale for r in rows if r["workload"] == workload and r["policy"] == policy
                        and r[key] is not None]
                if not vals:
                    cells.append("–")
                    continue
                mean = math.inf if any(math.isinf(v) for v in vals) else statistics.fmean(vals)
                lo, hi = min(vals), max(vals)
                spread = f" [{_fmt(lo, digits)}-{_fmt(hi, digits)}]" if _fmt(lo, digits) != _fmt(hi, digits) else ""
                cells.append(_fmt(mean, digits) + spread)
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n" + sustainable_table(doc)


def sustainable_table(doc: dict) -> str:
    """Sustainable programs/s per workload family swept over rates (`name@R` at two or more R): per seed,
    the highest rate whose median normalized latency stays within the SLO (`sustain.sustainable_rate`:
    linear between the bracketing rates), with the SLO as in `policy_sim.py`: 2x the best latency any
    policy reached at the lowest rate of that seed."""
    families: dict[str, list[tuple[float, str]]] = {}
    for workload in doc["workloads"]:
        name, _, rate = workload.partition("@")
        if rate:
            families.setdefault(name, []).append((float(rate), workload))
    lines = []
    for name, rates in families.items():
        if len(rates) < 2:
            continue
        rates.sort()
        lowest = rates[0][1]
        by_seed: dict[str, list[tuple[float, bool]]] = {p: [] for p in doc["policies"]}
        slos = []
        for seed in doc["seeds"]:
            rows = {(r["policy"], r["workload"]): r for r in doc["results"] if r["seed"] == seed}
            base = [rows[(p, lowest)]["normalized_latency"] for p in doc["policies"] if (p, lowest) in rows]
            if not base:
                continue
            slo = 2 * min(base)
            slos.append(slo)
            for policy in doc["policies"]:
                lat = {rate: rows[(policy, w)]["normalized_latency"] for rate, w in rates if (policy, w) in rows}
                by_seed[policy].append(sustainable_rate(lat, slo))
        paper = statistics.fmean(r for r, _ in by_seed.get("infercept-paper", [])) if by_seed.get("infercept-paper") else None
        lines += [f"**{name}: sustainable programs/s** (SLO per seed: 2x the best median normalized latency at "
                  f"{lowest}, {', '.join(f'{x * 1e3:.3g}' for x in slos)} ms/token; '>' = never crossed, a lower "
                  f"bound)", "", "| policy | programs/s | per seed | vs infercept-paper |", "|---|---|---|---|"]
        for policy, found in by_seed.items():
            if not found:
                continue
            mean = statistics.fmean(r for r, _ in found)
            seeds = ", ".join(f"{'' if crossed else '>'}{r:.3g}" for r, crossed in found)
            ratio = f"{mean / paper:.2f}x" if paper else "–"
            lines.append(f"| {policy} | {mean:.3g} | {seeds} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--window", type=float, default=150.0, help="arrival window of mix@R / approval@R (s)")
    p.add_argument("--drain", type=float, default=300.0, help="time after the window for programs to finish (s)")
    p.add_argument("--long-window", type=float, default=600.0, help="arrival window of long@R (s)")
    p.add_argument("--long-drain", type=float, default=1200.0, help="time after the window for long@R (s)")
    p.add_argument("--token-scale", type=int, default=16)
    p.add_argument("--profile", default=None,
                   help="profile file for the H100 workloads instead of h100_llama3_8b() (module docstring)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "parts_sim.json")
    p.add_argument("--table", type=Path, default=None, help="print the table of this result file and stop")
    args = p.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    shared = dict(window=args.window, drain=args.drain, token_scale=args.token_scale, long_window=args.long_window,
                  long_drain=args.long_drain, profile=args.profile)
    tasks = [(w, pol, s, shared) for w in args.workloads for s in args.seeds for pol in args.policies]
    start = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.Pool(args.jobs) as pool:
            results = pool.map(run_one, tasks, chunksize=1)
    else:
        results = [run_one(t) for t in tasks]
    doc = {"date": today(), "machine": cpu_name(), "command": "python benchmarks/parts_sim.py " + " ".join(argv or sys.argv[1:]),
           "policies": args.policies, "workloads": args.workloads, "seeds": args.seeds, **shared,
           "wall_s": time.perf_counter() - start, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=lambda x: None))
    args.out.with_suffix(".md").write_text(table(doc) + "\n")
    print(table(doc))


if __name__ == "__main__":
    main()
