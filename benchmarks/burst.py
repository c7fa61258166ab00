"""A burst of agents on the real server, every policy on the same trace: ample memory, or
KV pressure with predictable tools (proactive swap-in).

`--agents` agents arrive within `--spread` seconds (seeded uniform arrivals), each with a `--prompt`-token
prompt of seeded random token ids and `--steps` steps: decode `--decode` tokens, call a tool that takes
`--tool-s` seconds, append `--returned` tokens, and so on (the last step finishes). The device pool
(`--kv-cache-gb`, 4 GiB by default) holds every agent's context, so nothing is evicted: the policies
differ only in the order they serve turns in (and in whether a resumed turn keeps its KV or finds it in
the prefix cache). For each policy `infercept serve --policy P` (the embedded model) is started alone,
the burst is replayed through implicit token-level resume (`benchmarks/replay.py --api resume`), and
the server is stopped; policies alternate (A B C A B C ...) `--repeats` times, so a machine whose speed
drifts (other jobs on its cores) slows every policy alike.

    python benchmarks/burst.py --repeats 3
    python benchmarks/burst.py --policies infercept prefix-cache --step-log   # + each engine step's batch

Per run: median normalized latency ((e2e - tool time) / output tokens, over agents), median TTFT of the
first turn (from the agent's arrival) and of resumed turns (from the send), completion time p50/p90 (from
arrival, tools included). With `--step-log`, each server writes one JSON line per engine step
(`INFERCEPT_STEP_LOG`: sequences, decode sequences, prefill tokens, context tokens, seconds), and the
table gets the steps' totals. Writes `<out>/burst.json` (every run's summary, records and step totals)
and `<out>/burst.md`, and prints the table of the medians over repeats with each policy's ratio to
`prefix-cache`, and from the servers' /metrics: the share of resumes that found all their KV on the
device (`infercept_resumed_kv_total`), recomputed tokens (share of computed), swapped-out blocks.

Under KV pressure (a device pool smaller than the agents' contexts) with every tool taking the same
`--tool-s`, proactive swap-in should bring a swapped-out context back before its resume:

    python benchmarks/burst.py --kv-cache-gb 0.25 --tool-s 2 --policies infercept infercept+no-prefetch \
        --repeats 3 --out benchmarks/results/prefetch_<date>

`--server-args` adds to every server's command line, e.g. `--server-args="--backend vllm"` (vLLM's CPU
threads: `VLLM_CPU_OMP_THREADS_BIND` in the environment, which the servers inherit).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, today  # noqa: E402
from replay import summarize  # noqa: E402
from sweep import GIB, ServerProcess, engine_shares, free_port, infercept_argv, replay_once  # noqa: E402

DEFAULT_POLICIES = ("infercept", "infercept-paper", "prefix-cache")
BASELINE = "prefix-cache"


def burst_trace(args) -> list[dict]:
    """`--agents` agents within `--spread` s, in `benchmarks/workload.py`'s trace format."""
    rng = random.Random(args.seed)
    arrivals = sorted(round(rng.uniform(0.0, args.spread), 4) for _ in range(args.agents))
    trace = []
    for i, arrival in enumerate(arrivals):
        segments = [{"decode_tokens": args.decode, "returned_tokens": args.returned,
                     "interception": {"kind": "tool", "tool": "search", "duration_s": args.tool_s}}
                    for _ in range(args.steps - 1)]
        segments.append({"decode_tokens": args.decode, "returned_tokens": 0, "interception": None})
        trace.append({"id": f"a{i:03d}", "augment": "agent", "arrival": arrival, "prompt_tokens": args.prompt,
                      "segments": segments})
    return trace


