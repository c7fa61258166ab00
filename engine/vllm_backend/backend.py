"""`VllmBackend`: vLLM V1 (`AsyncLLM`, in a worker process) behind `EngineBackend`, policy `preserve`.

vLLM runs in its own environment (worker.py); this side keeps what the server must see exactly as our
engine gives it: the text (our detokenizer, our stop strings), the turn's verdict on tool calls (our
`CallJudge`, on the turn's final text), and the reuse a resumed turn had.

A request that may pause (tools, or `pause_on_stop`) is a vLLM streaming-input session. Its turn stops
on EOS, a stop token or max_tokens; then vLLM keeps it waiting with its KV, and this side decides:

    turn ends ──> every call counts / pause_on_stop ──> paused: vLLM keeps the KV until `resume` or `abort`
            └──> otherwise ──────────────────────────> finished: the session's input ends, vLLM frees it

vLLM drops a session's last sampled token when the next chunk arrives (it never computed its KV), so a
resume sends that token again before the appended ones. Its KV stays where it is: "preserve", with no
policy yet (discard, swap and min-waste come with a scheduler subclass: docs/operators.md §7).

Differences from our engine, by design of this step: a turn with tools is judged when it stops, not as
soon as a call closes (a model that writes on after its call without EOS is judged at its stop), and
turns that may pause take no stop strings (ValueError, params.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass, field

from ..backend import EngineBackend, EngineInfo, EngineSnapshot, KVLocation
from ..detokenizer import IncrementalDetokenizer
from ..outputs import RequestOutput, SampledToken
from ..request import InterceptParams
from ..sampling_params import SamplingParams
from ..tool_format import CallJudge, TurnCalls
from .params import vllm_sampling_fields
from .process import WorkerProcess

STARTUP_TIMEOUT_S = 600.0  # a large model's first load; vLLM CPU with SmolLM2 is ready in ~40 s here


def default_vllm_python() -> str:
    """$INFERCEPT_VLLM_PYTHON, else the repository's .venv-vllm (`make vllm-env`)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get("INFERCEPT_VLLM_PYTHON") or os.path.join(repo, ".venv-vllm", "bin", "python")


@dataclass(eq=False)
class _Generation:
    """One request as this side follows it across its turns."""

    request_id: str
    prompt: list[int]  # the first turn's prompt (RequestOutput.prompt_token_ids, as our engine reports it)
    context: list[int]  # every token so far: prompts, appended and generated
    params: SamplingParams
    intercept: InterceptParams | None
    judge: CallJudge | None
    detok: IncrementalDetokenizer
    turn_start: int  # where this turn's generated tokens begin in `context`
    session: bool  # a vLLM streaming-input session: its first turn may pause (fixed for its life)
    cached: int = 0  # this turn's context tokens whose KV was reused
    logprobs: list[SampledToken] = field(default_factory=list)
    paused: bool = False
    inbox: asyncio.Queue | None = None  # the worker's messages for the turn being streamed
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def may_pause(self) -> bool:
        """This turn's rule lets it pause (a resumed turn has its own rule, often none)."""
        return _may_pause(self.intercept)

    @property
    def output_ids(self) -> list[int]:
        return self.context[self.turn_start:]

    @property
    def kept_kv(self) -> int:
        """KV tokens vLLM holds for it: the context but its last token (sampled, never fed back)."""
        return len(self.context) - 1

    def deliver(self, msg: dict) -> None:
        """From the reader thread: hand a worker message to the turn's stream, if one is open."""
        if self.inbox is not None:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, msg)


