"""The vLLM side of the vLLM backend: vLLM's `AsyncLLM`, driven over one connection by `VllmBackend`.

Run by the vLLM environment's python, never imported by the server's (vLLM pins older transformers and
fastapi than the server, so the two cannot share one environment):

    <vllm python> worker.py FD CONFIG_JSON

FD is this end of a socket pair (a `multiprocessing.connection.Connection`); CONFIG_JSON holds vLLM's
engine arguments (`engine`), whether vLLM runs our scheduler (`policy_channel`) and the one of vLLM's
tool parsers the server serves, if any (`tool_parser`, checked before vLLM starts). Imports only the
standard library, vllm and torch (our scheduler and connector are loaded by vLLM itself, by name), and
tool_calls.py beside it (vLLM's tool parsers: the standard library, vllm and two standard-library modules
of ours). On a CPU, vLLM's worker also loads cpu_sampling.py (its seeded requests). Every message is a dict.

    backend -> worker                                   worker -> backend
    {"op": "generate", "id", "prompt", "params",        {"op": "ready", "info"}            once, at start
     "resumable", "calls", "cache_salt"}                {"op": "refused", "error"}   or this: no start
    {"op": "resume", "id", "tokens", "params", "at",    {"op": "out", "id", "tokens", "logprobs",
     "calls"}                                            "prompt_logprobs", "finish_reason", "stop_reason", "cached"
    {"op": "pause", "id", "tool", "expected_s"}          [, "streamed_content" | "calls", "content"]}
    {"op": "end", "id"}        a paused request ends    {"op": "gone", "id", "error",      vLLM let it go
    {"op": "abort", "id"}                                "bad_input"}
    {"op": "stats", "seq"}                              {"op": "kv", "paused", "resumed", "counters"}
    {"op": "shutdown"}                                  {"op": "stats", "seq", "stats"}

`calls` (a `tool_calls.CallRule` as a dict, or None) names the one of vLLM's tool parsers that reads the
turn: each of its outputs but the last then carries the content that parser streams for it, if any
(`streamed_content`), and its last output the calls the parser found in the whole turn and their content.
A forced turn's rule (`forced`) also gives the turn its grammar: the calls in the model's own format.

A resumable request is one vLLM streaming-input session: each turn stops on EOS, a stop token or
max_tokens and then waits in vLLM (`finish_reason` set, the request not finished) until the next chunk
(`resume`) or the end of its input (`end`). `tokens` are the new tokens of each output (DELTA outputs),
so the backend never slices cumulative lists. Token lists handed to vLLM are always fresh lists: vLLM
0.32 extends a session's first prompt list in place on every resume (benchmarks/vllm_session_probe.py).

With `policy_channel`, vLLM runs `InterceptScheduler` (scheduler.py) in its engine-core process, and a
Unix socket (a `Listener` with a random key; its address goes to the scheduler in vLLM's
`additional_config`) links it to this process: `pause` hints, each `result`'s arrival time and the start-up profile go to it, and its
`kv` state (what the policy did, and where the KV is of each paused session whose KV moved, paused, resumed
or ended since the last: None for one no longer paused) comes back and is passed on. The scheduler
also asks this process (`wake`) to wake vLLM's engine core, idle on its input queue, when a paused
session's host KV may be due back (proactive swap-in); a read-only call wakes it, then and after each
pause hint sent to the scheduler. With a
host tier, vLLM also runs our KV connector (host_tier.py; `kv_transfer_config`, sent as plain data), and
the start-up profile includes the copy bandwidth the connector's copies get (`copy_bandwidth`).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener

CPU_SAMPLING_EXTENSION = "engine.vllm_backend.cpu_sampling.CpuSeededSampling"

from engine.vllm_backend import tool_calls  # (standard library and vllm only; the repository root is on the path)

logger = logging.getLogger("infercept.vllm_worker")


class Stats:
    """The latest scheduler numbers vLLM reported (it reports after each engine step, so they lag)."""

    def __init__(self):
        self.num_steps = 0
        self.num_running = 0
        self.num_waiting = 0  # queued (our scheduler keeps paused sessions in no queue)
        self.kv_cache_usage = 0.0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0

    def logger_factory(self):
        """A `StatLoggerBase` factory for `AsyncLLM(stat_loggers=...)` that records into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    stats.num_steps += 1
                    stats.num_running = scheduler_stats.num_running_reqs
                    stats.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                    stats.prefix_queried_tokens += scheduler_stats.prefix_cache_stats.queries
                    stats.prefix_hit_tokens += scheduler_stats.prefix_cache_stats.hits
                if iteration_stats is not None:
                    stats.num_prompt_tokens += iteration_stats.num_prompt_tokens
                    stats.num_generation_tokens += iteration_stats.num_generation_tokens
                    stats.num_preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self):
                pass

        return Recorder

    def reset(self) -> None:
        """Zero every number (after the start-up profile's requests)."""
        self.__dict__.update(Stats().__dict__)

    def as_dict(self) -> dict:
        return dict(vars(self))


