"""`VllmBackend`: vLLM V1 (`AsyncLLM`, in a worker process) behind `EngineBackend`, with our KV policy.

vLLM runs in its own environment (worker.py); this side runs the output stage both backends share
(output_stage.py: our detokenizer, our stop strings, the verdict on the turn's tool calls) on the tokens
vLLM streams, and keeps the reuse a resumed turn had.

A request that may pause (tools, or `pause_on_stop`) is a vLLM streaming-input session. Its turn stops
on EOS, a stop token or max_tokens, or where the turn's rule ends it (a stop string, tool calls the model
has moved past: `TurnWatch`, run by our scheduler inside vLLM on every token, so the turn ends on the same
token as on our engine); then vLLM keeps it waiting with its KV, and this side decides:

    turn ends ──> every call counts / pause_on_stop ──> paused: vLLM keeps the KV until `resume` or `abort`
            └──> otherwise ──────────────────────────> finished: the session's input ends, vLLM frees it

vLLM drops a session's last sampled token when the next chunk arrives (it never computed its KV), so a
resume sends that token again before the appended ones.

A turn whose calls one of vLLM's own tool parsers reads (family ``vllm:NAME``, `--tool-parser NAME`) has
no call rule inside vLLM: it ends where the model ends it (EOS, a stop token or string, its length), and
the worker runs vLLM's parser on it there (tool_calls.py); the calls come with its last output, and the
output stage judges them as it judges ours. While the turn runs, the content vLLM's parser streams (read
as the turn is written) comes with each output, for a stream to show (`RequestOutput.streamed_content`).

Where a paused session's KV waits is the policy's choice, made inside vLLM by `InterceptScheduler`
(scheduler.py, the same `engine.policy` code as the native engine): `preserve` keeps it, `infercept`
keeps, swaps or discards it by min-waste, `swap` swaps every pause; all give paused KV up before vLLM
preempts live work. Swapped KV waits in a host pool (`--host-kv-gb`) that vLLM fills and reads through
our KV connector (host_tier.py). `prefix-cache` and `discard` are stock vLLM as agent loops run on it
today: no sessions and vLLM's own scheduler; a turn is a request that ends, and a resume is a new
request of the whole context (prefix-cached, or for `discard` recomputed in full).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field, replace

from ..backend import EngineBackend, EngineInfo, EngineSnapshot, KVLocation
from ..config import CacheConfig, available_host_memory_bytes, kv_cache_fraction_or_default
from ..output_stage import GO_ON, Action, TurnOutput, TurnRule, Verdict, may_pause
from ..outputs import RequestOutput, SampledToken
from ..policy import base_policy
from ..reasoning_parsers import THINK_END, THINK_START
from ..request import InterceptParams
from ..sampling_params import SamplingParams
from ..stats import RESUME_KV_PLACES, resume_kv_place
from ..tool_parsers import PARSERS, vllm_parser_name
from .params import vllm_sampling_fields
from .policy_parts import summary, vllm_policy
from .process import WorkerProcess

# Policies on this backend: those run by our scheduler in vLLM over streaming sessions, and stock vLLM
# (policy -> its prefix caching).
SESSION_POLICIES = ("preserve", "infercept", "infercept-paper", "swap")
STOCK_POLICIES = {"prefix-cache": True, "discard": False}
SCHEDULER_CLS = "engine.vllm_backend.scheduler.InterceptScheduler"
ASYNC_SCHEDULER_CLS = "engine.vllm_backend.scheduler.AsyncInterceptScheduler"  # engine_args async_scheduling=True
HOST_TIER_CONNECTOR = ("HostTierConnector", "engine.vllm_backend.host_tier")  # class, module (vLLM imports it)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
logger = logging.getLogger("infercept.vllm_backend")
STARTUP_TIMEOUT_S = 600.0  # a large model's first load; vLLM CPU with SmolLM2 is ready in ~40 s here


def host_tier_config(host_bytes: int) -> dict:
    """vLLM's `kv_transfer_config` for our host tier (host_tier.py) with a pool of `host_bytes`."""
    name, module = HOST_TIER_CONNECTOR
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_bytes": int(host_bytes)}}


