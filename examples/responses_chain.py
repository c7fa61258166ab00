"""A Responses-API chain with the official openai SDK: a function tool, `previous_response_id` (or, with
`--conversation`, a conversation the server keeps), and per step how many input tokens the server reused
instead of recomputing.

The first response ends in a `function_call`; its generation stays paused in the server. The next
request sends only the `function_call_output`, after `previous_response_id` or in the same conversation,
and the server resumes the paused generation: almost all of that step's input is reported as cached.

    python examples/responses_chain.py [--base-url http://127.0.0.1:8000] [--conversation]
"""
from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def get_weather(arguments: str) -> str:
    """The tool, run by this client (a real agent would call a weather service here)."""
    try:
        city = json.loads(arguments).get("city", "?")
    except (ValueError, AttributeError):
        return json.dumps({"error": "arguments are not a JSON object"})
    return json.dumps({"city": city, "temperature": 21, "sky": "clear"})


def report(step: int, response) -> None:
    usage = response.usage
    cached = usage.input_tokens_details.cached_tokens
    calls = [f"{item.name}({item.arguments})" for item in response.output if item.type == "function_call"]
    print(f"step {step}: {usage.input_tokens} input tokens, {cached} reused "
          f"({100 * cached / usage.input_tokens:.0f}%), {usage.output_tokens} generated -> "
          + (f"calls {', '.join(calls)}" if calls else repr(response.output_text)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=40)
    parser.add_argument("--conversation", action="store_true",
                        help="keep the steps in a conversation (/v1/conversations) instead of chaining responses")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    settings = dict(model=model, tools=TOOLS, temperature=0, max_output_tokens=args.max_output_tokens)
    conversation = client.conversations.create() if args.conversation else None
    if conversation is not None:
        settings["conversation"] = conversation.id
    response = client.responses.create(input="What is the weather in Paris?", **settings)
    report(1, response)
    for step in range(2, args.max_steps + 1):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": get_weather(c.arguments)}
                   for c in calls]
        chained = {} if conversation is not None else {"previous_response_id": response.id}
        response = client.responses.create(input=outputs, **chained, **settings)
        report(step, response)
    if conversation is not None:
        items = client.conversations.items.list(conversation.id, order="asc", limit=100)
        print(f"conversation {conversation.id}: {', '.join(item.type for item in items)}")


if __name__ == "__main__":
    main()
