"""The vLLM backend under KV pressure: InferCept's policy inside vLLM against stock vLLM, same memory.

Agents arrive at `--rate` per second (Poisson, seeded), each with a `--prompt`-token prompt and `--steps`
steps: decode `--decode` tokens, call a tool that takes `--tool-s` seconds, append `--returned` tokens,
and so on (the last step finishes). The device pool holds about `--pool-tokens` tokens, so the paused
agents' KV competes with the running ones'. For each policy, `infercept serve --backend vllm --policy P`
is started alone (vLLM's engine busy-polls its cores), the trace is replayed through implicit token-level
resume (`benchmarks/replay.py --api resume`), and the server is stopped. `prefix-cache` is stock vLLM as
agent loops use it: every turn a request that ends, every resume a new request of the whole context
from the prefix cache; `infercept` keeps, swaps to its host tier or discards each paused session by
min-waste inside vLLM (`engine/vllm_backend/scheduler.py`, `host_tier.py`). Every server gets the same
device pool and `infercept` also a host pool of `--host-kv-gb` (stock vLLM V1 has no host tier for paused
requests on a CPU: its offloading connectors are CUDA-only), so `prefix-cache@total` is stock vLLM given
that host pool's bytes as device pool too: the equal-memory baseline (on a CPU both pools are the same
DRAM). Policies alternate, `--repeats` times.

    INFERCEPT_VLLM_PYTHON=/tmp/vllmenv/bin/python python benchmarks/vllm_pressure.py

Writes `<out>/vllm_pressure.json` (every run's summary and records) and prints a Markdown table of the
medians over repeats, with each policy's ratio to `infercept`.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, today  # noqa: E402
from replay import summarize  # noqa: E402
from sweep import (TOTAL, ServerProcess, free_port, kv_bytes_per_token, policy_of, replay_once,  # noqa: E402
                   system_pools)

GIB = 2 ** 30
STOCK = ("prefix-cache", "discard")  # stock vLLM: no sessions, no host tier


def agent_trace(args) -> list[dict]:
    """The trace in `benchmarks/workload.py`'s format."""
    rng = random.Random(args.seed)
    t, trace = 0.0, []
    for i in range(args.agents):
        t += rng.expovariate(args.rate)
        segments = [{"decode_tokens": args.decode, "returned_tokens": args.returned,
                     "interception": {"kind": "tool", "tool": "search", "duration_s": args.tool_s}}
                    for _ in range(args.steps - 1)]
        segments.append({"decode_tokens": args.decode, "returned_tokens": 0, "interception": None})
        trace.append({"id": f"a{i:03d}", "augment": "agent", "arrival": round(t, 3), "prompt_tokens": args.prompt,
                      "segments": segments})
    return trace


def server_argv(system: str, port: int, args, kv_cache_gb: float) -> list[str]:
    exe = str(Path(sys.executable).with_name("infercept"))
    policy, device_gb, host_gb = system_pools(system, kv_cache_gb, args.host_kv_gb)
    return [exe, "serve", "--backend", "vllm", "--policy", policy, "--port", str(port), "--dtype", args.dtype,
            "--kv-cache-gb", f"{device_gb:.6f}", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--host-kv-gb", f"{host_gb:g}", "--log-level", "warning",
            *(["--vllm-python", args.vllm_python] if args.vllm_python else [])]


def run(policy: str, trace: list[dict], args, kv_cache_gb: float, log: Path) -> dict:
    port = free_port()
    server = ServerProcess(server_argv(policy, port, args, kv_cache_gb), port, policy, log,
                           env={"VLLM_CPU_OMP_THREADS_BIND": args.cpus})
    records, elapsed, before, after = replay_once(server, trace, args)
    summary = summarize(records, elapsed)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # The pool vLLM actually made (its KV reserve rounds to blocks), from the server's own gauge.
    summary |= {"pool_blocks": after.get("infercept_kv_device_blocks_total", 0.0),
                "preemptions": delta("infercept_preemptions_total"),
                "discarded_tokens": delta("infercept_discarded_tokens_total"),
                "recomputed_tokens": delta("infercept_recomputed_tokens_total"),
                "swapped_out_blocks": delta("infercept_swapped_out_blocks_total"),
                "swapped_in_blocks": delta("infercept_swapped_in_blocks_total")}
    return {"summary": summary, "records": [r.to_dict() for r in records]}


