"""Replay an agent trace against a running server over HTTP, in wall-clock time.

Each trace request (`benchmarks/workload.py`) arrives at its Poisson arrival time and runs its
segments in order: decode exactly `decode_tokens` tokens, wait `duration_s` (the interception), append
`returned_tokens` tokens, decode the next segment, ... Prompts and returned tokens are seeded random
token ids, and every turn is greedy with `ignore_eos` and `max_tokens` = the segment's decode tokens,
so the lengths are the trace's whatever the model says: a model cannot be made to emit a tool call at
a given length, but it can be made to stop at one.

Three ways to talk to the server (`--api`):

- `resume` (InferCept, implicit resume at token level): `POST /v1/completions` with the prompt as
  token ids and the `intercept` extension, so the end of each non-final segment pauses the generation
  in the engine instead of finishing it; the next step sends the paused generation's whole token
  sequence (prompt + generated, from `return_token_ids`) + the returned tokens, which the server
  recognizes and resumes. `usage.prompt_tokens_details.cached_tokens` says how much was reused.
- `session` (InferCept's native session API, `/v1/sessions`, token-level): create a session, then post
  each step's new tokens to it with `intercept`, so it stays paused between steps (`SessionApi`).
- `discard` (any OpenAI-compatible server, e.g. `vllm serve`): every step is a fresh completion of the
  whole history (token ids), the way an agent framework talks to a server that cannot pause. A peer
  with prefix caching may still reuse the history's KV; `cached_tokens` reports it where the peer does.

Per request it records: arrival, TTFT (first token of the first step, from the arrival), end-to-end
time, time spent in interceptions, output tokens, prompt tokens and cached prompt tokens (summed over
steps), and the normalized latency (e2e - interception time) / output tokens (paper §5). Requests still
running at `--until` are cancelled and count with the time and tokens they have so far (as in the
paper's artifact); a request that failed counts as unfinished with its error.

    python benchmarks/workload.py --rate 0.5 --duration 30 --cpu-scale -o /tmp/t.jsonl
    python benchmarks/replay.py /tmp/t.jsonl --base-url http://127.0.0.1:8000 --api resume -o /tmp/r.jsonl
    python benchmarks/replay.py /tmp/t.jsonl --base-url http://127.0.0.1:8001 --api discard --model m
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import read_jsonl  # noqa: E402

APIS = ("resume", "session", "discard")
# Synthetic prompt and tool-result tokens: ordinary ids of any tokenizer with >= 20k entries (Llama,
# Qwen, SmolLM2), away from the special tokens at the low end.
TOKEN_ID_RANGE = (1000, 20000)
# The server's intercept kinds; the trace's "env" (ALFWorld) is a tool call to an environment.
INTERCEPT_KINDS = {"tool": "tool", "env": "tool", "human": "human", "model": "model"}


@dataclass
class RequestRecord:
    id: str
    augment: str
    arrival: float  # seconds since the replay started (the trace's arrival time)
    steps: int = 0  # completions sent
    ttft: float | None = None  # first token of the first step, from the arrival
    step_ttfts: list[float] = field(default_factory=list)  # each step's first token, from its send
    e2e: float | None = None  # finish (or the cut-off) minus arrival
    interception_s: float = 0.0  # measured time between a step's end and the next step's send
    output_tokens: int = 0
    prompt_tokens: int = 0  # summed over steps
    cached_tokens: int = 0  # summed over steps
    finished: bool = False
    error: str | None = None

    @property
    def normalized_latency(self) -> float:
        """(e2e - interception time) / output tokens. A request cut off before its first token counts as
        if that token came at the cut-off (a lower bound on how slow it was, not infinity: one request
        that arrived a second before the cut-off must not decide a whole run); a failed one is infinite."""
        if self.e2e is None:
            return math.inf
        return (self.e2e - self.interception_s) / max(self.output_tokens, 1)

    def to_dict(self) -> dict:
        return asdict(self) | {"normalized_latency": self.normalized_latency}


@dataclass
class StepResult:
    token_ids: list[int]  # the tokens this step generated
    ttft: float  # seconds from the send to the first token
    prompt_tokens: int
    cached_tokens: int


def synthetic_tokens(request_id: str, what: str, n: int, seed: int) -> list[int]:
    """Deterministic filler ids for a request's prompt or one of its tool results."""
    rng = random.Random(f"{seed}-{request_id}-{what}")
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


class ApiError(RuntimeError):
    pass


