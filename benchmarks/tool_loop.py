"""One agent's tool loop over the official openai SDK, against a server per policy: what a resumed
step costs when nothing else runs (the regime of a single developer's agent, not of a loaded server).

Every policy's server is started as a user would start it (`infercept serve --policy P`, defaults
otherwise but one thread and a 0.5 GiB device pool, ample for one agent), then loops run interleaved
(policy after policy, repeat after repeat): a ~1,800-token system prompt (unique per loop, so no loop
hits another's prefix cache), a forced call of `get_weather`, the tool result, and so on for `--steps`
steps. Streamed; the time to the first
generated delta (text or tool call) is the step's TTFT; `cached_tokens` is the server's own report.

    python benchmarks/tool_loop.py                     # discard vs infercept, 3 loops of 4 steps
    python benchmarks/tool_loop.py --policies discard prefix-cache swap infercept
    python benchmarks/tool_loop.py --backend vllm      # the same on the vLLM backend (one server at a time:
                                                       # vLLM's idle engine busy-polls its cores)
    python benchmarks/tool_loop.py --backend vllm --policies prefix-cache@total infercept
                                                       # stock vLLM given the host pool's bytes as device pool

Writes `<out>/tool_loop.json` (every step of every loop) and `<out>/tool_loop.md` (medians over the
resumed steps, and each policy's ratio to infercept).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, today  # noqa: E402
from replay import default_model  # noqa: E402
from sweep import TOTAL, ServerProcess, free_port, system_pools  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Perth"]


def document(sections: int) -> str:
    """A reference text of ~26 tokens per section (70 sections: a ~1,800-token system prompt)."""
    return " ".join(f"Section {i + 1}: {CITIES[i % 8]} has markets, museums, a river, old streets and parks."
                    for i in range(sections))


def streamed_step(client: openai.OpenAI, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed step: its TTFT, usage and the tool calls it made."""
    start = time.perf_counter()
    ttft, calls, usage = None, {}, None
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=FORCED,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - start
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    details = usage.prompt_tokens_details if usage is not None else None
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (details.cached_tokens or 0) if details else 0,
            "calls": [calls[i] for i in sorted(calls)]}


def run_loop(client: openai.OpenAI, model: str, steps: int, max_tokens: int, sections: int = 70) -> list[dict]:
    nonce = uuid.uuid4().hex[:12]  # no loop reuses another's prefix
    messages = [{"role": "system", "content": f"Session {nonce}. You are a travel assistant; use the tools. "
                                              f"Reference:\n{document(sections)}"},
                {"role": "user", "content": "What is the weather in each city of the reference? Check them one by one."}]
    records = []
    for step in range(steps):
        record = streamed_step(client, model, messages, max_tokens)
        record["step"] = step
        records.append(record)
        if not record["calls"]:
            raise RuntimeError(f"step {step} made no tool call; the forced call must produce one")
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in record["calls"]]})
        for c in record["calls"]:
            city = CITIES[(step + len(c["arguments"])) % len(CITIES)]
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": json.dumps({"city": city, "temperature": 12 + step, "sky": "clear"})})
    return records


def summarize(loops: list[list[dict]]) -> dict:
    resumed = [r for loop in loops for r in loop if r["step"] > 0]
    first = [loop[0] for loop in loops]
    return {"loops": len(loops), "resumed_steps": len(resumed),
            "first_ttft_median_s": statistics.median(r["ttft_s"] for r in first),
            "resumed_ttft_median_s": statistics.median(r["ttft_s"] for r in resumed),
            "resumed_prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in resumed),
            "resumed_cached_share": sum(r["cached_tokens"] for r in resumed) / sum(r["prompt_tokens"] for r in resumed)}