def table(results: dict[str, list[dict]]) -> str:
    med = {p: statistics.median(r["summary"]["normalized_latency_median"] for r in runs) for p, runs in results.items()}
    # Ratios against infercept as configured, else against the first of our policies that ran.
    base = "infercept" if "infercept" in med else next((p for p in med if policy_of(p) not in STOCK), None)
    rows = [f"| policy | median normalized latency (s/token) | vs {base} | mean (s/token) | finished | "
            "median TTFT (s) | cached prompt % | preemptions | discarded tokens | recomputed tokens | "
            "swapped out / in blocks |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def m(runs, key, scale=1.0):
        return statistics.median(r["summary"][key] * scale for r in runs)

    for policy, runs in results.items():
        ratio = med[policy] / med[base] if base else float("nan")
        rows.append(f"| {policy} | {med[policy]:.4g} | {ratio:.2f}x | {m(runs, 'normalized_latency_mean'):.4g} | "
                    f"{m(runs, 'finished'):.0f}/{runs[0]['summary']['requests']} | {m(runs, 'ttft_median'):.3g} | "
                    f"{m(runs, 'cached_share', 100):.0f} | {m(runs, 'preemptions'):.0f} | "
                    f"{m(runs, 'discarded_tokens'):.0f} | {m(runs, 'recomputed_tokens'):.0f} | "
                    f"{m(runs, 'swapped_out_blocks'):.0f} / {m(runs, 'swapped_in_blocks'):.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["prefix-cache", f"prefix-cache{TOTAL}", "infercept"],
                   help=f"POLICY{TOTAL}: POLICY given the host pool's bytes as device pool too, and no host pool")
    p.add_argument("--agents", type=int, default=24)
    p.add_argument("--rate", type=float, default=4.0, help="agent arrivals per second")
    p.add_argument("--prompt", type=int, default=1000, help="prompt tokens per agent")
    p.add_argument("--steps", type=int, default=5, help="turns per agent (a tool call between two)")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded per turn")
    p.add_argument("--returned", type=int, default=32, help="tokens each tool result appends")
    p.add_argument("--tool-s", type=float, default=2.0, help="seconds each tool call takes")
    p.add_argument("--pool-tokens", type=int, default=4608, help="device KV pool, tokens")
    p.add_argument("--host-kv-gb", type=float, default=1.0,
                   help=f"host pool for swapped sessions, GiB (session policies; stock vLLM has none; POLICY{TOTAL} "
                        "gets it as device pool)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--until", type=float, default=900.0, help="cut a replay off after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for every server")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "vllm_pressure"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from infercept.engine.download import ensure_default_model

    bytes_per_token = kv_bytes_per_token(ensure_default_model(progress=False), 2 if args.dtype != "float32" else 4)
    kv_cache_gb = args.pool_tokens * bytes_per_token / GIB
    trace = agent_trace(args)
    results: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for i in range(args.repeats):
        for policy in args.policies:
            results[policy].append(run(policy, trace, args, kv_cache_gb, out / f"{policy}_{i}.log"))
            s = results[policy][-1]["summary"]
            print(f"run {i + 1}/{args.repeats} {policy}: median normalized latency {s['normalized_latency_median']:.4g} "
                  f"s/tok, {s['finished']}/{s['requests']} finished", file=sys.stderr, flush=True)
    command = "python benchmarks/vllm_pressure.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"# vLLM backend under KV pressure\n\n{cpu_name()}, {today()}; {args.agents} agents at {args.rate:g}/s, "
              f"{args.prompt}-token prompts, {args.steps} turns of {args.decode} tokens, {args.tool_s:g} s tools "
              f"returning {args.returned} tokens; a {args.pool_tokens}-token pool ({kv_cache_gb:.3f} GiB {args.dtype}) "
              f"for every policy, and for the session policies ({', '.join(p for p in args.policies if policy_of(p) not in STOCK and TOTAL not in p)}) "
              f"a {args.host_kv_gb:g} GiB host pool that stock vLLM does not have ({TOTAL}: that host pool's bytes "
              f"added to the device pool, no host pool); servers one at a time on "
              f"the same cores; {args.repeats} repeat(s). "
              f"Command: `{command.strip()}`")
    text = header + "\n\n" + table(results)
    (out / "vllm_pressure.json").write_text(json.dumps({"cpu": cpu_name(), "date": today(), "args": vars(args),
                                                        "kv_cache_gb": kv_cache_gb, "results": results}, indent=1))
    (out / "vllm_pressure.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
