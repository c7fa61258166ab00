"""The vLLM backend (`VllmBackend`, policy preserve): time to first token of a resumed turn against a fresh
prefill of the same context, prefix caching off, fp32, greedy; checks that both give the same tokens.

    INFERCEPT_VLLM_PYTHON=/tmp/vllmenv/bin/python VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        python benchmarks/vllm_resume_ttft.py [MODEL_DIR]
"""
import asyncio
import statistics
import sys
import time

from infercept.engine import VllmBackend, ensure_default_model
from infercept.engine.backend import InterceptParams, SamplingParams

CONTEXT, APPENDED, STEPS = 1500, [28, 29, 30, 31] * 10, 5


async def ttft(stream) -> tuple[float, object]:
    start, first = time.perf_counter(), None
    async for out in stream:
        first = first or time.perf_counter() - start
    return first, out


async def measure(backend: VllmBackend) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text = backend.tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 150))[:CONTEXT]
    resumed, fresh = [], []
    for i in range(STEPS):
        _, paused = await ttft(backend.generate(text, params, f"s{i}", InterceptParams(pause_on_stop=True)))
        r, out = await ttft(backend.resume(f"s{i}", APPENDED, params, InterceptParams()))
        f, again = await ttft(backend.generate(text + paused.token_ids + APPENDED, params, f"f{i}"))
        assert again.token_ids == out.token_ids, (out.token_ids, again.token_ids)
        resumed.append(r)
        fresh.append(f)
        print(f"context {CONTEXT + 4}, +{len(APPENDED)}: resumed {r * 1000:.0f} ms ({out.num_cached_tokens} cached), "
              f"fresh {f * 1000:.0f} ms", flush=True)
    r, f = statistics.median(resumed), statistics.median(fresh)
    print(f"median TTFT: resumed {r * 1000:.0f} ms, fresh {f * 1000:.0f} ms ({f / r:.1f}x)")


def main() -> None:
    start = time.perf_counter()
    backend = VllmBackend.create(sys.argv[1] if len(sys.argv) > 1 else ensure_default_model(), dtype="float32",
                                 max_model_len=4096, enable_prefix_caching=False)
    print(f"start-up to ready: {time.perf_counter() - start:.1f} s", flush=True)
    backend.start()
    try:
        asyncio.run(measure(backend))
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