def report(summaries: dict[str, dict], header: str) -> str:
    base = summaries.get("infercept")
    lines = [header, "", "| policy | loops | first-step TTFT (s) | resumed-step TTFT, median (s) | resumed prompt "
             "tokens, median | cached on resumed steps | resumed TTFT / infercept's |", "|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        ratio = f"{s['resumed_ttft_median_s'] / base['resumed_ttft_median_s']:.2f}x" if base else "–"
        lines.append(f"| {name} | {s['loops']} | {s['first_ttft_median_s']:.3f} | {s['resumed_ttft_median_s']:.3f} | "
                     f"{s['resumed_prompt_tokens_median']:.0f} | {100 * s['resumed_cached_share']:.1f}% | {ratio} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def servers_of(policies: list[str], args, out: Path):
    """`infercept serve` per policy, up and healthy; stopped on the way out."""
    exe = str(Path(sys.executable).with_name("infercept"))
    servers = {}
    try:
        for system in policies:
            port = free_port()
            policy, device_gb, host_gb = system_pools(system, args.kv_cache_gb, args.host_kv_gb)
            argv = [exe, "serve", "--policy", policy, "--port", str(port), "--threads", str(args.threads),
                    "--kv-cache-gb", f"{device_gb:g}", "--host-kv-gb", f"{host_gb:g}", "--log-level", "warning"]
            if args.backend == "vllm":
                argv += ["--backend", "vllm", *(["--vllm-python", args.vllm_python] if args.vllm_python else [])]
            servers[system] = ServerProcess(argv, port, system, out / f"{system}.log",
                                            env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"})
        for server in servers.values():
            server.wait_ready(timeout=900)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def one_loop(server: ServerProcess, policy: str, i: int, args) -> list[dict]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    steps = run_loop(client, default_model(server.base_url), args.steps, args.max_tokens)
    print(f"loop {i + 1}/{args.loops} {policy}: resumed TTFT " + ", ".join(f"{r['ttft_s']:.3f}" for r in steps[1:])
          + " s; cached " + ", ".join(str(r["cached_tokens"]) for r in steps[1:]), file=sys.stderr)
    return steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["discard", "infercept"],
                   help=f"POLICY{TOTAL}: POLICY given the host pool's bytes as device pool too, and no host pool")
    p.add_argument("--loops", type=int, default=3, help="loops per policy, interleaved")
    p.add_argument("--steps", type=int, default=4, help="tool calls per loop (all but the first resume)")
    p.add_argument("--max-tokens", type=int, default=40, help="per step: enough for one forced call")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server (the others stay idle)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5,
                   help="device KV pool of every server (the default takes a share of free memory, so "
                        "several servers at once would not fit)")
    p.add_argument("--host-kv-gb", type=float, default=1.0, help="host KV pool of every server (the server's default)")
    p.add_argument("--backend", choices=("native", "vllm"), default="native")
    p.add_argument("--vllm-python", default=None, help="--backend vllm: the vLLM environment's python")
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "tool_loop"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loops: dict[str, list] = {policy: [] for policy in args.policies}
    if args.backend == "native":  # every server up at once, loops interleaved
        with servers_of(args.policies, args, out) as servers:
            for i in range(args.loops):
                for policy in args.policies:
                    loops[policy].append(one_loop(servers[policy], policy, i, args))
    else:  # one server at a time, all its loops
        for policy in args.policies:
            with servers_of([policy], args, out) as servers:
                for i in range(args.loops):
                    loops[policy].append(one_loop(servers[policy], policy, i, args))
    summaries = {policy: summarize(runs) for policy, runs in loops.items()}
    backend = "" if args.backend == "native" else " --backend vllm"
    header = (f"# Tool loop over the openai SDK, one agent, idle server ({args.backend} backend)\n\n{cpu_name()}, "
              f"{args.threads} thread(s), {args.kv_cache_gb:g} GiB of device KV and {args.host_kv_gb:g} GiB of host KV per "
              f"server ({TOTAL}: both as device KV), {today()}; "
              f"{args.loops} loops x {args.steps} forced calls per policy, "
              f"{'interleaved' if args.backend == 'native' else 'one server at a time'}. Command: "
              f"`python benchmarks/tool_loop.py --policies {' '.join(args.policies)} --loops {args.loops} "
              f"--steps {args.steps}{backend}`")
    (out / "tool_loop.json").write_text(json.dumps({"cpu": cpu_name(), "date": today(),
                                                    "args": vars(args), "summaries": summaries, "loops": loops},
                                                   indent=1))
    text = report(summaries, header)
    (out / "tool_loop.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
