"""A bounded soak with chaos: agents over the openai SDK against a real `infercept serve` on loopback,
with faults mixed in, then a drain and the invariants an operator relies on.

For each policy, one server process (small KV pools, short TTLs, two tenants from a keys file) and N
agent loops for the given time. Each loop step is, by weighted chance (seeded):

    agent       a chat tool loop: a forced call (the generation pauses), its result (resumed), an answer
    session     the same through a native session (/v1/sessions), deleted after
    responses   the same through the Responses API, chained by previous_response_id, deleted after
    disconnect  a stream the client leaves after a few chunks
    abort       a request the client gives up on before its answer (client timeout)
    abandon     a forced call whose result never comes (the client is gone: the TTL must release it)
    late        a tool result that comes after --idle-ttl (served fresh: the pause was released)
    double      two concurrent resumes of the same paused generation (one resumes, one is served fresh)
    unknown     tool results for call ids nobody made (400)
    malformed   a body that is not JSON (400), and now and then one over the 16 MiB limit (413)
    probe       the other tenant reads, continues and deletes this tenant's session and response (404)

At the end it drains (every client stops, the TTLs pass) and checks: no 5xx, no exception in a loop,
every native session idle or paused once its post was answered (never generating) and gone after the
TTL if its client left it, no paused generation left, device and host KV blocks in use back to 0 (what
the prefix cache holds is free, evictable), the server's RSS flat (last window vs first window, +10% at
most), and exit status 0 on SIGTERM. Prints a table per policy and writes a JSON result.

    .venv/bin/python benchmarks/soak.py --minutes 10 --agents 32 --policies infercept prefix-cache
    .venv/bin/python benchmarks/soak.py --seconds 60 --agents 6          # the version `make test` runs

Exit status 1 if an invariant fails.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth"]
STEPS = {"agent": 30, "session": 10, "responses": 8, "disconnect": 8, "abort": 8, "abandon": 5, "late": 4, "double": 6,
         "unknown": 5, "malformed": 5, "probe": 6}
IDLE_TTL_S = 3.0
MODEL = "smol"
KEYS = {"a": "soak-key-a", "b": "soak-key-b"}


@dataclass
class Tally:
    steps: collections.Counter = field(default_factory=collections.Counter)  # by kind
    statuses: collections.Counter = field(default_factory=collections.Counter)  # HTTP status -> count
    errors: list[str] = field(default_factory=list)  # exceptions in the loops, and 5xx
    sessions: set[str] = field(default_factory=set)  # native sessions left for the drain to check
    session_states: collections.Counter = field(default_factory=collections.Counter)  # seen after their posts

    def status(self, code: int, what: str) -> None:
        self.statuses[code] += 1
        if code >= 500:
            self.errors.append(f"{what}: HTTP {code}")


# -- the server -------------------------------------------------------------------------------------

def start_server(policy: str, model: str | None, keys_file: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "infercept.server.cli", "serve", "--port", "0", "--policy", policy,
            "--dtype", "float32", "--kv-cache-gb", "0.05", "--host-kv-gb", "0.02", "--served-model-name", MODEL,
            "--idle-ttl", str(IDLE_TTL_S), "--response-ttl", str(IDLE_TTL_S), "--api-keys-file", keys_file,
            "--log-level", "warning"] + (["--model", model] if model else [])
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300  # a fresh machine measures the policy's profile first
    while True:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"infercept serve exited: {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("infercept serve did not start")
        if " on http://" in line:
            return proc, line.rsplit(" on ", 1)[1].strip()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def metrics(base: str) -> dict[str, float]:
    """Unlabelled-by-cause sums of every sample in /metrics, by metric name (labels dropped)."""
    sums: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, 1)[0]
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


# -- the agents -------------------------------------------------------------------------------------

class Agent:
    def __init__(self, base: str, tenant: str, tally: Tally, rng: random.Random):
        self.base, self.tally, self.rng = base, tally, rng
        self.key = KEYS[tenant]
        self.other = KEYS["b" if tenant == "a" else "a"]
        self.sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key=self.key, max_retries=0, timeout=120)
        self.http = httpx.AsyncClient(base_url=base + "/v1", timeout=120, headers={"Authorization": f"Bearer {self.key}"})

    async def close(self) -> None:
        await self.http.aclose()
        await self.sdk.close()

    async def step(self, kind: str) -> None:
        try:
            await getattr(self, kind)()
        except openai.APIStatusError as e:  # an SDK call's 4xx is a status like any other; 5xx an error
            self.tally.status(e.status_code, kind)
        self.tally.steps[kind] += 1

    def question(self) -> list[dict]:
        return [{"role": "user", "content": f"What is the weather in {self.rng.choice(CITIES)}?"}]

    async def call(self, messages: list[dict]):
        """The forced tool call: the generation pauses at it."""
        r = await self.sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                   tool_choice="required", max_tokens=48, temperature=0)
        self.tally.status(200, "call")
        message = r.choices[0].message
        if not message.tool_calls:  # cut by max_tokens: nothing paused
            return None
        call = message.tool_calls[0]
        return messages + [message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]

    async def answer(self, messages: list[dict]) -> None:
        await self.sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12,
                                               temperature=0)
        self.tally.status(200, "answer")

    async def agent(self) -> None:
        resumed = await self.call(self.question())
        if resumed is not None:
            await self.answer(resumed)

    async def abandon(self) -> None:
        await self.call(self.question())

    async def late(self) -> None:
        resumed = await self.call(self.question())
        if resumed is not None:
            await asyncio.sleep(IDLE_TTL_S + 2.5)  # past the TTL and the reaper's tick
            await self.answer(resumed)

    async def double(self) -> None:
        resumed = await self.call(self.question())
        if resumed is not None:
            await asyncio.gather(self.answer(resumed), self.answer(resumed))

    async def session(self) -> None:
        r = await self.http.post("/sessions", json={"tools": [WEATHER], "max_tokens": 24, "temperature": 0})
        self.tally.status(r.status_code, "session create")
        sid = r.json()["id"]
        r = await self.http.post(f"/sessions/{sid}/messages", json=dict(content=self.question()[0]["content"]))
        self.tally.status(r.status_code, "session message")
        pending = r.json().get("pending_calls") or []
        if pending:
            r = await self.http.post(f"/sessions/{sid}/messages", json={"tool_results": [
                {"tool_call_id": c["id"], "content": "sunny"} for c in pending]})
            self.tally.status(r.status_code, "session results")
        r = await self.http.get(f"/sessions/{sid}")  # its post answered: idle or paused, never generating
        self.tally.status(r.status_code, "session read")
        self.tally.session_states[r.json()["state"] if r.status_code == 200 else f"HTTP {r.status_code}"] += 1
        if self.rng.random() < 0.5:  # the rest are left to the TTL: the drain checks they are gone
            self.tally.status((await self.http.delete(f"/sessions/{sid}")).status_code, "session delete")
        else:
            self.tally.sessions.add(sid)

    async def responses(self) -> None:
        first = await self.sdk.responses.create(model=MODEL, input=self.question()[0]["content"], tools=[{
            "type": "function", **WEATHER["function"]}], tool_choice="required", max_output_tokens=48, temperature=0)
        self.tally.status(200, "response")
        calls = [item for item in first.output if item.type == "function_call"]
        if calls:
            second = await self.sdk.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=12,
                                                     tools=[{"type": "function", **WEATHER["function"]}], input=[
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls])
            self.tally.status(200, "chained response")
            await self.sdk.responses.delete(second.id)
        await self.sdk.responses.delete(first.id)

    async def disconnect(self) -> None:
        body = {"model": MODEL, "messages": self.question(), "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with self.http.stream("POST", "/chat/completions", json=body) as r:
            self.tally.status(r.status_code, "stream")
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # leaving the stream closes the connection: the server aborts the turn

    async def abort(self) -> None:
        body = {"model": MODEL, "messages": self.question(), "max_tokens": 64, "ignore_eos": True}
        try:
            r = await self.http.post("/chat/completions", json=body, timeout=0.3)
            self.tally.status(r.status_code, "abort")  # answered before the client gave up
        except httpx.TimeoutException:
            pass

    async def unknown(self) -> None:
        messages = self.question() + [{"role": "tool", "tool_call_id": f"call_{self.rng.randrange(1 << 30)}",
                                       "content": "sunny"}]
        r = await self.http.post("/chat/completions", json={"model": MODEL, "messages": messages, "tools": [WEATHER]})
        self.tally.status(r.status_code, "unknown call id")
        if r.status_code != 400:
            self.tally.errors.append(f"tool results for an unknown call id: HTTP {r.status_code}, not 400")

    async def malformed(self) -> None:
        oversized = self.rng.random() < 0.1
        content = b"{" * (17 * 1024 * 1024) if oversized else b'{"model": "smol", "messages": [}'
        r = await self.http.post("/chat/completions", content=content, headers={"Content-Type": "application/json"})
        self.tally.status(r.status_code, "malformed")
        if r.status_code != (413 if oversized else 400):
            self.tally.errors.append(f"{'oversized' if oversized else 'malformed'} body: HTTP {r.status_code}")

    async def probe(self) -> None:
        r = await self.http.post("/sessions", json={"max_tokens": 4})
        sid = r.json()["id"]
        made = (await self.http.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4})).json()
        other = {"Authorization": f"Bearer {self.other}"}
        for method, url, body in (("GET", f"/sessions/{sid}", None), ("DELETE", f"/sessions/{sid}", None),
                                  ("POST", f"/sessions/{sid}/messages", {"content": "Hi"}),
                                  ("GET", f"/responses/{made['id']}", None), ("DELETE", f"/responses/{made['id']}", None)):
            r = await self.http.request(method, url, json=body, headers=other)
            self.tally.status(r.status_code, "probe")
            if r.status_code != 404:
                self.tally.errors.append(f"tenant probe {method} {url}: HTTP {r.status_code}, not 404")
        await self.http.delete(f"/sessions/{sid}")
        await self.http.delete(f"/responses/{made['id']}")


async def agent_loop(agent: Agent, first: int, deadline: float) -> None:
    """Every kind once (from the `first`th on, so the agents start differently), then by chance."""
    kinds, weights = list(STEPS), list(STEPS.values())
    every_kind = kinds[first % len(kinds):] + kinds[:first % len(kinds)]
    while time.monotonic() < deadline:
        kind = every_kind.pop(0) if every_kind else agent.rng.choices(kinds, weights)[0]
        try:
            await agent.step(kind)
        except Exception as e:  # a loop must never die: record and go on
            agent.tally.errors.append(f"{kind}: {type(e).__name__}: {e}")


# -- one policy -------------------------------------------------------------------------------------

async def soak_policy(policy: str, seconds: float, agents: int, model: str | None, seed: int, workdir: Path) -> dict:
    keys_file = workdir / "keys"
    keys_file.write_text("".join(f"{key} tenant-{name}\n" for name, key in KEYS.items()))
    log_path = workdir / f"serve-{policy}.log"
    proc, base = start_server(policy, model, str(keys_file), log_path)
    tally = Tally()
    rss: list[tuple[float, float]] = []
    try:
        started = time.monotonic()
        crew = [Agent(base, "ab"[i % 2], tally, random.Random(seed * 1000 + i)) for i in range(agents)]

        async def sample_rss() -> None:
            while True:
                rss.append((time.monotonic() - started, rss_mb(proc.pid)))
                await asyncio.sleep(2.0)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(agent_loop(a, i, started + seconds) for i, a in enumerate(crew)))
        sampler.cancel()
        # The drain: the TTLs release what the clients left (sessions, paused generations, responses).
        await asyncio.sleep(IDLE_TTL_S * 2 + 1)
        left_sessions = 0
        for sid in sorted(tally.sessions):
            for a in crew[:2]:  # one agent of each tenant: every session left must be gone for both
                left_sessions += (await a.http.get(f"/sessions/{sid}")).status_code != 404
        for a in crew:
            await a.close()
        after = metrics(base)
    finally:
        proc.terminate()
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    window = max(seconds / 4, 10.0)
    first = [v for t, v in rss if t <= window] or [0.0]
    last = [v for t, v in rss if t >= seconds - window] or first
    leaked = {name: after.get(f"infercept_{name}", 0.0) for name in ("kv_device_blocks_used", "kv_host_blocks_used",
                                                                     "paused_requests", "requests_running",
                                                                     "requests_waiting")}
    checks = {
        "no 5xx and no loop exception": not tally.errors,
        "sessions idle or paused after each post": bool(tally.session_states)
        and set(tally.session_states) <= {"idle", "paused"},
        "sessions left to the TTL are gone": left_sessions == 0,
        "nothing left paused, running or in KV": not any(leaked.values()),
        "RSS flat (last window <= first + 10%)": max(last) <= max(first) * 1.10,
        "SIGTERM exit 0": exit_code == 0,
    }
    return {"policy": policy, "seconds": seconds, "agents": agents, "steps": dict(tally.steps),
            "statuses": {str(k): v for k, v in sorted(tally.statuses.items())}, "errors": tally.errors[:20],
            "session_states_after_posts": dict(tally.session_states),
            "sessions_left_to_ttl": len(tally.sessions), "sessions_not_gone": left_sessions, "left_after_drain": leaked,
            "rss_mb": {"first_window_max": round(max(first), 1), "last_window_max": round(max(last), 1)},
            "resumes": after.get("infercept_resumes_total", 0.0),
            "evictions": after.get("infercept_paused_evictions_total", 0.0),
            "checks": checks, "ok": all(checks.values()),
            # what the server logged (warnings and tracebacks), to tell a server fault from a client's
            "server_log_tail": "" if all(checks.values()) else log_path.read_text()[-4000:]}


def table(results: list[dict]) -> str:
    kinds = list(STEPS)
    rows = ["| policy | " + " | ".join(kinds) + " | statuses | resumes | RSS MB first/last | leaked | ok |",
            "|---" * (len(kinds) + 6) + "|"]
    for r in results:
        rows.append(f"| {r['policy']} | " + " | ".join(str(r["steps"].get(k, 0)) for k in kinds)
                    + f" | {' '.join(f'{k}:{v}' for k, v in r['statuses'].items())} | {r['resumes']:.0f}"
                    + f" | {r['rss_mb']['first_window_max']}/{r['rss_mb']['last_window_max']}"
                    + f" | {sum(r['left_after_drain'].values()):.0f} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float)
    length.add_argument("--seconds", type=float)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--policies", nargs="+", default=["infercept", "prefix-cache"])
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="result JSON (default: benchmarks/results/soak-<date>.json)")
    args = p.parse_args(argv)
    seconds = args.seconds or (args.minutes or 10) * 60
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for policy in args.policies:
            print(f"soak: {policy}, {args.agents} agents, {seconds:.0f} s ...", flush=True)
            results.append(asyncio.run(soak_policy(policy, seconds, args.agents, args.model, args.seed, Path(workdir))))
            for name, ok in results[-1]["checks"].items():
                print(f"  {'ok  ' if ok else 'FAIL'} {name}")
            for error in results[-1]["errors"]:
                print(f"  error: {error}")
            if results[-1]["server_log_tail"]:
                print("  the server's log, its end:\n" + results[-1]["server_log_tail"])
    print(table(results))
    output = Path(args.output or Path(__file__).parent / "results" / f"soak-{time.strftime('%Y-%m-%d')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"machine": machine(), "results": results}, indent=2))
    print(f"wrote {output}")
    return 0 if all(r["ok"] for r in results) else 1


def machine() -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from machine import cpu_name  # benchmarks/machine.py
    return cpu_name()


if __name__ == "__main__":
    sys.exit(main())