def default_vllm_python() -> str:
    """$INFERCEPT_VLLM_PYTHON, else the repository's .venv-vllm (`make vllm-env`)."""
    return os.environ.get("INFERCEPT_VLLM_PYTHON") or os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python")


@dataclass(eq=False)
class _Generation:
    """One request as this side follows it across its turns."""

    request_id: str
    prompt: list[int]  # the first turn's prompt (RequestOutput.prompt_token_ids, as our engine reports it)
    context: list[int]  # every token so far: prompts, appended and generated
    params: SamplingParams
    intercept: InterceptParams | None
    stage: TurnOutput  # the output stage of the turn being streamed
    turn_start: int  # where this turn's generated tokens begin in `context`
    session: bool  # a vLLM streaming-input session: its first turn may pause (fixed for its life)
    wire_id: str  # vLLM's request id for this turn: the request id, or for stock policies one per turn
    cache_salt: str | None = None  # its first turn's (SamplingParams.cache_salt), for every request it sends
    cached: int = 0  # this turn's context tokens whose KV was reused
    turn: int = 0
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken | None] | None = None  # the first turn's prompt's, if asked for
    paused: bool = False
    inbox: asyncio.Queue | None = None  # the worker's messages for the turn being streamed
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.context[self.turn_start:]

    @property
    def kept_kv(self) -> int:
        """KV tokens vLLM computed for it: the context but its last token (sampled, never fed back)."""
        return len(self.context) - 1

    def deliver(self, msg: dict) -> None:
        """From the reader thread: hand a worker message to the turn's stream, if one is open."""
        inbox = self.inbox  # read once: the event loop may close this turn meanwhile
        if inbox is not None:
            self.loop.call_soon_threadsafe(inbox.put_nowait, msg)