class PolicyChannel:
    """This end of the link to `InterceptScheduler` in vLLM's engine-core process: a Unix socket with a
    random key. Its reader thread passes the scheduler's `state` messages on to the backend as `kv`, and
    its `wake` requests (when to wake vLLM's idle engine core: `Worker.wake_engine_at`) to `wake`."""

    def __init__(self, forward, wake):
        self.forward, self.wake = forward, wake
        self.key = os.urandom(16)
        self.listener = Listener(family="AF_UNIX", authkey=self.key)
        self.conn: Connection | None = None
        self.connected = threading.Event()
        # Set once `ready` went out: the start-up profile's states are not passed on (its requests never
        # pause, so no paused session's report is lost).
        self.serving = threading.Event()
        threading.Thread(target=self.accept, name="infercept-policy-channel", daemon=True).start()

    def scheduler_config(self) -> dict:
        return {"channel": self.listener.address, "authkey": self.key.hex()}

    def accept(self) -> None:
        self.conn = self.listener.accept()  # vLLM builds the scheduler while AsyncLLM starts
        self.connected.set()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg["op"] == "state" and self.serving.is_set():
                self.forward({"op": "kv", "paused": msg["paused"], "resumed": msg["resumed"],
                              "counters": msg["counters"]})
            elif msg["op"] == "wake":
                self.wake(msg["at"])

    def wait_connected(self, timeout: float = 60.0) -> None:
        if not self.connected.wait(timeout):
            raise RuntimeError("vLLM's scheduler never connected to the policy channel: is "
                               "InterceptScheduler the scheduler_cls?")

    def send(self, msg: dict) -> None:
        if self.conn is not None:
            self.conn.send(msg)  # only the event loop thread sends to the scheduler


