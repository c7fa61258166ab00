"""What waiting agents cost the agents that run: per-step time with thousands of paused generations.

Two measurements, each optionally under tool traffic (`--completions RATE`: the paused agents' tools
complete at Poisson arrivals totalling RATE a second; each completion resumes a random paused agent with
a 4-token result, whose turn writes one token and pauses again on the same tool, so as many stay paused
and every completion adds a duration to its tool's history):

- `--sim`: the real scheduler on the simulated engine (H100 + Llama-3-8B profile, virtual clock). N
  agents paused on a slow call (16-token contexts, client hint 3600 s), then 8 requests of 1,000-token
  prompts decode; the wall-clock time of each engine step (scheduler, block manager, accounting and
  the modeled runner's bookkeeping; no model) is timed over 200 decode steps, median reported. Each
  policy runs with event-driven planning (the default) and with `event_driven=False` (every holder of
  device KV planned every step), same state. Under traffic the agents wait on 4 tools, and a third way
  runs beside them: event-driven, but a new duration wakes every holder of its tool ("wake all"), where
  the default wakes only the pauses whose estimate the duration can change.
- `--server`: the real HTTP server with the embedded model. N paused generations are created through
  `/v1/completions` (15-token prompts of fresh ids + 1 generated token, `intercept` with `expected_s`
  3600), then one request decodes 128 tokens (greedy, EOS ignored) while they wait; decode speed =
  (tokens - 1) / (last token - first token) of its stream, median of 3 (`--repeats`). Where the paused
  KV lives and how many paused generations the server aborted are read from /metrics.

    .venv/bin/python benchmarks/paused_scale.py --sim --server       # ~10 min on 2 cores
    .venv/bin/python benchmarks/paused_scale.py --sim --paused 10 100 # a quick look
    .venv/bin/python benchmarks/paused_scale.py --sim --server --completions 50 --paused 50 2000 \
        --policies infercept --out benchmarks/results/paused_scale_traffic   # under tool traffic

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
SIM_TOOLS = ("search", "browse", "code", "ask")  # the simulated agents' tools, one history each
SERVER_KINDS = ("tool", "human", "model")  # token-level completions name an interception by its kind
RESULT_TOKENS = 4
TRAFFIC_WARMUP_S = 120.0  # virtual seconds of traffic before timing: pauses of every age, histories full


# -- simulation ------------------------------------------------------------------------------------
def sim_step_ms(policy: str, num_paused: int, loop: str, completions: float = 0.0) -> dict:
    """Median wall-clock ms of one engine step with `num_paused` agents waiting and 8 decoding. `loop`:
    "event-driven", "wake all" (event-driven, but a new tool duration wakes every holder of the tool),
    "every step", or "before" (code without the paused-KV index, run from an older checkout for a
    before/after comparison; see benchmarks/README). `completions`: tool completions a second (virtual)."""
    profile = h100_llama3_8b()
    blocks = 2 * num_paused + DECODING_REQUESTS * 200 + 64  # room for every context on either side
    engine = SimulatedEngine(policy, profile, num_device_blocks=blocks, num_host_blocks=blocks)
    agents = [engine.add_request(PAUSED_PROMPT, 1, expected_s=WAIT_HINT_S,
                                 kind=SIM_TOOLS[i % len(SIM_TOOLS)] if completions else "tool")
              for i in range(num_paused)]
    while engine.has_work():
        engine.step()
    # Set up event-driven (quick), then plan the way being timed: all make the same decisions (tests).
    index = getattr(engine.scheduler, "paused_kv", None)
    if index is not None:
        index.event_driven = loop != "every step"
        if loop == "wake all":
            index.history.changed_since = lambda tool, version: float("inf")
    for _ in range(DECODING_REQUESTS):
        engine.add_request(1000, 10 ** 6, last_turn=True)
    held = -1
    for _ in range(5000):  # prefill, and let budgeted swap-outs finish: time the steady state
        engine.step()
        if not engine.scheduler.waiting and engine.paused_device_tokens() == held:
            break
        held = engine.paused_device_tokens()
    rng = random.Random(0)
    next_completion = [engine.clock.now() + (rng.expovariate(completions) if completions else float("inf"))]

    def complete_due() -> int:
        """Resume the agents whose tool results arrived by now (a random agent each, if it is paused)."""
        done = 0
        while engine.clock.now() >= next_completion[0]:
            agent = rng.choice(agents)
            if agent in engine.scheduler.paused:
                engine.resume(agent, RESULT_TOKENS, 1)
                done += 1
            next_completion[0] += rng.expovariate(completions)
        return done

    warm_until = engine.clock.now() + (TRAFFIC_WARMUP_S if completions else 0.0)
    while engine.clock.now() < warm_until:
        complete_due()
        engine.step()
    times, completed = [], 0
    for _ in range(TIMED_STEPS):
        completed += complete_due()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    sched = engine.scheduler
    states = [kv_state(*sched.kv_tokens(r)) for r in sched.paused.values()]
    return {"policy": policy, "paused": num_paused, "loop": loop, "completions_per_s": completions,
            "completed": completed,
            "step_ms": 1000 * statistics.median(times), "step_ms_p90": 1000 * statistics.quantiles(times, n=10)[-1],
            "paused_by_state": {state: states.count(state) for state in ("device", "host", "partial", "discarded")}}


def kv_state(device: int, host: int) -> str:
    """engine.paused_kv.kv_state, here too because the "before" run imports a checkout without it."""
    return "partial" if device and host else "device" if device else "host" if host else "discarded"


def run_sim(paused_counts: list[int], policies: list[str], completions: float = 0.0) -> list[dict]:
    indexed = "event_driven" in inspect.signature(SimulatedEngine).parameters
    loops = (("event-driven", "wake all") if completions else ("event-driven",)) + ("every step",) \
        if indexed else ("before",)
    rows = []
    with tqdm(total=len(paused_counts) * len(policies) * len(loops), desc="simulated steps", file=sys.stderr) as bar:
        for policy in policies:
            for n in paused_counts:
                for loop in loops:
                    rows.append(sim_step_ms(policy, n, loop, completions))
                    bar.update()
    return rows


# -- the real server ---------------------------------------------------------------------------------
class Agent:
    """A paused generation the traffic may resume: its whole context and its interception's kind."""

    def __init__(self, tokens: list[int], kind: str):
        self.tokens, self.kind, self.busy = tokens, kind, False


