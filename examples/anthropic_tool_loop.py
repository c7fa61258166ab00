"""A tool loop with Anthropic's official SDK (the Messages API) against InferCept: `tool_use` blocks,
`tool_result` blocks, and per step how many input tokens the server reused instead of recomputing.

A message that ends in `tool_use` leaves its generation paused in the server. The next request repeats
the conversation with the `tool_result` (as every Messages-API agent loop does) and the server resumes
the paused generation: `usage.cache_read_input_tokens` counts the reused input, `input_tokens` the rest.

    make serve   # in another terminal
    python examples/anthropic_tool_loop.py [--base-url http://127.0.0.1:8000]
"""
from __future__ import annotations

import argparse

import anthropic
import httpx

# The embedded 135M model keeps calling tools unless a result tells it to answer; larger models don't need this.
ANSWER_NOW = "\n\nNow answer the user's question without calling a tool."
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def get_weather(arguments: dict) -> str:
    """The tool, run by this client (a real agent would call a weather service here)."""
    return f"It is sunny and 24 C in {arguments.get('city', '?')}." + ANSWER_NOW


def report(step: int, message) -> None:
    u = message.usage
    total = u.input_tokens + u.cache_read_input_tokens
    calls = [f"{b.name}({b.input})" for b in message.content if b.type == "tool_use"]
    text = "".join(b.text for b in message.content if b.type == "text")
    print(f"step {step}: {total} input tokens, {u.cache_read_input_tokens} reused "
          f"({100 * u.cache_read_input_tokens / total:.0f}%), {u.output_tokens} generated -> "
          + (f"calls {', '.join(calls)}" if calls else repr(text)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    base = args.base_url.rstrip("/")
    model = httpx.get(base + "/v1/models", headers={"x-api-key": args.api_key}).json()["data"][0]["id"]
    client = anthropic.Anthropic(base_url=base, api_key=args.api_key)
    settings = dict(model=model, max_tokens=args.max_tokens, tools=TOOLS, extra_body={"temperature": 0})
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(messages=messages, **settings)
    report(1, message)
    for step in range(2, args.max_steps + 1):
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            break
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": get_weather(b.input)} for b in uses]}]
        message = client.messages.create(messages=messages, **settings)
        report(step, message)


if __name__ == "__main__":
    main()
