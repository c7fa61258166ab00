"""Spot check of a running server's generation speed at batch 1 and 8 (any OpenAI-compatible server).

Each request sends a 150-token id prompt no earlier request sent and asks for exactly 48 tokens (greedy,
`ignore_eos`); a batch is that many concurrent requests. Tokens/s = generated tokens / wall time, prefill
included. A request that decodes another number of tokens, or reports cached prompt tokens (vLLM does
with `--enable-prompt-tokens-details`), fails the check. Used to compare InferCept with the vLLM peer's
dtypes and to tell a machine's state before and after a sweep:

    python benchmarks/spot_speed.py --base-url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replay import default_model  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 150, 48
BATCHES = (1, 8)
VOCAB_FLOOR = 32000  # prompt ids stay below every Llama-family vocabulary size


class SpotCheckError(RuntimeError):
    """The server did not do the work the speed is computed from."""


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> None:
    r = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    usage = r.json()["usage"]
    if usage["completion_tokens"] != max_tokens:
        raise SpotCheckError(f"asked for {max_tokens} tokens with ignore_eos, got {usage['completion_tokens']}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if cached:
        raise SpotCheckError(f"{cached} prompt tokens came from the prefix cache: prefill was not measured")


async def tokens_per_second(client: httpx.AsyncClient, model: str, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.monotonic()
    await asyncio.gather(*(complete(client, model, prompt, new_tokens) for prompt in prompts))
    return len(prompts) * new_tokens / (time.monotonic() - start)


def fresh_prompts(rng: random.Random, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` prompts of consecutive token ids, each from its own random first id: no prompt shares a
    first block with another or with an earlier round's or run's (which would skip its prefill:
    40 -> 87 tok/s at batch 8, measured, when a run repeated the last one's prompts)."""
    firsts = rng.sample(range(1000, VOCAB_FLOOR - prompt_tokens), batch)
    return [list(range(first, first + prompt_tokens)) for first in firsts]


async def measure(base_url: str, model: str, batches: tuple[int, ...] = BATCHES, prompt_tokens: int = PROMPT_TOKENS,
                  new_tokens: int = NEW_TOKENS, seed: int | None = None) -> dict[int, float]:
    """Generated tokens/s per batch size, prefill included, after one discarded warm-up round of each."""
    rng = random.Random(seed)
    speeds = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for measured in (False, True):
            for batch in batches:
                speed = await tokens_per_second(client, model, fresh_prompts(rng, batch, prompt_tokens), new_tokens)
                if measured:
                    speeds[batch] = speed
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    args = parser.parse_args()
    speeds = asyncio.run(measure(args.base_url, args.model or default_model(args.base_url)))
    print(" | ".join(f"batch {batch}: {speed:.1f} tok/s" for batch, speed in speeds.items()))


if __name__ == "__main__":
    main()