class VllmBackend(EngineBackend):
    def __init__(self, worker: WorkerProcess, info: EngineInfo, tokenizer, block_size: int,
                 policy: str = "preserve", profile: dict | None = None, host_blocks: int = 0):
        self.worker = worker
        self.info = info
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.policy = policy
        self.sessions = base_policy(policy) in SESSION_POLICIES  # paused turns wait in vLLM as streaming sessions
        self.profile = profile  # measured by the worker on this vLLM (session policies)
        self.host_blocks_total = host_blocks  # the host tier's pool (0: none)
        self._generations: dict[str, _Generation] = {}
        self._wires: dict[str, _Generation] = {}  # vLLM request id -> its generation
        self._lock = threading.Lock()  # _generations, _wires, _kv: the event loop and the reader thread
        # The scheduler's reports (`kv` messages; lag vLLM by a step): paused sessions' KV ([device, host,
        # discarded] tokens by vLLM id; each report names the sessions whose KV changed), the tokens found
        # computed (prefix cache, host) by turns resumed after their KV left the device, counters.
        self._kv_paused: dict[str, list[int]] = {}
        self._resumed_hits: dict[str, int] = {}
        self._counters: dict[str, int] = {}
        # Resumes by where the paused KV was, as the scheduler last reported it (`resume_kv_place`).
        self._resumes_by_kv = dict.fromkeys(RESUME_KV_PLACES, 0)
        self._stats: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._seq = 0
        self._running = False
        self._died = False
        worker.listen(self._on_message, self._on_worker_exit)

    @classmethod
    def create(cls, model: str | None = None, *, python: str | None = None, policy: str = "infercept",
               dtype: str = "auto", max_model_len: int | None = None, kv_cache_gb: float | None = None,
               kv_cache_fraction: float | None = CacheConfig.kv_cache_fraction, host_kv_gb: float = 1.0,
               max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
               enable_prefix_caching: bool = True, seed: int = 0, env: dict[str, str] | None = None,
               engine_args: dict | None = None, tool_parser: str | None = None,
               startup_timeout: float = STARTUP_TIMEOUT_S) -> "VllmBackend":
        """Start vLLM on `model` (None: the embedded default) in `python` (default_vllm_python()).
        Blocks until vLLM is ready. `kv_cache_fraction`: without `kv_cache_gb`, on a CPU, the KV pool's
        share of the memory free now (None: the native engine's default on a CPU, 0.25; on a GPU vLLM's
        gpu_memory_utilization sizes it). `host_kv_gb`: the
        host pool swapped sessions' KV waits in (session policies; 0: none, and `swap` is refused).
        `max_num_seqs`, `max_num_batched_tokens`: None leaves vLLM's own defaults (those `vllm serve`
        takes on the hardware). `env`: extra environment for the
        worker (VLLM_* settings); `engine_args`: more of vLLM's engine arguments (tensor_parallel_size,
        gpu_memory_utilization, kv_cache_dtype, async_scheduling, ...; unset: vLLM's defaults). `tool_parser`:
        the server's `--tool-parser`; one of vLLM's (not ours, or ``vllm:NAME``) is checked against vLLM's
        and the model's tokenizer before the model loads (ValueError: the worker's reason). Every one of
        vLLM's tool parsers serves either way (`EngineInfo.vllm_tool_parsers`)."""
        from transformers import AutoTokenizer

        from ..engine import eos_ids_of

        engine_args = dict(engine_args or {})
        base = base_policy(policy)
        if base not in SESSION_POLICIES and base not in STOCK_POLICIES:
            raise ValueError(f"policy {base!r} is not available on the vLLM backend: choose one of "
                             f"{', '.join((*SESSION_POLICIES, *STOCK_POLICIES))}")
        if base in STOCK_POLICIES and base != policy:
            raise ValueError(f"policy {policy!r}: {base} is stock vLLM on this backend (its own scheduler), which "
                             "runs none of the policy's parts; the native engine (--backend native) runs them")
        running = vllm_policy(policy).label if base in SESSION_POLICIES else policy  # refuses native-only parts
        if base == "swap" and not host_kv_gb > 0:
            raise ValueError("policy 'swap' needs a host pool: --host-kv-gb > 0")
        if int(engine_args.get("data_parallel_size") or 1) > 1:
            # Checked before the worker starts: vLLM would start one engine core per rank.
            raise ValueError(
                f"data_parallel_size={engine_args['data_parallel_size']} is not supported on the vLLM backend: each "
                "data-parallel rank is an engine core of its own, with its own scheduler, while the worker links one "
                "policy channel to one engine core (and reads one KV pool). Run one server per replica behind a "
                "load balancer instead (docs/operators.md, several replicas)")
        if base in SESSION_POLICIES:
            owned = sorted({"scheduler_cls", "kv_transfer_config"} & set(engine_args))
            if owned:
                raise ValueError(f"{', '.join(owned)}: under policy {policy!r} the vLLM backend sets them itself (our "
                                 "scheduler and host tier); --policy prefix-cache runs stock vLLM with your own")
        enable_prefix_caching = STOCK_POLICIES.get(base, enable_prefix_caching)
        python = python or default_vllm_python()
        if not os.path.isfile(python):
            raise FileNotFoundError(f"no python for the vLLM backend at {python!r}: run `make vllm-env`, or pass "
                                    "--vllm-python / set INFERCEPT_VLLM_PYTHON")
        from ..download import resolve_model
        model = resolve_model(model)
        args = {"model": model, "dtype": dtype, "seed": seed, "max_num_seqs": max_num_seqs,
                "enable_prefix_caching": enable_prefix_caching, "max_model_len": max_model_len,
                "max_num_batched_tokens": max_num_batched_tokens,
                # Grammars compiled by llguidance, as ours are (params.py)
                "structured_outputs_config": {"backend": "guidance"},
                # Thinking budgets (`thinking_token_budget`) read the thinking from its markers alone, as
                # the native engine's do (thinking_budget.py), whichever reasoning parser splits the text
                "reasoning_config": {"reasoning_start_str": THINK_START, "reasoning_end_str": THINK_END},
                "kv_cache_memory_bytes": None if kv_cache_gb is None else int(kv_cache_gb * 2**30)}
        if kv_cache_gb is None and not shutil.which("nvidia-smi") and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM on a CPU would size its KV cache to most of the machine's memory, on top of the server,
            # the host tier and the model (the kernel's OOM killer ended it on a 24 GiB machine): the
            # native engine's default instead. On a GPU vLLM's own rule (gpu_memory_utilization) stands.
            share = kv_cache_fraction_or_default(kv_cache_fraction, "cpu")
            args["kv_cache_memory_bytes"] = int(available_host_memory_bytes() * share)
        args = {k: v for k, v in args.items() if v is not None} | engine_args
        if base in SESSION_POLICIES:
            # Our scheduler subclasses vLLM's synchronous one, or vLLM's AsyncScheduler, whichever way vLLM
            # schedules: as engine_args async_scheduling says (--async-scheduling / --no-async-scheduling), else
            # as vLLM decides once its configuration is final (asynchronously on a GPU where it can), which
            # `intercept_scheduler` follows. vLLM imports it from the repository root.
            scheduler_cls = {True: ASYNC_SCHEDULER_CLS, False: SCHEDULER_CLS}.get(
                args.get("async_scheduling"), "engine.vllm_backend.scheduler.intercept_scheduler")
            args |= {"scheduler_cls": scheduler_cls,
                     "additional_config": dict(args.get("additional_config") or {}) | {"infercept": {"policy": policy}}}
            if host_kv_gb > 0:
                args["kv_transfer_config"] = host_tier_config(int(host_kv_gb * 2**30))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, (REPO_ROOT, os.environ.get("PYTHONPATH"))))} | (env or {})
        vllm_tool_parser = vllm_parser_name(tool_parser) or (tool_parser if tool_parser not in PARSERS else None)
        worker = WorkerProcess(python, {"engine": args, "policy_channel": base in SESSION_POLICIES,
                                        "tool_parser": vllm_tool_parser}, env)
        facts = worker.start(startup_timeout)
        tokenizer = AutoTokenizer.from_pretrained(model)
        with open(os.path.join(model, "config.json")) as f:
            model_type = json.load(f)["model_type"]
        info = EngineInfo(model=model, model_type=model_type, max_model_len=facts["max_model_len"],
                          vocab_size=facts["vocab_size"], eos_token_ids=eos_ids_of(model, tokenizer),
                          chat_template=tokenizer.chat_template, dtype=facts["dtype"], device=facts["device"],
                          kv_capacity_tokens=facts["num_blocks"] * facts["block_size"],
                          vllm_tool_parsers=tuple(facts["tool_parsers"]),
                          vllm_forcing_refusals=facts["forcing_refusals"], policy=running,
                          policy_note=summary())
        return cls(worker, info, tokenizer, facts["block_size"], policy, facts.get("profile"), facts["host_blocks"])

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
                if self._wires.get(g.wire_id) is g:
                    del self._wires[g.wire_id]
        for g in chosen:
            g.deliver({"op": "error", "error": error})
            if self.worker.alive:
                self.worker.send({"op": "abort", "id": g.wire_id})

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, prompt, params, request_id, intercept=None):
        self._check_running()
        self._check_tokens(prompt, len(prompt))
        if not prompt:
            raise ValueError("the prompt is empty")
        gen = _Generation(request_id, list(prompt), list(prompt), params, intercept,
                          TurnOutput(self.tokenizer, prompt, params, intercept, self.info.eos_token_ids, True),
                          turn_start=len(prompt),
                          session=self.sessions and may_pause(intercept), wire_id=request_id,
                          cache_salt=params.cache_salt)
        fields = vllm_sampling_fields(params, gen.session, TurnRule.of(params, intercept))
        with self._lock:
            if request_id in self._generations or request_id in self._wires:
                raise ValueError(f"request id {request_id!r} is in use")
            self._generations[request_id] = gen
            self._wires[request_id] = gen
        self._open(gen)
        self.worker.send({"op": "generate", "id": request_id, "prompt": list(prompt), "params": fields,
                          "resumable": gen.session, "calls": _call_rule(gen.stage, intercept),
                          "cache_salt": gen.cache_salt})
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
        params, intercept = params or gen.params, intercept or gen.intercept
        stage = TurnOutput(self.tokenizer, gen.context + list(appended), params, intercept,  # may raise
                           self.info.eos_token_ids, True)
        # A session stays one, whatever the turn's rule; a stock turn is a request of its own. Prompt
        # logprobs are the first turn's prompt's (as our engine reports them).
        fields = vllm_sampling_fields(params, gen.session, TurnRule.of(params, intercept)) | {"prompt_logprobs": None}
        gen.params, gen.intercept, gen.stage = params, intercept, stage
        gen.turn += 1
        self._resumes_by_kv[resume_kv_place(*self._kv_tokens(gen))] += 1
        if gen.session:
            # vLLM dropped the last sampled token, whose KV it never computed: it leads the new chunk.
            # `at`: when the result arrived, for the tool's duration history (the scheduler otherwise sees
            # the resume only at its next step, and every call would look that much longer).
            msg = {"op": "resume", "id": gen.wire_id, "tokens": [gen.context[-1], *appended], "at": time.monotonic()}
            gen.cached = self._device_tokens(gen)  # as the scheduler last reported (a later discard: _advance)
            with self._lock:
                self._resumed_hits.pop(gen.wire_id, None)
        else:
            with self._lock:
                self._wires.pop(gen.wire_id, None)
                gen.wire_id = f"{request_id}#{gen.turn}"
                self._wires[gen.wire_id] = gen
            msg = {"op": "generate", "id": gen.wire_id, "prompt": gen.context + list(appended), "resumable": False,
                   "cache_salt": gen.cache_salt}
            gen.cached = 0  # vLLM reports the prefix-cache hit with the first output
        gen.context += appended
        gen.turn_start = len(gen.context)
        gen.logprobs = []
        gen.paused = False
        self._open(gen)
        self.worker.send(msg | {"params": fields, "calls": _call_rule(stage, intercept)})
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

    @staticmethod
    def _open(gen: _Generation) -> None:
        gen.loop, gen.inbox = asyncio.get_running_loop(), asyncio.Queue()

    # -- a turn's outputs -------------------------------------------------------------------------
    async def _stream(self, gen: _Generation):
        """The turn's outputs until it pauses or finishes; leaving early aborts the request.

        The turn's own inbox, held here: a caller that stops at the turn's last output closes this
        generator whenever it is collected, possibly after the next turn opened its inbox, which must
        then stay open (clearing it dropped that turn's outputs: a resume that never answered)."""
        inbox = gen.inbox
        done = False
        try:
            while not done:
                msg = await inbox.get()
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
            if gen.inbox is inbox:
                gen.inbox = None
            if not done:
                self.abort(gen.request_id)

    def _advance(self, gen: _Generation, msg: dict) -> tuple[RequestOutput, bool]:
        """Take one output message into the turn; returns the caller's output and whether the turn ended.

        A session's turn ends where vLLM ends it (our scheduler ran the turn's rule on every token); a
        turn that is a request of its own ends where the output stage says, and vLLM's request is
        aborted if it is still generating."""
        tokens, ended = msg["tokens"], msg["finish_reason"] is not None
        if "streamed_content" in msg:  # what vLLM's tool parser, reading the turn as it is written, says is content
            gen.stage.add_vllm_content(msg["streamed_content"])
        if "calls" in msg:  # the turn's end, as vLLM's tool parser read it (the worker's)
            gen.stage.take_vllm_calls(msg["calls"], msg["content"])
        verdict, stop_string, taken = None, None, 0
        for i, token in enumerate(tokens):
            gen.context.append(token)
            taken += 1
            stop_string = gen.stage.add(token)
            at_end = ended and i == len(tokens) - 1
            if gen.session and stop_string is not None and not at_end:
                logger.warning("request %s: vLLM did not end the turn at its stop string %r; it is ended here",
                               gen.request_id, stop_string)
            if gen.session and not at_end and stop_string is None:
                continue
            verdict = gen.stage.decide(stopped=at_end or stop_string is not None)
            if verdict.action is not Action.GO_ON:
                break
        ended_here = verdict is not None and verdict.action is not Action.GO_ON
        vllm_ended = ended and taken == len(tokens)  # vLLM's turn ended at the token the stage ended it
        if msg.get("prompt_logprobs") and gen.turn == 0:  # (vLLM sends what it scored since, none after the prompt)
            scored = gen.prompt_logprobs = gen.prompt_logprobs or []
            scored += [None if entries is None else _prompt_scored(token, entries, gen.params.prompt_logprobs)
                       for token, entries in zip(gen.prompt[len(scored):], msg["prompt_logprobs"])]
        if msg["logprobs"] is not None and gen.params.logprobs is not None:
            gen.logprobs += [_sampled(t, lp, entries, gen.params.logprobs)
                             for t, (lp, entries) in zip(tokens[:taken], msg["logprobs"])]
        reason, stop_reason = (msg["finish_reason"], msg["stop_reason"]) if vllm_ended else ("stop", None)
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string  # found here first: vLLM's own stop is moot
        elif reason == "stop" and stop_reason is None and gen.context[-1] in self.info.eos_token_ids:
            stop_reason = gen.context[-1]  # EOS: our engine names the token, vLLM does not
        first_output = gen.turn_start == len(gen.context) - taken
        if first_output and (gen.turn == 0 or not gen.session):
            gen.cached = msg["cached"]  # a new vLLM request's prefix-cache hit, reported with its first output
        elif gen.session:
            with self._lock:
                hit = self._resumed_hits.get(gen.wire_id)
            if hit is not None:  # resumed after our scheduler discarded it: reused what the cache still held
                gen.cached = hit
        if not ended_here:
            return self._output(gen, None, None, None), False
        if verdict.action is Action.PAUSE and (vllm_ended or not gen.session):
            gen.paused = True
            if gen.session:  # the duration estimate's key and the client's hint, for the scheduler
                self.worker.send({"op": "pause", "id": gen.wire_id, "expected_s": gen.intercept.expected_s,
                                  "tool": verdict.calls[0].name if verdict.calls else gen.intercept.kind})
        else:
            if verdict.action is Action.PAUSE:  # a session vLLM did not stop: it cannot wait for a resume
                verdict = replace(verdict, action=Action.FINISH)
            self._forget(gen)
            if gen.session and vllm_ended:
                self.worker.send({"op": "end", "id": gen.wire_id})  # the session's input ends: vLLM frees it
            elif not vllm_ended:
                self.worker.send({"op": "abort", "id": gen.wire_id})  # still generating past the turn's end
        return self._output(gen, verdict, reason, stop_reason), True

    @staticmethod
    def _output(gen: _Generation, verdict: Verdict | None, reason: str | None, stop_reason) -> RequestOutput:
        return gen.stage.output(gen.request_id, gen.prompt, list(gen.output_ids), verdict or GO_ON, reason,
                                stop_reason, list(gen.logprobs), gen.cached, gen.prompt_logprobs)

    def _forget(self, gen: _Generation) -> None:
        with self._lock:
            if self._generations.get(gen.request_id) is gen:
                del self._generations[gen.request_id]
            if self._wires.get(gen.wire_id) is gen:
                del self._wires[gen.wire_id]

    # -- the worker's messages (reader thread) ----------------------------------------------------
    def _on_message(self, msg: dict) -> None:
        if msg["op"] == "stats":
            loop, future = self._stats.pop(msg["seq"])
            loop.call_soon_threadsafe(future.set_result, msg["stats"])
            return
        if msg["op"] == "kv":
            with self._lock:
                for rid, where in msg["paused"].items():  # the sessions whose KV moved, paused, resumed or ended
                    if where is None:
                        self._kv_paused.pop(rid, None)
                    else:
                        self._kv_paused[rid] = where
                self._counters = msg["counters"]
                self._resumed_hits.update(msg["resumed"])
            return
        with self._lock:
            gen = self._wires.get(msg["id"])
            if gen is not None and msg["op"] == "gone":
                del self._wires[msg["id"]]
                if gen.inbox is None and gen.session:
                    self._generations.pop(gen.request_id, None)  # a paused session vLLM ended: nothing to resume
                elif gen.inbox is None:
                    gen = None  # a stock turn's request ended, as it does after every turn
        if gen is not None:
            gen.deliver(msg)

    # -- state ------------------------------------------------------------------------------------
    def _paused(self) -> list[_Generation]:
        with self._lock:
            return [g for g in self._generations.values() if g.paused]

    def _kv_tokens(self, gen: _Generation) -> tuple[int, int]:
        """(device, host) KV tokens vLLM holds for `gen` (paused: as the scheduler last reported)."""
        if not gen.paused:
            return gen.kept_kv, 0
        if not gen.session:
            return 0, 0  # a stock turn's request ended; what the prefix cache still holds is not its own
        with self._lock:
            device, host, _ = self._kv_paused.get(gen.wire_id, [gen.kept_kv, 0, 0])
        return device, host

    def _device_tokens(self, gen: _Generation) -> int:
        return self._kv_tokens(gen)[0]

    async def kv_location(self, request_id: str) -> KVLocation:
        """Generating: the context but its last token, as of the last output vLLM reported. Paused: on
        the device, on the host, or discarded (to be recomputed past whatever the prefix cache still
        holds, which is not known here: `cached` stays 0)."""
        with self._lock:
            gen = self._generations.get(request_id)
        if gen is None:
            raise KeyError(request_id)
        device, host = self._kv_tokens(gen)
        return KVLocation(device=device, host=host, discarded=len(gen.context) - device - host)

    def paused_kv_tokens(self, request_id: str) -> int:
        with self._lock:
            gen = self._generations.get(request_id)
        return self._device_tokens(gen) if gen is not None and gen.paused else 0

    async def snapshot(self) -> EngineSnapshot:
        """vLLM's numbers as of its last step (it reports after each one), the paused requests, and what
        our scheduler did (discarded, swapped and recomputed tokens, as of its last report)."""
        stats = await self._worker_stats()
        paused = self._paused()
        kv = {g.request_id: self._kv_tokens(g) for g in paused}
        with self._lock:
            counters = dict(self._counters)
        states = {"device": 0, "host": 0, "partial": 0, "discarded": 0}
        for device, host in kv.values():
            states["device" if device else "host" if host else "discarded"] += 1
        device_tokens = sum(d for d, _ in kv.values())
        host_tokens = sum(h for _, h in kv.values())
        total = self.info.kv_capacity_tokens // self.block_size
        return EngineSnapshot(
            num_steps=stats["num_steps"], num_preemptions=stats["num_preemptions"],
            num_discarded_tokens=counters.get("discarded_tokens", 0),
            num_recomputed_tokens=counters.get("recomputed_tokens", 0),
            num_swapped_out_blocks=-(-counters.get("swapped_out_tokens", 0) // self.block_size),
            num_swapped_in_blocks=-(-counters.get("swapped_in_tokens", 0) // self.block_size),
            device_blocks_total=total, device_blocks_used=round(stats["kv_cache_usage"] * total),
            host_blocks_total=self.host_blocks_total, host_blocks_used=-(-host_tokens // self.block_size),
            prefix_queried_blocks=stats["prefix_queried_tokens"] // self.block_size,
            prefix_hit_blocks=stats["prefix_hit_tokens"] // self.block_size,
            num_running=stats["num_running"], num_waiting=stats["num_waiting"],  # (paused sessions are in no queue)
            paused_by_state=states, resumes_by_kv=dict(self._resumes_by_kv),
            paused_tokens_by_location={"device": device_tokens, "host": host_tokens,
                                       "discarded": sum(len(g.context) for g in paused) - device_tokens - host_tokens})

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


def _call_rule(stage: TurnOutput, intercept: InterceptParams | None) -> dict | None:
    """The worker's `tool_calls.CallRule` for a turn whose calls vLLM's parser reads (None: not one)."""
    if stage.vllm_parser is None:
        return None
    tools = [dict(t.definition) or {"type": "function", "function": {"name": t.name, "parameters": t.arguments_schema}}
             for t in intercept.tools or ()]
    return {"parser": stage.vllm_parser, "tools": tools, "reasoning": intercept.reasoning_parser,
            "forced": intercept.forced_call, "parallel": intercept.parallel_calls}


def _sampled(token_id: int, logprob: float, entries: list, k: int) -> SampledToken:
    """A token's logprobs as our engine reports them: its own and the top `k` by rank."""
    return SampledToken(token_id, logprob, _top(entries, k))


def _prompt_scored(token_id: int, entries: list, k: int) -> SampledToken:
    """A prompt token's logprob and rank (its own entry) and the top `k` by rank."""
    own = next(e for e in entries if e[0] == token_id)
    return SampledToken(token_id, own[1], _top(entries, k), own[2])


def _top(entries: list, k: int) -> dict[int, float] | None:
    """The top `k` of vLLM's [id, logprob, rank] entries, in rank order (vLLM lists the token's own first)."""
    if not k:
        return None
    return {t: lp for t, lp, rank in sorted(entries, key=lambda e: e[2] or 0) if rank is not None and rank <= k}
