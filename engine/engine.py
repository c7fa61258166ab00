"""The synchronous engine: `step()` is schedule -> run -> update, nothing else decides what runs."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time

import torch

from .block_manager import BlockManager
from .config import (CacheConfig, EngineConfig, SchedulerConfig, kv_cache_fraction_or_default, resolve_device,
                     resolve_dtype)
from .env import step_log_path
from .kv_cache import GIB, KVCache, available_memory_bytes, num_blocks_for
from .model_loader import load_model, load_spec
from .model_runner import ModelRunner, PendingSamples
from .output_stage import Action, TurnOutput
from .outputs import RequestOutput, RunnerOutput, SchedulerOutput
from .policy import Profile, make_policy
from .profiler import FULL_SIZES, cached_profile_path, load_or_measure, measure_profile
from .request import InterceptParams, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats
from .step_loop import StepLoop

logger = logging.getLogger("infercept.engine")


def eos_ids_of(model_dir: str, tokenizer) -> frozenset[int]:
    ids = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def default_step_tokens(device: torch.device, profile: Profile, max_num_seqs: int) -> int:
    """The step's token budget when none is given: on a CPU 256 (a few hundred tokens saturate the
    cores); on a GPU the profile's saturation point, where a bigger step stops paying for itself (an
    H100 with the Llama-3-8B shape measured 1,024 tokens), and room for every sequence's decode."""
    if device.type == "cpu":
        return SchedulerConfig.max_num_batched_tokens
    return max(profile.saturation_point, SchedulerConfig.max_num_batched_tokens, max_num_seqs)