class VllmBackend(EngineBackend):
    def __init__(self, worker: WorkerProcess, info: EngineInfo, tokenizer, block_size: int):
        self.worker = worker
        self.info = info
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._generations: dict[str, _Generation] = {}
        self._lock = threading.Lock()  # _generations: the event loop and the reader thread
        self._stats: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._seq = 0
        self._running = False
        self._died = False
        worker.listen(self._on_message, self._on_worker_exit)

    @classmethod
    def create(cls, model: str | None = None, *, python: str | None = None, policy: str = "preserve",
               dtype: str = "auto", max_model_len: int | None = None, kv_cache_gb: float | None = None,
               max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
               enable_prefix_caching: bool = True, seed: int = 0, env: dict[str, str] | None = None,
               startup_timeout: float = STARTUP_TIMEOUT_S) -> "VllmBackend":
        """Start vLLM on `model` (None: the embedded default) in `python` (default_vllm_python()).
        Blocks until vLLM is ready. `env`: extra environment for the worker (VLLM_* settings)."""
        from transformers import AutoTokenizer

        from ..engine import eos_ids_of

        if policy != "preserve":
            raise ValueError(f"the vLLM backend runs policy 'preserve' only (for now), not {policy!r}")
        python = python or default_vllm_python()
        if not os.path.isfile(python):
            raise FileNotFoundError(f"no python for the vLLM backend at {python!r}: run `make vllm-env`, or pass "
                                    "--vllm-python / set INFERCEPT_VLLM_PYTHON")
        if model is None:
            from ..download import ensure_default_model
            model = ensure_default_model()
        engine_args = {"model": model, "dtype": dtype, "seed": seed, "max_num_seqs": max_num_seqs,
                       "enable_prefix_caching": enable_prefix_caching, "max_model_len": max_model_len,
                       "max_num_batched_tokens": max_num_batched_tokens,
                       "kv_cache_memory_bytes": None if kv_cache_gb is None else int(kv_cache_gb * 2**30)}
        worker = WorkerProcess(python, {k: v for k, v in engine_args.items() if v is not None}, env or {})
        facts = worker.start(startup_timeout)
        tokenizer = AutoTokenizer.from_pretrained(model)
        with open(os.path.join(model, "config.json")) as f:
            model_type = json.load(f)["model_type"]
        info = EngineInfo(model=model, model_type=model_type, max_model_len=facts["max_model_len"],
                          vocab_size=facts["vocab_size"], eos_token_ids=eos_ids_of(model, tokenizer),
                          chat_template=tokenizer.chat_template, dtype=facts["dtype"], device=facts["device"],
                          kv_capacity_tokens=facts["num_blocks"] * facts["block_size"],
                          guided_decoding=False)  # not wired to vLLM's structured outputs yet (params.py)
        return cls(worker, info, tokenizer, facts["block_size"])

    # -- life cycle -------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._running and not self._died

    @property
    def failed(self) -> bool:
        return self._died

    def start(self) -> None:
        self._running = True  # vLLM has been ready since `create`

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._end_streams(lambda g: True, RuntimeError("the server is shutting down"))
        self.worker.stop()

    def _on_worker_exit(self) -> None:
        self._died = True
        self._end_streams(lambda g: True, RuntimeError("the vLLM worker stopped"))
        with self._lock:
            waiting, self._stats = list(self._stats.values()), {}
        for loop, future in waiting:
            loop.call_soon_threadsafe(future.set_exception, RuntimeError("the vLLM worker stopped"))

    def _end_streams(self, which, error: Exception) -> None:
        """Forget the generations `which` selects; an open stream raises `error` to its caller."""
        with self._lock:
            chosen = [g for g in self._generations.values() if which(g)]
            for g in chosen:
                del self._generations[g.request_id]
        for g in chosen:
            g.deliver({"op": "error", "error": error})
            if self.worker.alive:
                self.worker.send({"op": "abort", "id": g.request_id})

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, prompt, params, request_id, intercept=None):
        self._check_running()
        self._check_tokens(prompt, len(prompt))
        if not prompt:
            raise ValueError("the prompt is empty")
        gen = _Generation(request_id, list(prompt), list(prompt), params, intercept, _judge(intercept),
                          self._detokenizer(prompt, params), turn_start=len(prompt), session=_may_pause(intercept))
        fields = vllm_sampling_fields(params, gen.session)
        with self._lock:
            if request_id in self._generations:
                raise ValueError(f"request id {request_id!r} is in use")
            self._generations[request_id] = gen
        self._open(gen)
        self.worker.send({"op": "generate", "id": request_id, "prompt": list(prompt), "params": fields,
                          "resumable": gen.session})
        async for out in self._stream(gen):
            yield out

    async def resume(self, request_id, appended, params=None, intercept=None):
        self._check_running()
        with self._lock:
            gen = self._generations.get(request_id)
        if gen is None:
            raise KeyError(request_id)
        if not gen.paused:
            raise ValueError(f"request {request_id!r} is generating, not paused")
        if not appended:
            raise ValueError("nothing to append: a resume needs at least one token")
        self._check_tokens(appended, len(gen.context) + len(appended))
        params = params or gen.params
        fields = vllm_sampling_fields(params, resumable=True)  # still a session, whatever the turn's rule
        gen.params, gen.intercept = params, intercept or gen.intercept
        gen.judge = _judge(gen.intercept)
        # vLLM dropped the last sampled token, whose KV it never computed: it leads the new chunk.
        chunk = [gen.context[-1], *appended]
        gen.cached = gen.kept_kv
        gen.context += appended
        gen.turn_start = len(gen.context)
        gen.detok = self._detokenizer(gen.context, params)
        gen.logprobs = []
        gen.paused = False
        self._open(gen)
        self.worker.send({"op": "resume", "id": request_id, "tokens": chunk, "params": fields})
        async for out in self._stream(gen):
            yield out

    def abort(self, request_id: str) -> None:
        self._end_streams(lambda g: g.request_id == request_id, RuntimeError(f"request {request_id} was aborted"))

    def cancel_in_flight(self, reason: str) -> None:
        self._end_streams(lambda g: not g.paused, RuntimeError(reason))

    def _check_running(self) -> None:
        if not self.is_running:
            raise RuntimeError("the engine is not running")

    def _check_tokens(self, ids, context_len: int) -> None:
        if any(not isinstance(t, int) or not 0 <= t < self.info.vocab_size for t in ids):
            raise ValueError(f"token ids must be integers in [0, {self.info.vocab_size})")
        if context_len >= self.info.max_model_len:
            raise ValueError(f"the context would have {context_len} tokens; this model's limit is "
                             f"{self.info.max_model_len}")

    def _detokenizer(self, context: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, context, params.skip_special_tokens, params.stop)

    @staticmethod
    def _open(gen: _Generation) -> None:
        gen.loop, gen.inbox = asyncio.get_running_loop(), asyncio.Queue()

    # -- a turn's outputs -------------------------------------------------------------------------
    async def _stream(self, gen: _Generation):
        """The turn's outputs until it pauses or finishes; leaving early aborts the request."""
        done = False
        try:
            while not done:
                msg = await gen.inbox.get()
                if msg["op"] == "error":
                    done = True
                    raise msg["error"]
                if msg["op"] == "gone":  # vLLM let the request go before its turn ended
                    done = True
                    self._forget(gen)
                    error = msg["error"] or "the request ended in vLLM before its turn did"
                    raise (ValueError if msg.get("bad_input") else RuntimeError)(error)
                out, done = self._advance(gen, msg)
                yield out
        finally:
            gen.inbox = None
            if not done:
                self.abort(gen.request_id)

    def _advance(self, gen: _Generation, msg: dict) -> tuple[RequestOutput, bool]:
        """Take one output message into the turn; returns the caller's output and whether the turn ended."""
        stop_string = None
        for token in msg["tokens"]:
            gen.context.append(token)
            stop_string = stop_string or gen.detok.add(token)
        if msg["logprobs"] is not None and gen.params.logprobs is not None:
            gen.logprobs += [_sampled(t, lp, entries, gen.params.logprobs)
                             for t, (lp, entries) in zip(msg["tokens"], msg["logprobs"])]
        reason, stop_reason = msg["finish_reason"], msg["stop_reason"]
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string  # found here first: vLLM's own stop is moot
        elif reason == "stop" and stop_reason is None:
            stop_reason = gen.context[-1]  # EOS: our engine names the token, vLLM does not
        if gen.turn_start == len(gen.context) - len(msg["tokens"]) and not gen.cached:
            gen.cached = msg["cached"]  # a fresh request's prefix-cache hit, reported with its first output
        if reason is None:
            return self._output(gen, finished=False), False
        judged = None
        paused = False
        if gen.may_pause:
            judged = gen.judge.judge(gen.detok.text) if gen.judge is not None else None
            paused = bool(judged is not None and judged.calls and judged.complete) or \
                (judged is None and gen.intercept.pause_on_stop)
        if paused:
            gen.paused = True
        else:
            self._forget(gen)
            if gen.session:
                self.worker.send({"op": "end", "id": gen.request_id})  # the session's input ends: vLLM frees it
            elif stop_string is not None and msg["finish_reason"] is None:
                self.worker.send({"op": "abort", "id": gen.request_id})
        if paused or (judged is not None and judged.calls):
            reason = "tool_calls" if judged is not None and judged.calls else "intercept"
        return self._output(gen, finished=not paused, reason=reason, stop_reason=stop_reason, judged=judged), True

    def _output(self, gen: _Generation, finished: bool, reason: str | None = None, stop_reason=None,
                judged: TurnCalls | None = None) -> RequestOutput:
        turn_done = finished or gen.paused
        return RequestOutput(
            request_id=gen.request_id, prompt_token_ids=gen.prompt, token_ids=list(gen.output_ids),
            text=gen.detok.visible_text(turn_done), finished=finished, finish_reason=reason,
            stop_reason=stop_reason, logprobs=list(gen.logprobs) if gen.params.logprobs is not None else None,
            num_cached_tokens=gen.cached, paused=gen.paused,
            tool_calls=list(judged.calls) if judged is not None else [],
            content=judged.content if judged is not None else None)

    def _forget(self, gen: _Generation) -> None:
        with self._lock:
            if self._generations.get(gen.request_id) is gen:
                del self._generations[gen.request_id]

    # -- the worker's messages (reader thread) ----------------------------------------------------
    def _on_message(self, msg: dict) -> None:
        if msg["op"] == "stats":
            loop, future = self._stats.pop(msg["seq"])
            loop.call_soon_threadsafe(future.set_result, msg["stats"])
            return
        with self._lock:
            gen = self._generations.get(msg["id"])
            if gen is not None and msg["op"] == "gone" and gen.inbox is None:
                del self._generations[msg["id"]]  # a paused request vLLM ended: nothing to resume
        if gen is not None:
            gen.deliver(msg)

    # -- state ------------------------------------------------------------------------------------
    def _paused(self) -> list[_Generation]:
        with self._lock:
            return [g for g in self._generations.values() if g.paused]

    async def kv_location(self, request_id: str) -> KVLocation:
        """Paused: the context's KV is on the device but its last token's (preserve; vLLM has no host
        tier here). Generating: the same count as of the last output vLLM reported."""
        with self._lock:
            gen = self._generations.get(request_id)
        if gen is None:
            raise KeyError(request_id)
        return KVLocation(device=gen.kept_kv, discarded=len(gen.context) - gen.kept_kv)

    def paused_kv_tokens(self, request_id: str) -> int:
        with self._lock:
            gen = self._generations.get(request_id)
        return gen.kept_kv if gen is not None and gen.paused else 0

    async def snapshot(self) -> EngineSnapshot:
        """vLLM's numbers as of its last step (it reports after each one), and the paused requests."""
        stats = await self._worker_stats()
        paused = self._paused()
        total = self.info.kv_capacity_tokens // self.block_size
        return EngineSnapshot(
            num_steps=stats["num_steps"], num_preemptions=stats["num_preemptions"],
            device_blocks_total=total, device_blocks_used=round(stats["kv_cache_usage"] * total),
            prefix_queried_blocks=stats["prefix_queried_tokens"] // self.block_size,
            prefix_hit_blocks=stats["prefix_hit_tokens"] // self.block_size,
            num_running=stats["num_running"], num_waiting=max(stats["num_waiting"] - len(paused), 0),
            paused_by_state={"device": len(paused), "host": 0, "partial": 0, "discarded": 0},
            paused_tokens_by_location={"device": sum(g.kept_kv for g in paused), "host": 0, "discarded": 0})

    async def _worker_stats(self) -> dict:
        """The worker's stats message: vLLM's last reported numbers, and `num_requests` it still serves."""
        self._check_running()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._stats[seq] = (loop, future)
        self.worker.send({"op": "stats", "seq": seq})
        return await future


def _may_pause(intercept: InterceptParams | None) -> bool:
    return intercept is not None and (intercept.tool_parser is not None or intercept.pause_on_stop)


def _judge(intercept: InterceptParams | None) -> CallJudge | None:
    if intercept is None or intercept.tool_parser is None:
        return None
    return CallJudge(intercept.tool_parser, intercept.tools, intercept.parallel_calls, intercept.text_prefix,
                     intercept.reasoning_parser)


def _sampled(token_id: int, logprob: float, entries: list, k: int) -> SampledToken:
    """A token's logprobs as our engine reports them: its own and the top `k` by rank."""
    return SampledToken(token_id, logprob, {t: lp for t, lp, rank in entries if rank is not None and rank <= k}
                        if k else None)
