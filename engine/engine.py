"""The synchronous engine: `step()` is schedule -> run -> update, nothing else decides what runs."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time

import torch

from .block_manager import BlockManager
from .config import CacheConfig, EngineConfig, SchedulerConfig, resolve_device, resolve_dtype
from .detokenizer import IncrementalDetokenizer
from .kv_cache import GIB, KVCache, available_memory_bytes, num_blocks_for
from .model_loader import load_model, load_spec
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler

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


class Engine:
    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype = "auto", device: str = "auto",
                 kv_cache_gb: float | None = None, host_kv_gb: float = CacheConfig.host_kv_gb,
                 block_size: int = CacheConfig.block_size,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs, max_model_len: int | None = None,
                 seed: int = 0, num_threads: int | None = None):
        from transformers import AutoTokenizer

        if model is None:
            from .download import ensure_default_model
            model = ensure_default_model()
        if num_threads:
            torch.set_num_threads(num_threads)
        spec = load_spec(model, max_model_len)
        device_ = resolve_device(device)
        dtype_ = resolve_dtype(dtype, spec.torch_dtype)
        if device_.type == "cpu" and dtype_ == torch.float16:
            logger.warning("float16 on CPU is slow; bfloat16 is the better choice here")
        self.config = EngineConfig(
            model=model, dtype=dtype_, device=device_,
            cache=CacheConfig(block_size=block_size, kv_cache_gb=kv_cache_gb, host_kv_gb=host_kv_gb),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      max_model_len=spec.max_position_embeddings),
            seed=seed, num_threads=num_threads)
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_ids = eos_ids_of(model, self.tokenizer)
        self.model = load_model(model, spec, dtype_, device_)

        block_bytes = KVCache.block_bytes(spec, dtype_, block_size)
        if kv_cache_gb is None:
            kv_cache_gb = available_memory_bytes(device_) * self.config.cache.kv_cache_fraction / GIB
        num_blocks = num_blocks_for(kv_cache_gb, block_bytes)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds no block of {block_bytes} bytes")
        num_host_blocks = num_blocks_for(host_kv_gb, block_bytes)
        self.kv_cache = KVCache(spec, dtype_, device_, block_size, num_blocks, num_host_blocks)
        self.block_manager = BlockManager(num_blocks, num_host_blocks, block_size)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, device_, self.eos_token_ids, seed)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s in %s, %d KV blocks of %d tokens (%.2f GiB)", model, device_,
                    dtype_, num_blocks, block_size, num_blocks * block_bytes / GIB)

    # -- requests ---------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.tokenize_prompt(prompt)
        self._validate(token_ids)
        request = Request(request_id, token_ids, params, self.eos_token_ids,
                          arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.scheduler.add(request)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.skip_special_tokens, params.stop)
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

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.run(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _update(self, scheduler_output, runner_output) -> list[RequestOutput]:
        outputs = []
        for request in self.scheduler.update(scheduler_output, runner_output):
            detok = self.detokenizers[request.request_id]
            stop = detok.add(request.token_ids[-1])
            if stop is not None and not request.status.finished:
                request.stop_reason = stop
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(self._output(request, detok))
            if request.status.finished:
                del self.detokenizers[request.request_id]
        return outputs

    @staticmethod
    def _output(request: Request, detok: IncrementalDetokenizer) -> RequestOutput:
        finished = request.status.finished
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids), text=detok.visible_text(finished), finished=finished,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None)