class Engine:
    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype = "auto", device: str = "auto",
                 kv_cache_gb: float | None = None, kv_cache_fraction: float | None = CacheConfig.kv_cache_fraction,
                 host_kv_gb: float = CacheConfig.host_kv_gb, block_size: int = CacheConfig.block_size,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs, max_model_len: int | None = None,
                 seed: int = 0, num_threads: int | None = None, policy: str = "infercept",
                 profile: Profile | str | None = None, progress: bool = True, enforce_eager: bool = False,
                 async_output: bool | None = None, async_scheduling: bool | None = None):
        """kv_cache_gb: the device KV pool; None: kv_cache_fraction of the memory free now (None: the
        device's default, 0.25 on a CPU, 0.8 on a GPU: `kv_cache_fraction_or_default`).
        max_num_batched_tokens: the step's token budget; None: `default_step_tokens`.
        enforce_eager: no CUDA graphs (on CUDA, steps otherwise replay captured graphs; `cuda_graphs.py`).
        async_output: a step's output stage runs while the next step's pass computes (`step`); None: on
        CUDA, where the device computes apart from the host, and not on a CPU, where it cannot.
        async_scheduling: each step is planned and launched before the last one's samples reach the host
        (`step`); needs async_output, which it turns on unless that is False. None: as async_output."""
        from transformers import AutoTokenizer

        if async_scheduling and async_output is False:  # refused before anything loads
            raise ValueError("asynchronous scheduling runs each step's output stage during the next step's "
                             "pass: it needs async_output")
        from .download import resolve_model
        model = resolve_model(model, progress)
        if num_threads:
            torch.set_num_threads(num_threads)
        spec = load_spec(model, max_model_len)
        device_ = resolve_device(device)
        dtype_ = resolve_dtype(dtype, spec.torch_dtype)
        if device_.type == "cpu" and dtype_ == torch.float16:
            logger.warning("float16 on CPU is slow; bfloat16 is the better choice here")
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_ids = eos_ids_of(model, self.tokenizer)
        self.model = load_model(model, spec, dtype_, device_)

        block_bytes = KVCache.block_bytes(spec, dtype_, block_size)
        if kv_cache_gb is None:
            share = kv_cache_fraction_or_default(kv_cache_fraction, device_.type)
            kv_cache_gb = available_memory_bytes(device_) * share / GIB
        num_blocks = num_blocks_for(kv_cache_gb, block_bytes)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds no block of {block_bytes} bytes")
        num_host_blocks = num_blocks_for(host_kv_gb, block_bytes)
        # A request may never outgrow the pool, or it would be preempted and recomputed forever.
        max_len = min(spec.max_position_embeddings, num_blocks * block_size)
        self.kv_cache = KVCache(spec, dtype_, device_, block_size, num_blocks, num_host_blocks)
        self.block_manager = BlockManager(num_blocks, num_host_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.kv_cache, device_, self.eos_token_ids, seed, self.tokenizer,
                                  cuda_graphs=device_.type == "cuda" and not enforce_eager,
                                  max_batch=max_num_seqs, max_model_len=max_len,
                                  max_tokens=max_num_batched_tokens or 0)
        if device_.type == "cuda" and not self.runner.graph_sets:
            logger.warning("no Triton here: steps run on the torch path, without CUDA graphs")
        self.policy = make_policy(policy)
        if isinstance(profile, str):
            profile = Profile.load(profile)
        self.profile = profile or load_or_measure(model, self.runner, self.kv_cache,
                                                  spec.kv_bytes_per_token(dtype_), progress=progress)
        self.config = EngineConfig(
            model=model, dtype=dtype_, device=device_,
            cache=CacheConfig(block_size=block_size, kv_cache_gb=kv_cache_gb, host_kv_gb=host_kv_gb,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens or default_step_tokens(device_, self.profile,
                                                                                     max_num_seqs),
                max_num_seqs=max_num_seqs, max_model_len=max_len),
            seed=seed, num_threads=num_threads)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, self.policy, self.profile,
                                   copies_overlap=device_.type == "cuda")
        self.stats = EngineStats(bytes_per_token=self.profile.bytes_per_token)
        self.loop = StepLoop(self.scheduler, self.runner, self.stats)
        log_path = step_log_path()
        self._step_log = open(log_path, "a", buffering=1) if log_path else None
        self.async_output = device_.type == "cuda" or bool(async_scheduling) if async_output is None else async_output
        self.async_scheduling = self.async_output if async_scheduling is None else async_scheduling
        # With async_output: the requests the last step sampled a token for, awaiting their output stage,
        # and the outputs that stage made while this step's pass computed.
        self._unprocessed: list[Request] = []
        self._processed: list[RequestOutput] = []
        # With async_scheduling: the requests of the step in flight that sample a token, and the tokens
        # on their way to the host; and the device time of the pass whose tokens the last step read.
        self._in_flight: tuple[list[Request], PendingSamples] | None = None
        self._resolved_device_seconds = 0.0
        # The last step's host time (the step log's): applying its samples after its pass, and (async_output)
        # the output stage of the step before, while its pass computed.
        self._update_seconds = self._output_stage_seconds = 0.0
        self.turns: dict[str, TurnOutput] = {}  # the output stage of each request's current turn
        self._ids = itertools.count()
        overlap = ("planning, inputs and outputs (async scheduling)" if self.async_scheduling
                   else "outputs (async output)" if self.async_output else "nothing")
        logger.info("engine ready: %s on %s in %s, %d KV blocks of %d tokens (%.2f GiB); kernels %s; the pass "
                    "overlaps the host's %s", model, device_, dtype_, num_blocks, block_size,
                    num_blocks * block_bytes / GIB, self.runner.kernels, overlap)

    # -- requests ---------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    intercept: InterceptParams | None = None) -> str:
        """Queue a request. With `intercept`, it pauses at a tool call or stop instead of finishing."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.tokenize_prompt(prompt)
        self._validate(token_ids)
        turn = TurnOutput(self.tokenizer, token_ids, params, intercept,  # an unknown format fails here
                          self.eos_token_ids)
        request = Request(request_id, token_ids, params, self.eos_token_ids,
                          arrival_time=self.scheduler.clock() if arrival_time is None else arrival_time,
                          intercept=intercept, cache_salt=params.cache_salt)
        self.scheduler.add(request)
        self.turns[request_id] = turn
        return request_id

    def _validate(self, token_ids: list[int]) -> None:
        limit = self.config.scheduler.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= limit:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this model's limit is {limit}")
        if any(not 0 <= t < self.spec.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        if self.block_manager.blocks_for(len(token_ids) + 1) > self.block_manager.device.num_blocks:
            raise ValueError("the prompt does not fit in the KV cache pool; raise --kv-cache-gb")

    def resume(self, request_id: str, appended: str | list[int], params: SamplingParams | None = None,
               intercept: InterceptParams | None = None, result_at: float | None = None) -> dict[str, int]:
        """Continue a paused request: `appended` (the tool result, rendered by the caller exactly as
        a fresh rendering of the conversation would continue the paused tokens) is added to its
        context and it generates on, with `params` and `intercept` for the new turn if given.
        Returns where the paused context's KV was at the moment of resuming (see `kv_location`):
        device + host tokens are reused, the rest is recomputed. `result_at`: when the result arrived
        on the scheduler's clock (default now; see `Scheduler.resume`)."""
        request = self.scheduler.paused.get(request_id)
        if request is None:
            state = self.scheduler.requests.get(request_id)
            raise KeyError(request_id) if state is None else ValueError(
                f"request {request_id!r} is {state.status.value}, not paused")
        token_ids = self.tokenize_prompt(appended) if isinstance(appended, str) else list(appended)
        if not token_ids:
            raise ValueError("nothing to append: a resume needs at least one token")
        if request.num_tokens + len(token_ids) >= self.config.scheduler.max_model_len:
            raise ValueError(f"the context would exceed this model's limit of {self.config.scheduler.max_model_len}")
        if any(not 0 <= t < self.spec.vocab_size for t in token_ids):
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        # The new turn's output stage, built before anything changes (an unknown tool format fails here).
        turn = TurnOutput(self.tokenizer, request.token_ids + token_ids, params or request.sampling_params,
                          intercept or request.intercept, self.eos_token_ids)
        if params is not None:
            request.sampling_params = params
        if intercept is not None:
            request.intercept = intercept
        self.scheduler.decide_fresh_pause(request_id)
        location = self.loop.resume(request_id, token_ids, result_at)
        self.turns[request_id] = turn
        return location

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)
        self.turns.pop(request_id, None)

    def kv_location(self, request_id: str) -> dict[str, int]:
        """Context tokens whose KV is on the device, on the host, or discarded (to recompute; `cached`
        of those are still in the prefix cache and reused unless evicted first)."""
        return self.scheduler.kv_location(request_id)

    def paused_kv_tokens(self, request_id: str) -> int:
        """KV tokens (device + host) a paused request still keeps: what releasing it would make its
        resume recompute. 0 if it is not paused. Safe to call from any thread (may lag a step)."""
        return self.scheduler.paused_kv.kept(request_id)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the device and host pools hold together."""
        bm = self.block_manager
        return (bm.device.num_blocks + bm.host.num_blocks) * bm.block_size

    def has_unfinished_requests(self) -> bool:
        """Requests that still need steps; paused ones wait for `resume` and need none, unless their host
        KV is due back (proactive swap-in). With `async_output`, also samples whose outputs are still to
        come out of the next step, and (`async_scheduling`) samples still on their way."""
        return self.scheduler.has_work() or bool(self._unprocessed) or self._in_flight is not None

    def idle_wake_s(self) -> float | None:
        """With no request needing a step: seconds until a paused request's host KV may be due back
        (`Scheduler.idle_wake_s`), or None."""
        return self.scheduler.idle_wake_s()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the outputs of the requests it sampled a token for. With `async_output`, the outputs of
        those the step before sampled: their output stage (detokenizing, stop strings, tool calls, the
        verdict to go on, pause or finish) runs while this step's pass computes, so the host's time in it
        adds nothing to the step. A turn that stage ends (a stop string, a tool call before the stop
        token) was planned into this step meanwhile: it has computed one more token, which is dropped. A
        turn the scheduler ends (a stop token, the length limit) is not planned on (`Scheduler`).

        With `async_scheduling` a step is also planned and launched before the step before's samples are
        read: its requests hold a placeholder as their newest token (`Scheduler.advance`), which the pass
        reads from the device, and the samples are read while this step's pass computes, before that
        output stage. The host's whole share of a step (planning, staging the inputs, reading the samples,
        the output stage) then overlaps the pass before it. A turn that ends at a stop token has then
        also computed one more token, dropped the same way; one that ends at its length limit is not
        planned on. A request with a grammar or penalties, whose next token depends on its samples on the
        host, is sampled after them in its next step (`ModelRunner.run`): that step's pass computes
        meanwhile."""
        start = time.perf_counter()
        planned_before = self.stats.schedule_host_seconds
        seconds = lambda: time.perf_counter() - start  # noqa: E731
        self._resolved_device_seconds = 0.0
        if self.async_output:
            scheduler_output, outputs = self.loop.step(self._take_samples, seconds, self._output_stage_of_last_step,
                                                       defer_samples=self.async_scheduling)
        else:
            scheduler_output, outputs = self.loop.step(self._update, seconds)
        waited = self.kv_cache.copy_stream.waited_seconds()  # the step's, its sampled ids being on the host
        self.stats.copy_wait_seconds += waited
        device = self.runner.device_seconds() + self._resolved_device_seconds
        self.stats.device_seconds += device
        if self._step_log is not None:
            self._log_step(scheduler_output, start, self.stats.schedule_host_seconds - planned_before, waited,
                           device)
        return outputs

    def _log_step(self, out: SchedulerOutput, start: float, planning: float, copy_wait: float,
                  device: float) -> None:
        """One line of $INFERCEPT_STEP_LOG: the batch's composition and its time, with the host's share
        in planning the step (`schedule_s`), staging its inputs (`inputs_s`), queueing its swap copies
        before its pass (`copies_s`) and applying its samples after it (`update_s`: the scheduler's
        bookkeeping, and the output stage unless `async_output`), and the host's time while the pass ran
        queueing copies (`copies_overlapped_s`) and in the step before's output stage
        (`output_stage_overlapped_s`, with `async_output`). With `async_scheduling`, `device_s` is the pass
        whose samples the step read, the step before's, and `s` less it the host's time that pass did not
        hide."""
        decode = [c for c in out.chunks if len(c.token_ids) == 1 and c.sample]
        self._step_log.write(json.dumps({
            "t": start, "s": time.perf_counter() - start, "seqs": len(out.chunks),
            "decode": len(decode), "prefill_tokens": out.num_batched_tokens - len(decode),
            "context_tokens": sum(c.start_pos + len(c.token_ids) for c in out.chunks),
            "swap_in": len(out.swap_in), "swap_out": len(out.swap_out), "copy_wait_s": copy_wait,
            "device_s": device, "schedule_s": planning, "inputs_s": self.runner.input_host_seconds,
            "copies_s": self.runner.copy_host_seconds, "update_s": self._update_seconds,
            "output_stage_overlapped_s": self._output_stage_seconds,
            "copies_overlapped_s": self.runner.copy_overlapped_host_seconds}) + "\n")

    def _update(self, scheduler_output: SchedulerOutput, runner_output) -> list[RequestOutput]:
        """The step's samples applied and put through the output stage at once."""
        updating = time.perf_counter()
        outputs = self._output_stage(self.scheduler.update(scheduler_output, runner_output))
        self._update_seconds = time.perf_counter() - updating
        return outputs

    def _take_samples(self, scheduler_output: SchedulerOutput,
                      runner_output: RunnerOutput | PendingSamples) -> list[RequestOutput]:
        """`async_output`: the step's samples applied (with `async_scheduling`, placeholders for them while
        they are on their way), their output stage left for the next step's pass; returns the outputs of
        the step before's."""
        updating = time.perf_counter()
        if isinstance(runner_output, PendingSamples):
            sampling = self.scheduler.advance(scheduler_output, placeholders=True,
                                              prompt_logprobs=runner_output.prompt_logprobs)
            self._in_flight = (sampling, runner_output) if sampling else None
        else:
            self._unprocessed += self.scheduler.update(scheduler_output, runner_output)
        outputs, self._processed = self._processed, []
        self._update_seconds = time.perf_counter() - updating
        return outputs

    def _output_stage_of_last_step(self) -> None:
        """`async_output`: the output stage of the requests the step before sampled, while this step's pass
        computes; with `async_scheduling`, once their samples, read here, are applied."""
        if self._in_flight is not None:
            sampling, pending = self._in_flight
            self._in_flight = None
            runner_output = pending.result()  # waits for the step before's pass, not for this one's
            self._resolved_device_seconds = self.runner.device_seconds(pending.device_span)
            self._unprocessed += self.scheduler.apply_samples(sampling, runner_output)
        started = time.perf_counter()
        self._processed += self._output_stage(self._unprocessed)
        self._unprocessed = []
        self._output_stage_seconds = time.perf_counter() - started

    def _output_stage(self, sampled: list[Request]) -> list[RequestOutput]:
        """Each request's newest token through its turn's output stage; the turn goes on, pauses or finishes."""
        outputs = []
        for request in sampled:
            turn = self.turns.get(request.request_id)
            if turn is None:
                continue  # aborted since its token was sampled (async_output)
            stop = turn.add(request.token_ids[-1])
            if stop is not None:
                request.stop_reason = stop
                if request.status is RequestStatus.FINISHED_LENGTH:
                    # The last allowed token completed a stop string: that is a stop, as in OpenAI's API.
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    request.pending_stop = RequestStatus.FINISHED_STOPPED
            verdict = turn.decide(stopped=request.pending_stop is not None or request.status.finished)
            if verdict.action is Action.PAUSE:
                self.scheduler.pause(request, verdict.calls)
            elif verdict.action is Action.FINISH and not request.status.finished:
                self.scheduler.finish(request, request.pending_stop or RequestStatus.FINISHED_STOPPED)
            p = request.sampling_params
            outputs.append(turn.output(
                request.request_id, request.prompt_token_ids, request.output_token_ids, verdict,
                request.finish_reason, request.stop_reason,
                list(request.output_logprobs) if p.logprobs is not None else None, request.num_cached_tokens,
                request.prompt_logprobs or None))
            if verdict.action is not Action.GO_ON:
                del self.turns[request.request_id]
        return outputs


def profile_model(model: str | None, repeats: int, output: str | None = None, **engine_kwargs) -> tuple[Profile, str]:
    """`infercept profile`: measure the full profile of `model` on this machine (an engine of its own,
    `Engine`'s keyword arguments) and save it, by default where the engine loads it at start-up.
    Returns the profile and its path."""
    engine = Engine(model, **{**engine_kwargs, "policy": "preserve"})
    cfg = engine.config
    profile = measure_profile(cfg.model, engine.runner, engine.kv_cache, engine.spec.kv_bytes_per_token(cfg.dtype),
                              sizes=FULL_SIZES, repeats=repeats)
    path = output or cached_profile_path(cfg.model, cfg.device, cfg.dtype, engine.runner.kernels)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    profile.save(path)
    return profile, path
