"""AsyncEngine: streaming, concurrency, abort on early exit, bad input reported to the caller."""
import asyncio

import pytest

from infercept.engine import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def async_engine(default_model_dir):
    engine = AsyncEngine(Engine(default_model_dir, dtype="float32", kv_cache_gb=0.1, host_kv_gb=0.02, max_num_batched_tokens=64))
    engine.start()
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_streams_match_offline_generation(async_engine, llm_fp32):
    prompts = ["The capital of France is", "List three colors:", "1, 2, 3,"]

    async def collect(prompt):
        outs = [o async for o in async_engine.generate(prompt, GREEDY)]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        # Each streamed output extends the previous one.
        for a, b in zip(outs, outs[1:]):
            assert b.token_ids[:len(a.token_ids)] == a.token_ids
        return outs[-1]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    finals = run(main())
    expected = llm_fp32.generate(prompts, GREEDY)
    assert [f.token_ids for f in finals] == [e.token_ids for e in expected]
    assert [f.text for f in finals] == [e.text for e in expected]


def test_leaving_early_aborts_and_frees_blocks(async_engine):
    engine = async_engine.engine
    total = engine.block_manager.device.num_blocks

    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for out in async_engine.generate("Count: 1, 2, 3,", params):
            if len(out.token_ids) >= 3:
                break  # like a client that disconnects mid-stream
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.has_unfinished_requests():
                break

    run(main())
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == total


def test_bad_input_raises_in_caller(async_engine):
    async def main():
        async for _ in async_engine.generate([], GREEDY):
            pass

    with pytest.raises(ValueError, match="empty"):
        run(main())


def test_pause_and_resume_stream(async_engine, llm_fp32):
    from infercept.engine.request import InterceptParams

    async def main():
        first = [o async for o in async_engine.generate(
            "The three primary colors are", GREEDY, request_id="tool-loop",
            intercept=InterceptParams(pause_on_stop=True))]
        assert first[-1].paused and not first[-1].finished
        location = await async_engine.call(lambda: async_engine.engine.kv_location("tool-loop"))
        assert location["device"] + location["host"] > 0  # kept (min-waste may park it on the host)
        context = list(first[-1].prompt_token_ids) + first[-1].token_ids
        appended = async_engine.engine.tokenizer.encode(" Also,")
        second = [o async for o in async_engine.resume("tool-loop", appended, GREEDY)]
        assert second[-1].paused  # still interceptible
        await async_engine.call(lambda: async_engine.engine.abort("tool-loop"))
        return context + appended, second[-1].token_ids

    full_context, resumed = run(main())
    assert resumed == llm_fp32.generate([full_context], GREEDY)[0].token_ids


def test_resume_unknown_request_raises(async_engine):
    async def main():
        async for _ in async_engine.resume("nope", [1, 2], GREEDY):
            pass

    with pytest.raises(KeyError):
        run(main())


class _DyingEngine:
    """An engine whose loop bookkeeping breaks (a bug outside a step) once a request is in flight."""

    def __init__(self):
        self.requests = []

    def add_request(self, prompt, params, request_id, intercept=None):
        self.requests.append(request_id)

    def has_unfinished_requests(self):
        if self.requests:
            raise RuntimeError("a bug outside the step")
        return False

    def idle_wake_s(self):
        return None  # no paused KV to bring back: the thread sleeps until a command

    def abort(self, request_id):
        pass


def test_a_dead_engine_thread_fails_its_requests_and_says_so():
    """Not a hang, not a 503 forever: the in-flight request gets the error, `is_running` turns false and
    `failed` true (the server exits on it), and a new request is refused at once."""
    engine = AsyncEngine(_DyingEngine())
    engine.start()

    async def main():
        with pytest.raises(RuntimeError, match="internal error"):
            async for _ in engine.generate([1, 2, 3], GREEDY, "doomed"):
                pass
        with pytest.raises(RuntimeError, match="not running"):
            async for _ in engine.generate([1, 2, 3], GREEDY, "later"):
                pass

    run(asyncio.wait_for(main(), timeout=10))
    assert engine.failed and not engine.is_running
    engine.shutdown()