async def _turn(http: httpx.AsyncClient, model: str, prompt: list[int], kind: str) -> dict:
    """One token, then a pause (token-level completions with `intercept`); the response with token ids."""
    r = await http.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True,
        "intercept": {"kind": kind, "expected_s": WAIT_HINT_S}})
    r.raise_for_status()
    return r.json()


async def _pause_many(http: httpx.AsyncClient, model: str, count: int, rng: random.Random, kinds: tuple[str, ...],
                      concurrency: int = 32) -> list[Agent]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Agent:
        async with sem:
            kind = kinds[i % len(kinds)]
            choice = (await _turn(http, model, [rng.randrange(1000, 30000) for _ in range(PAUSED_PROMPT)],
                                  kind))["choices"][0]
            return Agent(choice["prompt_token_ids"] + choice["token_ids"], kind)

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    return [await task for task in tqdm(asyncio.as_completed(tasks), total=count, desc="pausing agents",
                                        file=sys.stderr)]


async def _tool_traffic(http: httpx.AsyncClient, model: str, agents: list[Agent], rate: float,
                        rng: random.Random, stop: asyncio.Event) -> dict:
    """Until `stop`: Poisson arrivals at `rate` a second, each the result of a random idle agent's tool:
    its context plus a 4-token result (an implicit resume), one token, and a pause on the same kind."""
    done, reused, sent = [0], [0], [0]

    async def complete(agent: Agent) -> None:
        try:
            body = await _turn(http, model, agent.tokens + [rng.randrange(1000, 30000) for _ in range(RESULT_TOKENS)],
                               agent.kind)
            choice = body["choices"][0]
            agent.tokens = choice["prompt_token_ids"] + choice["token_ids"]
            done[0] += 1
            reused[0] += body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(choice["prompt_token_ids"]) \
                - RESULT_TOKENS - 1
        finally:
            agent.busy = False

    tasks = set()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
        except asyncio.TimeoutError:
            idle = [a for a in rng.sample(agents, min(8, len(agents))) if not a.busy]
            if idle:
                idle[0].busy = True
                sent[0] += 1
                task = asyncio.create_task(complete(idle[0]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return {"completed": done[0], "resumed_paused_kv": reused[0], "sent": sent[0]}


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


async def _server_rows(base_url: str, paused_counts: list[int], completions: float, repeats: int = 3) -> list[dict]:
    rng = random.Random(0)
    rows = []
    agents: list[Agent] = []
    kinds = SERVER_KINDS if completions else ("tool",)
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await _decode_speed(http, model, rng)  # warm-up
        for n in sorted(paused_counts):
            agents += await _pause_many(http, model, n - len(agents), rng, kinds)
            await asyncio.sleep(2.0)  # the policy's decisions for the fresh pauses
            stop = asyncio.Event()
            traffic = asyncio.create_task(_tool_traffic(http, model, agents, completions, rng, stop)) \
                if completions and agents else None
            began = time.perf_counter()
            if traffic is not None:
                await asyncio.sleep(3.0)  # into the traffic's steady state
            speeds = [await _decode_speed(http, model, rng) for _ in range(repeats)]
            stop.set()
            served = await traffic if traffic is not None else {}
            if served:
                served["completions_per_s_served"] = served["completed"] / (time.perf_counter() - began)
            metrics = _paused_metrics((await http.get("/metrics")).text)
            rows.append({"paused": n, "completions_per_s": completions if traffic is not None else 0.0,
                         "decode_tok_s": statistics.median(speeds), "runs": speeds, **served, **metrics})
    return rows


def run_server(paused_counts: list[int], threads: int | None, logs: Path, extra: list[str],
               completions: float = 0.0, repeats: int = 3) -> list[dict]:
    exe = Path(sys.executable).with_name("infercept")
    port = free_port()
    argv = [str(exe), "serve", "--port", str(port), "--log-level", "warning",
            *(["--threads", str(threads)] if threads else []), *extra]
    logs.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(argv, port, "infercept (defaults)", logs / "server.log")
    try:
        server.wait_ready(900)
        return asyncio.run(_server_rows(server.base_url, paused_counts, completions, repeats))
    finally:
        server.stop()


# -- report --------------------------------------------------------------------------------------
def report(result: dict) -> str:
    lines = [f"# Paused generations vs step cost ({result['date']}, {result['machine']})", ""]
    if result.get("sim"):
        loops = list(dict.fromkeys(r["loop"] for r in result["sim"]))
        traffic = result.get("completions_per_s") or 0
        lines += ["## Simulated engine, H100 + Llama-3-8B profile, 8 requests decoding"
                  + (f", {traffic:g} tool completions a second (virtual clock)" if traffic else ""),
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
        base_row = rows[0]
        base = base_row["decode_tok_s"]
        lines += [f"## Real server, embedded model ({result.get('server_threads') or 'default'} threads)", "",
                  f"Decode speed of one request beside the paused generations, against the first row's "
                  f"({base_row['paused']:,} paused). Under traffic: the completions a second the server served "
                  "while timing, and how many of them resumed the paused KV.", "",
                  "| paused generations held | tool completions / s (served) | resumed paused KV | decode tok/s "
                  f"(median of {len(rows[0]['runs'])}) | vs first row | paused KV (device / host / discarded) | aborted by the server |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            s = r["paused_by_state"]
            served = f"{r['completions_per_s']:g} ({r['completions_per_s_served']:.1f})" if r.get("completed") else "0"
            reused = f"{r['resumed_paused_kv']} of {r['completed']}" if r.get("completed") else "-"
            lines.append(f"| {r['paused']:,} | {served} | {reused} | {r['decode_tok_s']:.1f} | "
                         f"{r['decode_tok_s'] / base:.2f}x | "
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
    parser.add_argument("--completions", type=float, default=0.0,
                        help="tool completions a second among the paused agents while timing (default 0)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="server: decode runs per row, the median reported (default 3)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not (args.sim or args.server):
        parser.error("choose --sim, --server or both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": today(), "machine": cpu_name(), "server_threads": args.threads, "argv": sys.argv[1:],
              "completions_per_s": args.completions}
    if args.sim:
        result["sim"] = run_sim(args.paused or list(SIM_PAUSED), args.policies, args.completions)
    if args.server:
        result["server"] = run_server(args.paused or list(SERVER_PAUSED), args.threads, out / "logs",
                                      args.server_args.split(), args.completions, args.repeats)
    (out / "paused_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (out / "paused_scale.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
