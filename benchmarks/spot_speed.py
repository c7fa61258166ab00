"""Spot check of a running server's generation speed at batch 1 and 8 (any OpenAI-compatible server).

Each request sends a 150-token id prompt and asks for exactly 48 tokens (greedy, `ignore_eos`); a batch is
that many concurrent requests. Tokens/s = generated tokens / wall time, prefill included. Used to compare
InferCept with the vLLM peer's dtypes and to tell a machine's state before and after a sweep:

    python benchmarks/spot_speed.py --base-url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replay import default_model  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 150, 48


async def complete(client: httpx.AsyncClient, model: str, first_id: int, max_tokens: int) -> None:
    r = await client.post("/v1/completions", json={
        "model": model, "prompt": list(range(first_id, first_id + PROMPT_TOKENS)), "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()


async def measure(base_url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await complete(client, model, 1000, 4)  # warm-up
        for batch in (1, 8):
            start = time.monotonic()
            # distinct prompts, so no request reuses another's prefix
            await asyncio.gather(*(complete(client, model, 1000 + 7 * k + batch, NEW_TOKENS) for k in range(batch)))
            seconds = time.monotonic() - start
            print(f"batch {batch}: {batch * NEW_TOKENS / seconds:.1f} tok/s ({seconds:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    args = parser.parse_args()
    asyncio.run(measure(args.base_url, args.model or default_model(args.base_url)))


if __name__ == "__main__":
    main()