class Worker:
    def __init__(self, conn: Connection, config: dict):
        self.conn = conn
        self.engine_args = dict(config["engine"])
        self.stats = Stats()
        self.inputs: dict[str, asyncio.Queue] = {}  # resumable request -> its next chunks (None: the end)
        self.tasks: dict[str, asyncio.Task] = {}  # request -> the task streaming its outputs
        self.send_lock = threading.Lock()  # the event loop and the policy channel's reader both send
        self.tool_parser: str | None = config.get("tool_parser")  # vLLM's, as the server serves it
        self.tool_calls = None  # vLLM's tool parsers over the model's tokenizer (tool_calls.py), once vLLM runs
        self.call_rules: dict[str, object] = {}  # request -> the CallRule of its turn, if vLLM parses its calls
        # request -> vLLM's parser reading its turn as it is written (and the turn's tokens so far)
        self.content_streams: dict[str, tool_calls.ContentStream] = {}
        self.policy: PolicyChannel | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake_timer: asyncio.TimerHandle | None = None  # the next wake of vLLM's engine core, if any
        if config.get("policy_channel"):
            self.policy = PolicyChannel(self.send, self.wake_engine_at)
            scheduler = self.engine_args.setdefault("additional_config", {}).setdefault("infercept", {})
            scheduler.update(self.policy.scheduler_config())

    async def serve(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm.config import KVTransferConfig, ReasoningConfig
        from vllm.usage.usage_lib import UsageContext

        if self.tool_parser is not None and self.tool_parser not in tool_calls.registered():
            self.send({"op": "refused", "error": f"unknown tool parser {self.tool_parser!r}; vLLM's are: "
                                                 f"{', '.join(tool_calls.registered())}"})
            return
        args = dict(self.engine_args)
        if "kv_transfer_config" in args:  # our host tier's connector (host_tier.py), as plain data
            args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
        if "reasoning_config" in args:  # the thinking markers (backend.py), as plain data
            args["reasoning_config"] = ReasoningConfig(**args["reasoning_config"])
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and "worker_extension_cls" not in args:
            args["worker_extension_cls"] = CPU_SAMPLING_EXTENSION  # (seeded requests: cpu_sampling.py)
        # vLLM's defaults for what the backend leaves unset (max_num_batched_tokens, max_num_seqs, ...) are
        # those `vllm serve` takes on this hardware.
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), usage_context=UsageContext.OPENAI_API_SERVER,
                                             stat_loggers=[self.stats.logger_factory()])
        config = self.llm.vllm_config.model_config
        self.tool_calls = tool_calls.VllmToolCalls(self.llm.get_tokenizer(), config.model,
                                                   is_harmony=config.hf_config.model_type == "gpt_oss")
        try:
            if self.tool_parser is not None:
                self.tool_calls.check(self.tool_parser)  # the tokenizer has what the parser needs
        except ValueError as e:
            self.send({"op": "refused", "error": str(e)})
            self.llm.shutdown()
            return
        info = self.info()
        if self.policy is not None:
            self.policy.wait_connected()
            info["profile"] = await self.measure_profile(info)
            self.policy.send({"op": "profile", "profile": info["profile"]})
        self.send({"op": "ready", "info": info})
        if self.policy is not None:
            self.policy.serving.set()
        commands: asyncio.Queue = asyncio.Queue()
        loop = self.loop = asyncio.get_running_loop()
        threading.Thread(target=self.read_commands, args=(loop, commands), daemon=True).start()
        try:
            while (msg := await commands.get())["op"] != "shutdown":
                self.handle(msg)
        finally:
            for task in self.tasks.values():
                task.cancel()
            self.llm.shutdown()
            # Collected now, while vllm's modules are alive: AsyncLLM.__del__ shuts down again and fails
            # noisily at interpreter exit.
            del self.llm
            gc.collect()

    def info(self) -> dict:
        import vllm
        from vllm.platforms import current_platform

        config = self.llm.vllm_config
        model, cache = config.model_config, config.cache_config
        bytes_per_token = kv_bytes_per_token(config)
        transfer = config.kv_transfer_config
        host_bytes = (transfer.kv_connector_extra_config or {}).get("host_bytes", 0) if transfer else 0
        return {"max_model_len": model.max_model_len, "vocab_size": model.get_vocab_size(),
                "dtype": str(model.dtype).removeprefix("torch."), "device": current_platform.device_type,
                "block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks or 0,
                "bytes_per_token": bytes_per_token, "host_blocks": host_bytes // (bytes_per_token * cache.block_size),
                "vllm_version": vllm.__version__, "tool_parsers": tool_calls.registered(),
                "forcing_refusals": tool_calls.forcing_refusals()}

    async def measure_profile(self, info: dict) -> dict:
        """The forward-time profile the policy needs, measured on this vLLM instance (`Profile.to_dict`'s
        shape): the time of a prefill of n tokens for a few n up to the step budget, and of one decode
        step. Prompts of distinct tokens, so nothing hits the prefix cache; the cache and the counters
        are reset afterwards. A few seconds on a CPU."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        model, sched = self.llm.model_config, self.llm.vllm_config.scheduler_config
        budget = min(sched.max_num_batched_tokens, model.max_model_len - 16)
        sizes = sorted({n for n in (16, 64, 256, 1024, 2048) if n <= budget} | {budget})
        vocab = model.get_vocab_size()
        seq = [0]

        async def timed(n: int, max_tokens: int) -> float:
            seq[0] += 1
            start = 1000 + seq[0] * 4099
            prompt = TokensPrompt(prompt_token_ids=[(start + i * 31) % vocab for i in range(n)])
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            began = time.perf_counter()
            async for _ in self.llm.generate(prompt, params, request_id=f"infercept-profile-{seq[0]}"):
                pass
            return time.perf_counter() - began

        await timed(16, 1)  # warm-up
        samples = [[n, min([await timed(n, 1) for _ in range(2)])] for n in sizes]
        decode = min([(await timed(16, 9) - await timed(16, 1)) / 8 for _ in range(2)])
        samples = [[1, max(decode, 1e-6)]] + [s for s in samples if s[0] > 1]
        await self.llm.reset_prefix_cache()
        self.stats.reset()
        d2h, h2d = copy_bandwidth(info["device"], info["bytes_per_token"] * info["block_size"])
        return {"format": "infercept-profile/1", "model": model.model, "device": info["device"], "dtype": info["dtype"],
                "bytes_per_token": info["bytes_per_token"], "block_size": info["block_size"],
                "t_fwd_fit": "piecewise-linear", "t_fwd_samples": samples, "saturation_point": None,
                "d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d,
                "notes": f"measured by the vLLM worker at start-up (vLLM {info['vllm_version']})"}

    def wake_engine_at(self, at: float) -> None:
        """Wake vLLM's engine core at `at` (time.monotonic; from the policy channel's thread). An engine
        core with nothing to run sleeps on its input queue until a request or call arrives; the scheduler
        asks to be woken when a paused session's host KV may be due back (proactive swap-in), and a
        read-only call (`is_sleeping`) wakes it: its loop then asks the scheduler whether to step."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._arm_wake, at)

    def _arm_wake(self, at: float) -> None:
        """The scheduler's latest request replaces any earlier one: it reads its earliest host key."""
        if self.wake_timer is not None:
            self.wake_timer.cancel()
        self.wake_timer = self.loop.call_later(max(at - time.monotonic(), 0.0), self._wake_timer_fired)

    def _wake_timer_fired(self) -> None:
        self.wake_timer = None
        self.wake_engine()

    def wake_engine(self) -> None:
        call = asyncio.ensure_future(self.llm.is_sleeping())
        call.add_done_callback(lambda done: done.cancelled() or done.exception())  # (at shutdown: no matter)

    def read_commands(self, loop: asyncio.AbstractEventLoop, commands: asyncio.Queue) -> None:
        """Blocking reads off the event loop; a closed connection (the backend went away) shuts down."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = {"op": "shutdown"}
            loop.call_soon_threadsafe(commands.put_nowait, msg)
            if msg["op"] == "shutdown":
                return

    def send(self, msg: dict) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def handle(self, msg: dict) -> None:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        op, rid = msg["op"], msg.get("id")
        if op in ("generate", "resume"):
            self.follow_calls(rid, msg.get("calls"), msg["prompt"] if op == "generate" else msg["tokens"])
            try:
                params = self.turn_params(rid, msg["params"])
            except ValueError as e:  # a forced turn whose calls no grammar can write: the caller's 400
                self.follow_calls(rid, None, [])
                if rid in self.inputs:
                    self.inputs[rid].put_nowait(None)
                self.send({"op": "gone", "id": rid, "error": str(e), "bad_input": True})
                return
        if op == "generate":
            prompt = TokensPrompt(prompt_token_ids=list(msg["prompt"]))
            if msg.get("cache_salt") is not None:  # the prefix cache's namespace (vLLM's own field)
                prompt["cache_salt"] = msg["cache_salt"]
            if msg["resumable"]:
                self.inputs[rid] = asyncio.Queue()
                self.inputs[rid].put_nowait(StreamingInput(prompt, params))
                prompt = self.chunks(rid)
            self.tasks[rid] = asyncio.create_task(self.stream(rid, prompt, params))
        elif op == "resume":
            if self.policy is not None and "at" in msg:  # ahead of the input, so the scheduler has it first
                self.policy.send({"op": "result", "id": rid, "at": msg["at"]})
            if rid in self.inputs:
                self.inputs[rid].put_nowait(StreamingInput(TokensPrompt(prompt_token_ids=list(msg["tokens"])), params))
        elif op == "pause":
            if self.policy is not None:
                self.policy.send(msg)
                self.wake_engine()  # an idle engine core reads the tool and hint now, keying the session's host KV
        elif op == "end":
            if rid in self.inputs:
                self.inputs[rid].put_nowait(None)
        elif op == "abort":
            task = self.tasks.get(rid)
            if task is not None:
                task.cancel()  # AsyncLLM.generate aborts the request when its consumer is cancelled
        elif op == "stats":
            self.send({"op": "stats", "seq": msg["seq"],
                       "stats": self.stats.as_dict() | {"num_requests": len(self.tasks)}})

    def turn_params(self, rid: str, fields: dict):
        """vLLM's params of a request's next turn. A forced turn whose calls vLLM's parser reads gets its
        grammar here, where vLLM's parsers build it (tool_calls.py); the backend sends it none."""
        rule = self.call_rules.get(rid)
        if rule is not None and rule.forced is not None:
            fields = fields | {"structured_outputs": {"grammar": self.tool_calls.forced_grammar(rule)}}
        return sampling_params(fields)

    async def chunks(self, rid: str):
        """A session's input: its chunks as the backend sends them, until `end`."""
        queue = self.inputs[rid]
        while (chunk := await queue.get()) is not None:
            yield chunk

    async def stream(self, rid: str, prompt, params) -> None:
        from vllm.exceptions import VLLMClientError

        gone = {"op": "gone", "id": rid, "error": None, "bad_input": False}
        try:
            async for out in self.llm.generate(prompt, params, request_id=rid):
                self.send(self.with_calls(rid, self.output(rid, out)))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a request vLLM refused or failed: the backend's caller gets the reason
            gone |= {"error": f"{type(e).__name__}: {e}", "bad_input": isinstance(e, (VLLMClientError, ValueError))}
        finally:
            self.tasks.pop(rid, None)
            self.inputs.pop(rid, None)
            self.follow_calls(rid, None, [])
            self.send(gone)

    def follow_calls(self, rid: str, rule: dict | None, prompt: list[int]) -> None:
        """The rule of a request's next turn (each turn has its own), whose `prompt` is what this vLLM
        request got before it (a session's resume: the resumed chunk): None, or vLLM's parser reads it,
        as it is written and whole."""
        self.call_rules.pop(rid, None)
        self.content_streams.pop(rid, None)
        if rule is not None:
            self.call_rules[rid] = tool_calls.CallRule.from_dict(rule)
            self.content_streams[rid] = self.tool_calls.stream(self.call_rules[rid], prompt)

    def with_calls(self, rid: str, msg: dict) -> dict:
        """An output of a turn whose calls vLLM's parser reads: the content its parser streams for it, or
        for its last, the calls and content of the whole turn."""
        rule = self.call_rules.get(rid)
        if rule is None:
            return msg
        if msg["finish_reason"] is None:
            content = self.content_streams[rid].add(msg["tokens"])
            return msg | {"streamed_content": content} if content else msg
        # (a session's next turn starts with its resume, which sets its rule and stream)
        tokens = self.content_streams.pop(rid).token_ids + msg["tokens"]
        return msg | self.tool_calls.parse(rule, tokens, msg["finish_reason"], msg["stop_reason"])

    @staticmethod
    def output(rid: str, out) -> dict:
        c = out.outputs[0]
        logprobs = None
        if c.logprobs is not None:
            # Per token: the sampled id's logprob and [id, logprob, rank] of every entry vLLM returned
            # (the sampled token and the top `logprobs` ranks).
            logprobs = [[lps[tid].logprob, [[t, lp.logprob, lp.rank] for t, lp in lps.items()]]
                        for tid, lps in zip(c.token_ids, c.logprobs)]
        stop = c.stop_reason
        # With the first output only: per prompt token None or [id, logprob, rank] of every entry, the
        # prompt token's first.
        prompt_logprobs = None if out.prompt_logprobs is None else [
            None if lps is None else [[t, lp.logprob, lp.rank] for t, lp in lps.items()] for lps in out.prompt_logprobs]
        return {"op": "out", "id": rid, "tokens": list(c.token_ids), "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                "finish_reason": c.finish_reason, "stop_reason": stop if isinstance(stop, (int, str)) else None,
                "cached": out.num_cached_tokens or 0}