# -- the three APIs ------------------------------------------------------------------------------------
class CompletionsApi:
    """`/v1/completions` with token-id prompts: `resume` (interceptible) or `discard` (plain)."""

    def __init__(self, client: httpx.AsyncClient, model: str, interceptible: bool):
        self.client, self.model, self.interceptible = client, model, interceptible

    async def open(self, request_id: str) -> None:
        pass

    async def close(self, request_id: str) -> None:
        pass

    async def step(self, request_id: str, history: list[int], new_tokens: list[int], decode_tokens: int,
                   interception: dict | None) -> StepResult:
        body = {"model": self.model, "prompt": history + new_tokens, "max_tokens": decode_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.interceptible and interception is not None:
            # No duration hint: the server must estimate it, as it would for a real agent.
            body["intercept"] = {"kind": INTERCEPT_KINDS.get(interception["kind"], "tool")}
        return await stream_step(self.client, "/v1/completions", body, request_id)


class SessionApi:
    """InferCept's native session API at token level (server/serving_session_tokens.py): `POST /v1/sessions`
    {model} -> {id}; then per step `POST /v1/sessions/{id}/messages` with only the step's new tokens
    (`token_ids`: the prompt, then each interception's returned tokens), streamed as session events
    (`delta` {text, token_ids} ..., `done` {token_ids, usage}); `intercept` leaves the session paused
    at the end of a non-final segment. `DELETE /v1/sessions/{id}` releases it."""

    def __init__(self, client: httpx.AsyncClient, model: str):
        self.client, self.model = client, model
        self.session_ids: dict[str, str] = {}

    async def open(self, request_id: str) -> None:
        r = await self.client.post("/v1/sessions", json={"model": self.model})
        if r.status_code == 404:
            raise ApiError("the server has no /v1/sessions endpoint")
        r.raise_for_status()
        self.session_ids[request_id] = r.json()["id"]

    async def close(self, request_id: str) -> None:
        session_id = self.session_ids.pop(request_id, None)
        if session_id is not None:
            await self.client.delete(f"/v1/sessions/{session_id}")

    async def step(self, request_id: str, history: list[int], new_tokens: list[int], decode_tokens: int,
                   interception: dict | None) -> StepResult:
        body = {"token_ids": new_tokens, "max_tokens": decode_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        if interception is not None:
            body["intercept"] = {"kind": INTERCEPT_KINDS.get(interception["kind"], "tool")}
        path = f"/v1/sessions/{self.session_ids[request_id]}/messages"
        sent = time.monotonic()
        ttft = outcome = None
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                raise ApiError(f"{request_id}: HTTP {r.status_code} from {path}: {text}")
            kind = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:].strip())
                    if kind == "error":
                        raise ApiError(f"{request_id}: {data['error'].get('message')}")
                    if kind == "delta" and ttft is None:
                        ttft = time.monotonic() - sent
                    if kind == "done":
                        outcome = data
        if outcome is None:
            raise ApiError(f"{request_id}: the session stream ended without a done event")
        return checked_step(request_id, body, outcome["token_ids"], ttft if ttft is not None else time.monotonic() - sent,
                            outcome["usage"])


