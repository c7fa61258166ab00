"""What waiting agents cost the agents that run: per-step time with thousands of paused generations.

Two measurements (issue "Thousands of waiting agents cost nothing"):

- `--sim`: the real scheduler on the simulated engine (H100 + Llama-3-8B profile, virtual clock). N
  agents paused on a slow call (16-token contexts, client hint 3600 s), then 8 requests of 1,000-token
  prompts decode; the wall-clock time of each engine step (scheduler, block manager, accounting and
  the modeled runner's bookkeeping; no model) is timed over 200 decode steps, median reported. Each
  policy runs with event-driven planning (the default) and with `event_driven=False` (every holder of
  device KV planned every step), same state.
- `--server`: the real HTTP server with the embedded model. N paused generations are created through
  `/v1/completions` (15-token prompts of fresh ids + 1 generated token, `intercept` with `expected_s`
  3600), then one request decodes 128 tokens (greedy, EOS ignored) while they wait; decode speed =
  (tokens - 1) / (last token - first token) of its stream, median of 3. Where the paused KV lives and how
  many paused generations the server aborted are read from /metrics.

    .venv/bin/python benchmarks/paused_scale.py --sim --server       # ~10 min on 2 cores
    .venv/bin/python benchmarks/paused_scale.py --sim --paused 10 100 # a quick look

Writes `<out>/paused_scale.json` and `<out>/paused_scale.md` (default benchmarks/results/paused_scale).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import cpu_name, today  # noqa: E402
from sweep import ServerProcess, free_port  # noqa: E402

from infercept.engine.policy.profile import h100_llama3_8b  # noqa: E402
from infercept.engine.simulation import SimulatedEngine  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "paused_scale"
SIM_PAUSED = (10, 100, 1000, 10_000)
SERVER_PAUSED = (0, 2000, 10_000)
SIM_POLICIES = ("infercept", "prefix-cache", "preserve")
PAUSED_PROMPT, DECODE_TOKENS, DECODING_REQUESTS, TIMED_STEPS = 15, 128, 8, 200
WAIT_HINT_S = 3600.0


# -- simulation ------------------------------------------------------------------------------------
def sim_step_ms(policy: str, num_paused: int, loop: str) -> dict:
    """Median wall-clock ms of one engine step with `num_paused` agents waiting and 8 decoding. `loop`:
    "event-driven", "every step", or "before" (code without the paused-KV index, run from an older
    checkout for a before/after comparison; see benchmarks/README)."""
    profile = h100_llama3_8b()
    blocks = 2 * num_paused + DECODING_REQUESTS * 200 + 64  # room for every context on either side
    engine = SimulatedEngine(policy, profile, num_device_blocks=blocks, num_host_blocks=blocks)
    for _ in range(num_paused):
        engine.add_request(PAUSED_PROMPT, 1, expected_s=WAIT_HINT_S)
    while engine.has_work():
        engine.step()
    # Set up event-driven (quick), then plan the way being timed: both make the same decisions (tests).
    index = getattr(engine.scheduler, "paused_kv", None)
    if index is not None:
        index.event_driven = loop == "event-driven"
    for _ in range(DECODING_REQUESTS):
        engine.add_request(1000, 10 ** 6, last_turn=True)
    held = -1
    for _ in range(5000):  # prefill, and let budgeted swap-outs finish: time the steady state
        engine.step()
        if not engine.scheduler.waiting and engine.paused_device_tokens() == held:
            break
        held = engine.paused_device_tokens()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    sched = engine.scheduler
    states = [kv_state(*sched.kv_tokens(r)) for r in sched.paused.values()]
    return {"policy": policy, "paused": num_paused, "loop": loop,
            "step_ms": 1000 * statistics.median(times), "step_ms_p90": 1000 * statistics.quantiles(times, n=10)[-1],
            "paused_by_state": {state: states.count(state) for state in ("device", "host", "partial", "discarded")}}


def kv_state(device: int, host: int) -> str:
    """engine.paused_kv.kv_state, here too because the "before" run imports a checkout without it."""
    return "partial" if device and host else "device" if device else "host" if host else "discarded"


def run_sim(paused_counts: list[int], policies: list[str]) -> list[dict]:
    indexed = "event_driven" in inspect.signature(SimulatedEngine).parameters
    loops = ("event-driven", "every step") if indexed else ("before",)
    rows = []
    with tqdm(total=len(paused_counts) * len(policies) * len(loops), desc="simulated steps", file=sys.stderr) as bar:
        for policy in policies:
            for n in paused_counts:
                for loop in loops:
                    rows.append(sim_step_ms(policy, n, loop))
                    bar.update()
    return rows


# -- the real server ---------------------------------------------------------------------------------
async def _pause_many(http: httpx.AsyncClient, model: str, count: int, rng: random.Random,
                      concurrency: int = 32) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            prompt = [rng.randrange(1000, 30000) for _ in range(PAUSED_PROMPT)]
            r = await http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "intercept": {"kind": "tool", "expected_s": WAIT_HINT_S}})
            r.raise_for_status()

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    for task in tqdm(asyncio.as_completed(tasks), total=count, desc="pausing agents", file=sys.stderr):
        await task


async def _decode_speed(http: httpx.AsyncClient, model: str, rng: random.Random) -> float:
    """Tokens/s of one streamed request between its first and last token."""
    prompt = [rng.randrange(1000, 30000) for _ in range(32)]
    stamps = []
    async with http.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": DECODE_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"the decode request streamed {len(stamps)} chunks")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _paused_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"paused_by_state": {}, "aborted": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "infercept_paused_requests":
                out["paused_by_state"][s.labels["kv_state"]] = int(s.value)
            elif s.name == "infercept_paused_evictions_total":
                out["aborted"] += s.value
    return out


async def _server_rows(base_url: str, paused_counts: list[int]) -> list[dict]:
    rng = random.Random(0)
    rows = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await _decode_speed(http, model, rng)  # warm-up
        held = 0
        for n in sorted(paused_counts):
            await _pause_many(http, model, n - held, rng)
            held = n
            await asyncio.sleep(2.0)  # the policy's decisions for the fresh pauses
            speeds = [await _decode_speed(http, model, rng) for _ in range(3)]
            metrics = _paused_metrics((await http.get("/metrics")).text)
            rows.append({"paused": n, "decode_tok_s": statistics.median(speeds), "runs": speeds, **metrics})
    return rows


def run_server(paused_counts: list[int], threads: int | None, logs: Path, extra: list[str]) -> list[dict]:
    exe = Path(sys.executable).with_name("infercept")
    port = free_port()
    argv = [str(exe), "serve", "--port", str(port), "--log-level", "warning",
            *(["--threads", str(threads)] if threads else []), *extra]
    logs.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(argv, port, "infercept (defaults)", logs / "server.log")
    try:
        server.wait_ready(900)
        return asyncio.run(_server_rows(server.base_url, paused_counts))
    finally:
        server.stop()


# -- report --------------------------------------------------------------------------------------
def report(result: dict) -> str:
    lines = [f"# Paused generations vs step cost ({result['date']}, {result['machine']})", ""]
    if result.get("sim"):
        loops = list(dict.fromkeys(r["loop"] for r in result["sim"]))
        lines += ["## Simulated engine, H100 + Llama-3-8B profile, 8 requests decoding",
                  "", "Median wall-clock ms per engine step (p90 in parentheses), by how paused requests are "
                  "planned; where the paused KV lives after the policy's decisions.", "",
                  f"| policy | paused | {' | '.join(loops)} | paused KV (device / host / discarded) |",
                  "|---|---|" + "---|" * len(loops) + "---|"]
        by_key = {(r["policy"], r["paused"], r["loop"]): r for r in result["sim"]}
        for policy, n in dict.fromkeys((r["policy"], r["paused"]) for r in result["sim"]):
            cells = [f"{by_key[policy, n, loop]['step_ms']:.3f} ({by_key[policy, n, loop]['step_ms_p90']:.3f})"
                     for loop in loops]
            s = by_key[policy, n, loops[0]]["paused_by_state"]
            lines.append(f"| {policy} | {n:,} | {' | '.join(cells)} | "
                         f"{s['device'] + s['partial']:,} / {s['host']:,} / {s['discarded']:,} |")
        lines.append("")
    if result.get("server"):
        rows = result["server"]
        base = next((r["decode_tok_s"] for r in rows if r["paused"] == 0), None)
        lines += [f"## Real server, embedded model ({result.get('server_threads') or 'default'} threads)", "",
                  "| paused generations held | decode tok/s (median of 3) | vs none | paused KV (device / host / "
                  "discarded) | aborted by the server |", "|---|---|---|---|---|"]
        for r in rows:
            s = r["paused_by_state"]
            ratio = f"{r['decode_tok_s'] / base:.2f}x" if base else "-"
            lines.append(f"| {r['paused']:,} | {r['decode_tok_s']:.1f} | {ratio} | "
                         f"{s.get('device', 0) + s.get('partial', 0):,} / {s.get('host', 0):,} / "
                         f"{s.get('discarded', 0):,} | {int(r['aborted'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="per-step time on the simulated engine")
    parser.add_argument("--server", action="store_true", help="decode speed on the real server")
    parser.add_argument("--paused", type=int, nargs="+", default=None,
                        help=f"paused generations (default: sim {SIM_PAUSED}, server {SERVER_PAUSED})")
    parser.add_argument("--policies", nargs="+", default=list(SIM_POLICIES), help="simulated policies")
    parser.add_argument("--threads", type=int, default=None, help="server threads (default: the server's)")
    parser.add_argument("--server-args", default="", help="more `infercept serve` flags, e.g. an older "
                        "checkout's '--max-sessions 20000' (its default aborted paused generations past 256)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not (args.sim or args.server):
        parser.error("choose --sim, --server or both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": today(), "machine": cpu_name(), "server_threads": args.threads, "argv": sys.argv[1:]}
    if args.sim:
        result["sim"] = run_sim(args.paused or list(SIM_PAUSED), args.policies)
    if args.server:
        result["server"] = run_server(args.paused or list(SERVER_PAUSED), args.threads, out / "logs",
                                      args.server_args.split())
    (out / "paused_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (out / "paused_scale.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