def kv_bytes_per_token(config) -> int:
    """KV cache bytes one token takes in this rank's attention layers, as vLLM's KV cache spec sizes a
    page (`AttentionSpec.page_size_bytes`, for a block of one token): the KV cache dtype
    (`cache_config.cache_dtype`: `auto` is the model's dtype, `fp8` one byte, ...), K and V for each KV
    head, or MLA's one latent vector per token (no V). Packed quantized formats whose scales the attention
    backend adds to the page (`int8_per_token_head`, ...) are counted by their data alone."""
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    dtype = get_kv_cache_torch_dtype(cache.cache_dtype, model.dtype)
    spec = (MLAAttentionSpec if model.use_mla else FullAttentionSpec)(
        block_size=1, num_kv_heads=model.get_num_kv_heads(parallel), head_size=model.get_head_size(), dtype=dtype)
    return spec.page_size_bytes * model.get_num_layers_by_block_type(parallel, "attention")


COPY_PROBE_BYTES = 64 * 2**20


def copy_bandwidth(device: str, block_bytes: int, budget_bytes: int = COPY_PROBE_BYTES,
                   max_blocks: int = 256) -> tuple[float, float]:
    """Bytes/s of the host tier's copies (device->host, host->device), measured as host_tier.py copies:
    blocks gathered (or scattered) by index on the device, the host side one contiguous run of the
    host pool (pinned on a GPU, copied asynchronously). On a CPU both sides are the same memory.

    Runs after vLLM sized its KV pool to the device's memory, so it allocates at most `budget_bytes`
    (64 MiB) on the device whatever the block size: half for the blocks (up to `max_blocks`, fewer as
    blocks grow; a block larger than that is measured as one block of that size), half for the copy's
    gathered or staged blocks."""
    import torch

    half = max(budget_bytes // 2, 1)
    block_bytes = max(min(block_bytes, half), 1)
    num_blocks = max(min(max_blocks, half // block_bytes), 1)
    on_device = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    host = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, pin_memory=device == "cuda")
    index = torch.randperm(num_blocks).to(device)
    cuda = device == "cuda"

    def d2h() -> None:
        host.copy_(on_device.index_select(0, index), non_blocking=cuda)

    def h2d() -> None:
        staged = torch.empty_like(on_device)
        staged.copy_(host, non_blocking=cuda)
        on_device.index_copy_(0, index, staged)

    def rate(copy) -> float:
        copy()  # warm-up
        best = math.inf
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            copy()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
        return num_blocks * block_bytes / best

    return rate(d2h), rate(h2d)


def sampling_params(fields: dict):
    """vLLM's `SamplingParams` from the backend's fields (params.py), with DELTA outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    grammar = fields.pop("structured_outputs", None)
    return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA,
                          structured_outputs=None if grammar is None else StructuredOutputsParams(**grammar))


def main() -> None:
    fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(Worker(Connection(fd), config).serve())


if __name__ == "__main__":
    main()