def step_totals(path: Path) -> dict:
    """Totals over a server's step log (`INFERCEPT_STEP_LOG`): steps that ran tokens, their seconds,
    mean sequences per step, decode-only steps and their mean batch, prefill tokens."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = [s for s in steps if s["seqs"]]
    if not steps:
        return {}
    decode_only = [s for s in steps if not s["prefill_tokens"]]
    return {"steps": len(steps), "step_s": sum(s["s"] for s in steps),
            "mean_seqs": statistics.fmean(s["seqs"] for s in steps),
            "decode_only_steps": len(decode_only),
            "decode_only_s": sum(s["s"] for s in decode_only),
            "decode_only_mean_batch": statistics.fmean(s["seqs"] for s in decode_only) if decode_only else 0.0,
            "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
            "decode_tokens": sum(s["decode"] for s in steps)}


def run(policy: str, trace: list[dict], args, out: Path, tag: str) -> dict:
    port = free_port()
    step_log = out / f"steps_{policy}_{tag}.jsonl"
    step_log.unlink(missing_ok=True)
    env = {"INFERCEPT_STEP_LOG": str(step_log)} if args.step_log else {}
    argv = infercept_argv(policy, port, args) + shlex.split(args.server_args)
    server = ServerProcess(argv, port, policy, out / f"{policy}_{tag}.log", env)
    records, elapsed, before, after = replay_once(server, trace, args)
    summary = summarize(records, elapsed) | engine_shares(before, after, elapsed, args.kv_cache_gb * GIB)
    return {"summary": summary, "steps": step_totals(step_log), "records": [r.to_dict() for r in records]}


COLUMNS = (("norm. latency (ms/tok)", "normalized_latency_median", 1000, ".0f"),
           ("first-turn TTFT (s)", "ttft_median", 1, ".2f"),
           ("resumed TTFT (s)", "resumed_ttft_median", 1, ".2f"),
           ("completion p50 (s)", "completion_p50", 1, ".1f"),
           ("completion p90 (s)", "completion_p90", 1, ".1f"),
           ("cached prompt %", "cached_share", 1, ".0%"),
           ("resumes with KV on device", "resumes_on_device", 1, ".0%"),
           ("recomputed tokens", "recompute_token_share", 1, ".1%"),
           ("swapped-out blocks", "swapped_out_blocks", 1, ".0f"))
STEP_COLUMNS = (("steps", "steps", ".0f"), ("step s", "step_s", ".1f"), ("seqs/step", "mean_seqs", ".1f"),
                ("decode-only steps", "decode_only_steps", ".0f"), ("their batch", "decode_only_mean_batch", ".1f"),
                ("their s", "decode_only_s", ".1f"))


def table(results: dict[str, list[dict]]) -> str:
    """Medians over repeats [min-max when repeated], and the ratio of each policy's median normalized
    latency to `prefix-cache`'s."""
    with_steps = all(run["steps"] for runs in results.values() for run in runs)
    head = ["policy", *(c[0] for c in COLUMNS), f"vs {BASELINE}", *((c[0] for c in STEP_COLUMNS) if with_steps else ())]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]

    def cell(values: list[float], fmt: str) -> str:
        mid = format(statistics.median(values), fmt)
        if len(values) > 1 and min(values) != max(values):
            mid += f" [{format(min(values), fmt)}-{format(max(values), fmt)}]"
        return mid

    def latency_ms(run: dict) -> float:
        return 1000 * run["summary"]["normalized_latency_median"]

    base = statistics.median(latency_ms(r) for r in results.get(BASELINE, [])) if results.get(BASELINE) else math.nan
    for policy, runs in results.items():
        cells = [policy] + [cell([scale * r["summary"][key] for r in runs], fmt) for _, key, scale, fmt in COLUMNS]
        cells.append(f"{statistics.median(latency_ms(r) for r in runs) / base:.2f}x"
                     if results.get(BASELINE) else "-")
        if with_steps:
            cells += [cell([r["steps"][key] for r in runs], fmt) for _, key, fmt in STEP_COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    p.add_argument("--agents", type=int, default=24)
    p.add_argument("--spread", type=float, default=0.1, help="the agents arrive within this many seconds")
    p.add_argument("--prompt", type=int, default=1000, help="prompt tokens per agent")
    p.add_argument("--steps", type=int, default=5, help="turns per agent (a tool call between two)")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded per turn")
    p.add_argument("--returned", type=int, default=32, help="tokens each tool result appends")
    p.add_argument("--tool-s", type=float, default=0.5, help="seconds each tool call takes")
    p.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="device KV pool, GiB (the default is ample: nothing is evicted; smaller: KV pressure)")
    p.add_argument("--host-kv-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--idle-ttl", type=float, default=600.0)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every policy, interleaved")
    p.add_argument("--until", type=float, default=600.0, help="cut a replay off after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-log", action="store_true", help="log every engine step's batch and time")
    p.add_argument("--server-args", default="", help="more arguments for every `infercept serve`, one string "
                                                     "(e.g. \"--backend vllm\")")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / f"burst_{today()}"))
    return p.parse_args(argv)


def write(results: dict[str, list[dict]], args, out: Path, command: str) -> str:
    """Write `burst.json` and `burst.md` (after every run, so a run cut short keeps what it measured)."""
    repeats = max(len(runs) for runs in results.values())
    header = (f"# A burst of {args.agents} agents\n\n{cpu_name()}, {today()}; {args.agents} agents "
              f"within {args.spread:g} s, {args.prompt}-token prompts, {args.steps} turns of {args.decode} tokens, "
              f"{args.tool_s:g} s tools returning {args.returned} tokens; {args.kv_cache_gb:g} GiB device pool, "
              f"{args.max_num_batched_tokens}-token step budget, {args.threads} threads; servers one at a time, "
              f"policies interleaved, {repeats} repeat(s). Command: `{command}`")
    text = header + "\n\n" + table({p: runs for p, runs in results.items() if runs})
    (out / "burst.json").write_text(json.dumps({"cpu": cpu_name(), "date": today(), "args": vars(args),
                                                "command": command, "results": results}, indent=1))
    (out / "burst.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = burst_trace(args)
    command = ("python benchmarks/burst.py " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    results: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for i in range(args.repeats):
        for policy in args.policies:
            results[policy].append(run(policy, trace, args, out, str(i)))
            s = results[policy][-1]["summary"]
            print(f"run {i + 1}/{args.repeats} {policy}: {1000 * s['normalized_latency_median']:.0f} ms/tok, "
                  f"first-turn TTFT {s['ttft_median']:.2f} s, resumed {s['resumed_ttft_median']:.2f} s, resumes on "
                  f"the device {s['resumes_on_device']:.0%}", file=sys.stderr, flush=True)
            text = write(results, args, out, command)
    print(text)


if __name__ == "__main__":
    main()