async def stream_step(client: httpx.AsyncClient, path: str, body: dict, request_id: str) -> StepResult:
    """Send one streamed completion; collect the generated token ids, TTFT and usage."""
    sent = time.monotonic()
    ttft = None
    token_ids: list[int] = []
    usage = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:300]
            raise ApiError(f"{request_id}: HTTP {r.status_code} from {path}: {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ApiError(f"{request_id}: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or ():
                if ttft is None and (choice.get("text") or choice.get("token_ids") or choice.get("finish_reason")):
                    ttft = time.monotonic() - sent
                # Our server sends the whole turn's ids with the last chunk, vLLM each chunk's own:
                # appending covers both.
                token_ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return checked_step(request_id, body, token_ids, ttft if ttft is not None else time.monotonic() - sent, usage)


def checked_step(request_id: str, body: dict, token_ids: list[int], ttft: float, usage: dict | None) -> StepResult:
    """A step's result, once it generated exactly the tokens the trace asked for."""
    if len(token_ids) != body["max_tokens"]:
        raise ApiError(f"{request_id}: got {len(token_ids)} token ids, asked for {body['max_tokens']} "
                       "(the server must support return_token_ids and ignore_eos)")
    details = (usage or {}).get("prompt_tokens_details") or {}
    return StepResult(token_ids, ttft, (usage or {}).get("prompt_tokens", 0), details.get("cached_tokens") or 0)


# -- one request, the whole trace -------------------------------------------------------------------
async def run_request(api, spec: dict, record: RequestRecord, start: float, seed: int) -> None:
    """Run one trace request's segments; fills `record` as it goes (so a cancelled one keeps its progress)."""
    history: list[int] = []
    new = synthetic_tokens(spec["id"], "prompt", spec["prompt_tokens"], seed)
    await api.open(spec["id"])
    try:
        for j, seg in enumerate(spec["segments"]):
            sent = time.monotonic() - start
            result = await api.step(spec["id"], history, new, seg["decode_tokens"], seg["interception"])
            now = time.monotonic() - start
            record.steps += 1
            record.step_ttfts.append(result.ttft)
            if record.ttft is None:
                record.ttft = sent - record.arrival + result.ttft
            record.output_tokens += len(result.token_ids)
            record.prompt_tokens += result.prompt_tokens
            record.cached_tokens += result.cached_tokens
            record.e2e = now - record.arrival
            history = history + new + result.token_ids
            if seg["interception"] is None:
                break
            paused_at = time.monotonic()
            await asyncio.sleep(seg["interception"]["duration_s"])
            record.interception_s += time.monotonic() - paused_at
            new = synthetic_tokens(spec["id"], f"returned-{j}", seg["returned_tokens"], seed)
        record.finished = True
    finally:
        await api.close(spec["id"])


def make_api(name: str, client: httpx.AsyncClient, model: str):
    if name == "session":
        return SessionApi(client, model)
    if name in ("resume", "discard"):
        return CompletionsApi(client, model, interceptible=name == "resume")
    raise ValueError(f"unknown api {name!r}; choose one of {', '.join(APIS)}")


async def replay(trace: list[dict], base_url: str, *, api: str = "resume", model: str,
                 until: float | None = None, seed: int = 0, api_key: str = "unused",
                 progress=None) -> list[RequestRecord]:
    """Replay `trace` against the server at `base_url` (no `/v1`); stop at `until` seconds after the
    start (default: when every request is done). `progress(done, total)` is called as requests end."""
    records = [RequestRecord(r["id"], r["augment"], r["arrival"]) for r in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=10, read=None, write=30, pool=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout,
                                 headers={"Authorization": f"Bearer {api_key}"}) as client:
        driver = make_api(api, client, model)
        start = time.monotonic()
        done = 0

        async def one(spec: dict, record: RequestRecord) -> None:
            nonlocal done
            await asyncio.sleep(max(0.0, start + spec["arrival"] - time.monotonic()))
            try:
                await run_request(driver, spec, record, start, seed)
            except (ApiError, httpx.HTTPError, KeyError, ValueError) as e:
                record.error = f"{type(e).__name__}: {e}"
            done += 1
            if progress is not None:
                progress(done, len(records))

        tasks = [asyncio.ensure_future(one(spec, rec)) for spec, rec in zip(trace, records)]
        finished, pending = await asyncio.wait(tasks, timeout=until)
        cut = time.monotonic() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for record in records:
            if not record.finished and record.error is None and record.arrival < cut:
                record.e2e = cut - record.arrival  # cut off: counts with its progress so far
    return records


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]; infinite values stay infinite); nan for no data."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def summarize(records: list[RequestRecord], elapsed: float) -> dict:
    """Per-run numbers. Normalized latency counts every request that arrived (an unfinished one with its
    progress so far, a failed one as infinitely slow); TTFT and cached share are over what has them.
    Program view: completion time = finish - arrival, tools included (unfinished: infinite,
    so an overloaded run shows as such); resumed-step TTFT = a later step's first token from its send."""
    arrived = [r for r in records if r.e2e is not None or r.finished or r.error]
    norm = [r.normalized_latency for r in arrived]
    finite = [x for x in norm if math.isfinite(x)]
    ttft = [r.ttft for r in arrived if r.ttft is not None]
    completion = [r.e2e if r.finished and r.e2e is not None else math.inf for r in arrived]
    resumed = [t for r in records for t in r.step_ttfts[1:]]
    prompt = sum(r.prompt_tokens for r in records)
    return {
        "requests": len(records),
        "arrived": len(arrived),
        "finished": sum(r.finished for r in records),
        "errors": sum(r.error is not None for r in records),
        "first_error": next((r.error for r in records if r.error), None),
        "elapsed_s": elapsed,
        "completed_per_s": sum(r.finished for r in records) / elapsed if elapsed > 0 else math.nan,
        # mean over requests; a failed request makes it infinite
        "normalized_latency_mean": statistics.fmean(norm) if norm and len(finite) == len(norm) else
        (math.inf if norm else math.nan),
        "normalized_latency_median": statistics.median(norm) if norm else math.nan,
        "ttft_mean": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_median": statistics.median(ttft) if ttft else math.nan,
        "resumed_ttft_median": statistics.median(resumed) if resumed else math.nan,
        "completion_p50": percentile(completion, 50),
        "completion_p90": percentile(completion, 90),
        "output_tokens": sum(r.output_tokens for r in records),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "cached_share": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "interception_s": sum(r.interception_s for r in records),
    }


def default_model(base_url: str, api_key: str = "unused") -> str:
    """The first model the server lists (`GET /v1/models`)."""
    r = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="JSON lines trace (benchmarks/workload.py)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--api", choices=APIS, default="resume")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--until", type=float, default=None, help="cut the replay off after this many seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    parser.add_argument("-o", "--output", default=None, help="write per-request records (JSON lines) here")
    args = parser.parse_args(argv)
    trace = read_jsonl(args.trace)
    model = args.model or default_model(args.base_url, args.api_key)
    start = time.monotonic()
    records = asyncio.run(replay(trace, args.base_url, api=args.api, model=model, until=args.until, seed=args.seed,
                                 api_key=args.api_key))
    summary = summarize(records, time.monotonic() - start)
    if args.output:
        with open(args.output, "w") as f:
            for r in records:
                f.write(json.dumps(r.to_dict()) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
