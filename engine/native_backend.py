"""`NativeBackend`: InferCept's own engine (`Engine`) behind the server's `EngineBackend` boundary, on its
engine thread (`AsyncEngine`).

    backend = NativeBackend.create(model=None, policy="infercept")   # the embedded default model
    app = build_app(backend, settings)
"""
from __future__ import annotations

from .backend import EngineBackend, EngineInfo, EngineSnapshot, KVLocation
from .paused_kv import PAUSED_KV_STATES


class NativeBackend(EngineBackend):
    """InferCept's own engine (`Engine`) on its engine thread (`AsyncEngine`)."""

    def __init__(self, async_engine):
        self.async_engine = async_engine
        engine = async_engine.engine
        self.info = EngineInfo(
            model=engine.config.model, model_type=engine.spec.model_type,
            max_model_len=engine.config.scheduler.max_model_len, vocab_size=engine.spec.vocab_size,
            eos_token_ids=frozenset(engine.eos_token_ids), chat_template=engine.tokenizer.chat_template,
            dtype=str(engine.config.dtype).removeprefix("torch."), device=str(engine.config.device),
            kv_capacity_tokens=engine.kv_capacity_tokens(), policy=engine.policy.label)

    @classmethod
    def create(cls, model: str | None = None, **engine_kwargs) -> "NativeBackend":
        """Load `model` (None: the embedded default) with `Engine`'s keyword arguments."""
        from .async_engine import AsyncEngine

        return cls(AsyncEngine.from_args(model, **engine_kwargs))

    @property
    def is_running(self) -> bool:
        return self.async_engine.is_running

    @property
    def failed(self) -> bool:
        return self.async_engine.failed

    def start(self) -> None:
        self.async_engine.start()

    def shutdown(self) -> None:
        self.async_engine.shutdown()

    def generate(self, prompt, params, request_id, intercept=None):
        return self.async_engine.generate(prompt, params, request_id, intercept)

    def resume(self, request_id, appended, params=None, intercept=None):
        return self.async_engine.resume(request_id, appended, params, intercept)

    def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    def cancel_in_flight(self, reason: str) -> None:
        self.async_engine.cancel_in_flight(reason)

    async def kv_location(self, request_id: str) -> KVLocation:
        engine = self.async_engine.engine
        return KVLocation(**await self.async_engine.call(lambda: engine.kv_location(request_id)))

    async def snapshot(self) -> EngineSnapshot:
        engine = self.async_engine.engine
        return await self.async_engine.call(lambda: _snapshot(engine))

    def paused_kv_tokens(self, request_id: str) -> int:
        return self.async_engine.engine.paused_kv_tokens(request_id)


def _snapshot(engine) -> EngineSnapshot:
    """Read the engine's numbers; runs on the engine thread. O(1) in the paused generations: the
    paused-KV index keeps its totals as KV moves."""
    stats, bm, sched = engine.stats, engine.block_manager, engine.scheduler
    paused = sched.paused_kv
    return EngineSnapshot(
        num_steps=stats.num_steps, forward_seconds=stats.forward_seconds,
        num_computed_tokens=stats.num_computed_tokens, num_recomputed_tokens=stats.num_recomputed_tokens,
        num_swapped_out_blocks=stats.num_swapped_out_blocks, num_swapped_in_blocks=stats.num_swapped_in_blocks,
        recompute_seconds=stats.recompute_seconds, num_discarded_tokens=stats.num_discarded_tokens,
        memory_waste_byte_seconds=stats.memory_waste_until(sched.clock()),
        num_preemptions=stats.num_preemptions, num_preemptions_by_swap=stats.num_preemptions_by_swap,
        device_blocks_total=bm.device.num_blocks, device_blocks_used=bm.device.num_blocks - bm.num_free_blocks,
        host_blocks_total=bm.host.num_blocks, host_blocks_used=bm.host.num_blocks - bm.num_free_host_blocks,
        prefix_queried_blocks=bm.device.counters.queried, prefix_hit_blocks=bm.device.counters.hits,
        prefix_evicted_blocks=bm.device.counters.evictions, prefix_cached_blocks=bm.device.num_cached,
        num_running=len(sched.running) + len(sched.swapped), num_waiting=len(sched.waiting),
        num_active_programs=sched.num_active_programs, admission_cap=stats.admission_cap,
        num_held_back=stats.num_held_back, num_thrashed_tokens=stats.num_thrashed_tokens,
        resumes_by_kv=dict(stats.resumes_by_kv),
        paused_by_state={state: paused.count_by_state[state] for state in PAUSED_KV_STATES},
        paused_tokens_by_location={"device": paused.device_tokens, "host": paused.host_tokens,
                                   "discarded": paused.discarded_tokens})
