"""Replicas behind vllm-router (server/replicas.py): does a resume reach the replica that holds its pause,
and do two replicas serve about twice the agents of one?

    python benchmarks/replicas.py                 # 24 agents, ~1,000-token prompts, 5 steps, 0.5 s tools
    python benchmarks/replicas.py --agents 8 --steps 3 --words 100 --out /tmp/replicas   # a quick look

Three runs, one after another, each with fresh prompts (no run finds another's prefix in a cache):

  one          one `infercept serve --threads T`, the agents straight at it;
  cache_aware  `python -m infercept.server.replicas --replicas N --threads T` (N servers, T threads each,
               behind vllm-router's cache-aware policy, the launcher's default);
  round_robin  vllm-router with --policy round_robin over the same N servers.

Every agent starts at once and runs its loop with the official openai SDK, sending the whole
conversation every step (an unmodified client): a unique ~1,000-token task, then `--steps - 1` steps
that each end in a forced call of `lookup` (tool_choice named) followed by `--tool-s` seconds of "tool",
then a last step that answers (tool_choice none). Every step but the first resumes a paused generation;
`cached_tokens` is the server's own report, and a resumed step with >= 90% of its prompt cached found its
pause (a step that landed on another replica finds at most the prefix it shares with other agents there:
the tool definitions). Throughput is agents / (time from the first request to the last answer).

With `--scale-agents` the replicas' runs get `--agents` for each replica: every server as loaded as the one
server (which 24 agents already keep busy: with 0.5 s tools, 12 agents a replica leave it idle at times,
so the same 24 agents spread over two replicas measure less than what they sustain). The CPU each server
process used over a run (from /proc, in cores) shows how busy it was.

`--repeats N` runs the three N times in turn (one, replicas, one, replicas, ...), so that a slow spell of
the machine falls on both sides; the ratio is given for each repeat and as the median of the repeats.

Writes `<out>/replicas.json` (every step of every agent of every run) and `<out>/replicas.md`.
The agent loop (`run_agent`, `run_agents`) is also what tests/test_replicas.py drives.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, today  # noqa: E402

TOOL = {"name": "lookup", "description": "Look up one entry of the list by its position",
        "parameters": {"type": "object", "properties": {"index": {"type": "integer"}}, "required": ["index"],
                       "additionalProperties": False}}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
RESPONSES_TOOLS = [{"type": "function", **TOOL}]
VOCABULARY = ("apple", "river", "stone", "cloud", "maple", "orbit", "pixel", "tiger", "violet", "harbor",
              "copper", "meadow", "lantern", "glacier", "saffron", "timber")
HIT = 0.9  # a resumed step with at least this share of its prompt cached found its pause


def task(rng: random.Random, words: int) -> tuple[str, list[str]]:
    """A unique task of `words` entries (~4.4 tokens each with the embedded model's tokenizer), and the entries."""
    items = [f"{rng.choice(VOCABULARY)}{rng.randrange(1000)}" for _ in range(words)]
    return (f"Task {rng.randrange(10**9)}: look up each of these entries in order, one call at a time: "
            f"{' '.join(items)}"), items


def lookup(items: list[str], arguments: str) -> str:
    """The tool: the agent's own entry at the index the call names."""
    try:
        index = int(json.loads(arguments)["index"])
    except (ValueError, KeyError, TypeError):
        return "Error: call lookup with an integer index"
    return json.dumps({"index": index, "entry": items[index % len(items)]})


def default_model(base_url: str) -> str:
    r = httpx.get(f"{base_url}/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _share(prompt: int, cached: int) -> float:
    return cached / prompt if prompt else 0.0


def run_agent(client: openai.OpenAI, model: str, seed: str, steps: int = 3, words: int = 100, tool_s: float = 0.0,
              mode: str = "implicit", max_tokens: int = 32, identical_results: bool = False, on_step=None) -> dict:
    """One agent's loop; returns {"steps": [...], "error": None or {"status", "message", "step"}}.

    `mode`: implicit (chat, the whole conversation every step), session (chat under an X-Session-Id
    header, only the tool results after the first step), responses (previous_response_id, with the
    same X-Session-Id header on every request) or cache_key (Responses as Codex sends them: nothing
    stored, the whole input every step, the agent's `prompt_cache_key`). The last step answers without a
    tool call.
    `identical_results`: every agent's tool returns the same text at the same step (`entry <step>: <the
    call's arguments>`) instead of the entry from its own list."""
    rng = random.Random(seed)
    text, items = task(rng, words)
    session = f"agent-{seed}"
    headers = {"X-Session-Id": session} if mode in ("session", "responses") else None
    messages, new, previous = [{"role": "user", "content": text}], None, None
    inputs: list = [{"role": "user", "content": text}]  # (cache_key: the input sent again each step)
    records: list[dict] = []
    for step in range(steps):
        last = step == steps - 1
        start = time.perf_counter()
        try:
            if mode == "responses":
                choice = "none" if last else {"type": "function", "name": TOOL["name"]}
                r = client.responses.create(model=model, input=text if previous is None else new,
                                            previous_response_id=previous, tools=RESPONSES_TOOLS,
                                            tool_choice=choice, max_output_tokens=max_tokens if not last else 16,
                                            temperature=0, extra_headers=headers)
                prompt, cached = r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens or 0
                calls = [(o.call_id, o.arguments) for o in r.output if o.type == "function_call"]
                previous = r.id
            elif mode == "cache_key":
                choice = "none" if last else {"type": "function", "name": TOOL["name"]}
                r = client.responses.create(model=model, input=inputs, tools=RESPONSES_TOOLS, tool_choice=choice,
                                            max_output_tokens=max_tokens if not last else 16, temperature=0,
                                            store=False, prompt_cache_key=session)
                prompt, cached = r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens or 0
                calls = [(o.call_id, o.arguments) for o in r.output if o.type == "function_call"]
                inputs += [o.model_dump(exclude_none=True) for o in r.output]
            else:
                choice = "none" if last else {"type": "function", "function": {"name": TOOL["name"]}}
                sent = messages if mode == "implicit" or step == 0 else new
                r = client.chat.completions.create(model=model, messages=sent, tools=CHAT_TOOLS, tool_choice=choice,
                                                   max_tokens=max_tokens if not last else 16, temperature=0,
                                                   extra_headers=headers,
                                                   extra_body={"session_id": session} if mode == "session" else None)
                details = r.usage.prompt_tokens_details
                prompt, cached = r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0
                message = r.choices[0].message
                calls = [(c.id, c.function.arguments) for c in message.tool_calls or []]
                messages.append(message.model_dump(exclude_none=True))
        except openai.APIStatusError as e:
            return {"steps": records, "error": {"status": e.status_code, "message": str(e)[:300], "step": step}}
        except openai.APIConnectionError as e:
            return {"steps": records, "error": {"status": None, "message": str(e)[:300], "step": step}}
        records.append({"step": step, "prompt_tokens": prompt, "cached_tokens": cached,
                        "cached_share": round(_share(prompt, cached), 4), "e2e_s": round(time.perf_counter() - start, 3)})
        if on_step is not None:
            on_step(step)
        if last:
            break
        if not calls:
            return {"steps": records, "error": {"status": 200, "message": "no tool call on a forced step", "step": step}}
        time.sleep(tool_s)
        results = [{"call_id": cid, "output": f"entry {step}: {args}" if identical_results else lookup(items, args)}
                   for cid, args in calls]
        if mode in ("responses", "cache_key"):
            new = [{"type": "function_call_output", **r} for r in results]
            inputs += new
        else:
            new = [{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]
            messages += new
    return {"steps": records, "error": None}


def run_agents(base_url: str, agents: int, tag: str, at_once: bool = True, model: str | None = None,
               **kwargs) -> dict:
    """`agents` agents through `base_url` (all at once, or one after another): their loops and the wall time."""
    model = model or default_model(base_url)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    start = time.perf_counter()
    seeds = [f"{tag}-{i}" for i in range(agents)]
    if at_once:
        with concurrent_futures(agents) as pool:
            loops = list(pool.map(lambda s: run_agent(client, model, s, **kwargs), seeds))
    else:
        loops = [run_agent(client, model, s, **kwargs) for s in seeds]
    return {"agents": loops, "wall_s": round(time.perf_counter() - start, 3)}


def concurrent_futures(n: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, n))


def resumed(loops: list[dict]) -> list[dict]:
    return [s for loop in loops for s in loop["steps"] if s["step"] > 0]


def summarize(run: dict) -> dict:
    loops = run["agents"]
    back = resumed(loops)
    hits = [s for s in back if s["cached_share"] >= HIT]
    firsts = [loop["steps"][0]["prompt_tokens"] for loop in loops if loop["steps"]]
    done = [loop for loop in loops if loop["error"] is None]
    return {"agents": len(loops), "finished": len(done), "errors": [loop["error"] for loop in loops if loop["error"]],
            "wall_s": run["wall_s"], "agents_per_s": round(len(done) / run["wall_s"], 4),
            "resumed_steps": len(back), "resumed_hits": len(hits),
            "resumed_hit_share": round(len(hits) / len(back), 4) if back else None,
            "resumed_cached_share": round(sum(s["cached_tokens"] for s in back) / max(1, sum(s["prompt_tokens"] for s in back)), 4),
            "first_prompt_tokens_median": statistics.median(firsts) if firsts else None,
            "resumed_e2e_median_s": round(statistics.median(s["e2e_s"] for s in back), 3) if back else None}


# -- the runs --------------------------------------------------------------------------------------------

def _processes():
    from sweep import ServerProcess, free_port  # noqa: E402  (tqdm, only for the benchmark's own runs)
    return ServerProcess, free_port


def run_one(args, out: Path) -> dict:
    ServerProcess, free_port = _processes()
    port = free_port()
    exe = str(Path(sys.executable).with_name("infercept"))
    server = ServerProcess([exe, "serve", "--port", str(port), "--threads", str(args.threads), "--log-level", "warning",
                            *args.serve_arg], port, "one server", out / "one.log")
    try:
        server.wait_ready(timeout=900)
        return measure(server.base_url, "one", args, processes=(server.proc.pid,))
    finally:
        server.stop()


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, from /proc/stat; this process's CPU seconds)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def process_cpu(root: int) -> dict[int, dict]:
    """CPU seconds of `root` and every process under it, from /proc: {pid: {"name", "cpu_s", "busiest_thread_s"}}
    (a replica's busiest thread is its engine's; the rest is its HTTP side, rendering and tokenizing)."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(path: str) -> list[str]:
        text = Path(path).read_text()
        return text[text.rindex(")") + 2:].split()  # the fields after the command's name, which may hold spaces

    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(stat(f"/proc/{entry}/stat")[1])
            except (OSError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    result = {}
    for pid in tree:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            threads = [stat(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone meanwhile
            continue
        per_thread = [(int(f[11]) + int(f[12])) / tick for f in threads]  # utime + stime
        result[pid] = {"name": " ".join(a.decode(errors="replace") for a in argv[:6]).strip(),
                       "cpu_s": sum(per_thread), "busiest_thread_s": max(per_thread, default=0.0)}
    return result


def cpu_by_process(before: dict[int, dict], after: dict[int, dict], wall: float) -> list[dict]:
    """Each process's share of one core over the run (and its busiest thread's), from two `process_cpu`s."""
    rows = []
    for pid, a in sorted(after.items()):
        b = before.get(pid, {"cpu_s": 0.0, "busiest_thread_s": 0.0})
        used = a["cpu_s"] - b["cpu_s"]
        if used > 0.01 * wall:
            rows.append({"pid": pid, "name": a["name"], "cores": round(used / wall, 3),
                         "busiest_thread_cores": round((a["busiest_thread_s"] - b["busiest_thread_s"]) / wall, 3)})
    return rows


def metric_lines(url: str) -> list[str]:
    """A server's /metrics, line by line."""
    return httpx.get(url + "/metrics", timeout=10).text.splitlines()


def metric(lines: list[str], name: str) -> float:
    """The sum of a metric's samples (over their labels, if any) in `metric_lines`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if re.match(rf"{name}[ {{]", line))


def computed_tokens(servers: list[str]) -> list[float]:
    """Prompt tokens each server has computed so far: served less found cached (its
    `infercept_prompt_tokens_total` less `infercept_cached_prompt_tokens_total`)."""
    def one(url: str) -> float:
        lines = metric_lines(url)
        return metric(lines, "infercept_prompt_tokens_total") - metric(lines, "infercept_cached_prompt_tokens_total")
    return [one(url) for url in servers]


def measure(url: str, name: str, args, servers: list[str] = (), processes: tuple[int, ...] = ()) -> dict:
    """One run of the agents through `url`; `servers`: the replicas behind it, whose shares of the prompt
    tokens computed the run records (how evenly the router spread the work); `processes`: the roots of the
    process trees whose CPU the run records, each process apart."""
    load = os.getloadavg()[0]
    before = computed_tokens(servers)
    trees = {}
    for root in processes:
        trees |= process_cpu(root)
    (busy0, client0), start = cpu_seconds(), time.perf_counter()
    agents = args.agents * len(servers) if args.scale_agents and servers else args.agents
    run = run_agents(url, agents, f"{name}-{time.time_ns()}", steps=args.steps, words=args.words,
                     tool_s=args.tool_s, identical_results=args.identical_results)
    (busy1, client1), wall = cpu_seconds(), time.perf_counter() - start
    summary = summarize(run)
    summary["load_average_before"] = round(load, 2)
    # Where the cores went: all of the machine's busy time over the run (servers, router, this client), as
    # a share of every core's time, and this client's own CPU seconds (the agents' openai SDK threads).
    summary["machine_cpu_busy_share"] = round((busy1 - busy0) / (wall * os.cpu_count()), 3)
    summary["client_cpu_s"] = round(client1 - client0, 2)
    if processes:
        after = {}
        for root in processes:
            after |= process_cpu(root)
        summary["cpu_by_process"] = cpu_by_process(trees, after, wall)
    if servers:
        computed = [after - b for after, b in zip(computed_tokens(servers), before)]
        summary["computed_prompt_shares"] = [round(t / max(1.0, sum(computed)), 3) for t in computed]
    print(f"{name}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    return {"summary": summary, **run}


def run_replicas(args, out: Path) -> dict[str, dict]:
    """The launcher with its default policy, then a round-robin router over the same replicas."""
    from infercept.server.replicas import router_argv, router_executable

    ServerProcess, free_port = _processes()
    port, base, metrics = free_port(), free_port(), free_port()
    while any(_busy(base + i) for i in range(args.replicas)):
        base = free_port()
    launcher = ServerProcess([sys.executable, "-m", "infercept.server.replicas", "--replicas", str(args.replicas),
                              "--threads", str(args.threads), "--port", str(port), "--base-port", str(base),
                              "--metrics-port", str(metrics), "--log-dir", str(out / "logs"), "--no-restart",
                              "--", "--log-level", "warning", *args.serve_arg],
                             port, f"{args.replicas} replicas + router", out / "launcher.log")
    runs = {}
    try:
        launcher.wait_ready(timeout=900)
        workers = [f"http://127.0.0.1:{base + i}" for i in range(args.replicas)]
        runs["cache_aware"] = measure(launcher.base_url, "cache_aware", args, workers, (launcher.proc.pid,))
        rr_port = free_port()
        rr = ServerProcess(router_argv(router_executable(), workers, "127.0.0.1", rr_port, "round_robin", free_port()),
                           rr_port, "round-robin router", out / "round_robin_router.log")
        try:
            rr.wait_ready(timeout=120)
            runs["round_robin"] = measure(rr.base_url, "round_robin", args, workers, (launcher.proc.pid, rr.proc.pid))
        finally:
            rr.stop()
    finally:
        launcher.stop()
    return runs


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def report(doc: dict) -> str:
    a = doc["args"]
    agents = f"{a['agents']} agents a server" if a.get("scale_agents") else f"{a['agents']} agents"
    lines = [f"# Replicas behind vllm-router: {agents}, {a['steps']} steps, {a['tool_s']} s tools",
             "", f"{doc['machine']}, {doc['date']}; `{doc['command']}`; {a['replicas']} replicas x {a['threads']} "
             f"thread(s) vs one server x {a['threads']} thread(s); vllm-router {doc['router_version']}.", "",
             "| repeat | run | finished | wall (s) | agents/s | resumed steps >= 90% cached | cached share of resumed "
             "prompts | first prompt tokens (median) | resumed step e2e, median (s) | load avg before "
             "| machine CPU busy | client CPU (s) | servers' cores each | replicas' shares of the prompt tokens computed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, runs in enumerate(doc["repeats"], 1):
        for name, run in runs.items():
            s = run["summary"]
            hit = f"{s['resumed_hits']}/{s['resumed_steps']} ({100 * (s['resumed_hit_share'] or 0):.1f}%)"
            lines.append(f"| {i} | {name} | {s['finished']}/{s['agents']} | {s['wall_s']:.1f} | {s['agents_per_s']:.3f} | "
                         f"{hit} | {100 * s['resumed_cached_share']:.1f}% | {s['first_prompt_tokens_median']} | "
                         f"{s['resumed_e2e_median_s']} | {s['load_average_before']} | "
                         f"{100 * s.get('machine_cpu_busy_share', float('nan')):.0f}% | {s.get('client_cpu_s', '-')} | "
                         f"{server_cores(s)} | "
                         f"{' / '.join(f'{100 * x:.0f}%' for x in s.get('computed_prompt_shares', [])) or '-'} |")
    goals = doc["goals"]
    lines += ["", "Goals: " + "; ".join(f"{k}: {v}" for k, v in goals.items()), ""]
    return "\n".join(lines)


def server_cores(summary: dict) -> str:
    """The servers' (not the router's) CPU over the run, in cores, each: how busy the run kept them."""
    rows = [r for r in summary.get("cpu_by_process", []) if "serve" in r["name"] or " replica" in r["name"]]
    return " / ".join(f"{r['cores']:.2f}" for r in rows) or "-"


def goals_of(repeats: list[dict]) -> dict:
    """The issue's goals over every repeat: the worst hit share, and the speed-up of each repeat and their median."""
    goals = {}
    if all("cache_aware" in runs for runs in repeats):
        share = min(runs["cache_aware"]["summary"]["resumed_hit_share"] or 0 for runs in repeats)
        goals["cache_aware resumed steps >= 90% cached in >= 95% (worst repeat)"] = \
            f"{100 * share:.1f}% ({'met' if share >= 0.95 else 'not met'})"
    if all("round_robin" in runs for runs in repeats):
        shares = [f"{100 * (runs['round_robin']['summary']['resumed_hit_share'] or 0):.1f}%" for runs in repeats]
        goals["round_robin resumed steps >= 90% cached"] = ", ".join(shares)
    if all({"one", "cache_aware"} <= runs.keys() for runs in repeats):
        ratios = [runs["cache_aware"]["summary"]["agents_per_s"] / runs["one"]["summary"]["agents_per_s"] for runs in repeats]
        median = statistics.median(ratios)
        each = ", ".join(f"{r:.2f}x" for r in ratios)
        goals["agents/s, replicas / one (>= 1.8x)"] = (f"{median:.2f}x median of {len(ratios)} ({each}) "
                                                       f"({'met' if median >= 1.8 else 'not met'})")
    return goals


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=24)
    p.add_argument("--steps", type=int, default=5, help="model calls per agent; all but the last end in a tool call")
    p.add_argument("--words", type=int, default=170,
                   help="words of each agent's task (170: a ~1,000-token first prompt with the tool definitions)")
    p.add_argument("--tool-s", type=float, default=0.5, help="seconds each tool call takes")
    p.add_argument("--identical-results", action="store_true",
                   help="every agent's tool returns the same text at the same step (the router's cache-aware "
                        "matching then sends some resumes elsewhere)")
    p.add_argument("--scale-agents", action="store_true",
                   help="the replicas' runs get --agents for each replica (the one server's load on every server: "
                        "what they sustain when each is as busy as the one server, not the same agents spread thinner)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server, the single one too")
    p.add_argument("--runs", nargs="+", default=["one", "cache_aware", "round_robin"],
                   choices=("one", "cache_aware", "round_robin"))
    p.add_argument("--serve-arg", action="append", default=[], help="one more `infercept serve` argument (repeat)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole sequence this many times in turn")
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "replicas"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = []
    for i in range(args.repeats):
        runs = {}
        if "one" in args.runs:
            runs["one"] = run_one(args, out)
        if {"cache_aware", "round_robin"} & set(args.runs):
            both = run_replicas(args, out)
            runs.update({k: v for k, v in both.items() if k in args.runs})
        repeats.append(runs)
    from importlib.metadata import version

    doc = {"machine": cpu_name(), "date": today(), "command": " ".join(["python benchmarks/replicas.py", *(sys.argv[1:] if argv is None else argv)]),
           "router_version": version("vllm-router"), "args": vars(args), "repeats": repeats,
           "goals": goals_of(repeats)}
    (out / "replicas.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = report(doc)
    (out / "replicas.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
