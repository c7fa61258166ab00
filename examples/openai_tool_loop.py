"""A tool loop with the official OpenAI SDK against InferCept, through an explicit server session.

    make serve   # in another terminal
    python examples/openai_tool_loop.py --question "What is the weather in Paris?"

Each step prints how many prompt tokens the server reused: after a tool call the generation stayed
paused in the server, so the next step only computes the tool result.
"""
from __future__ import annotations

import argparse

from infercept.integrations.openai import Session, client, default_base_url, default_model
from infercept.tools.calculator import CalculationError, evaluate, format_number

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
# The embedded 135M model keeps calling tools unless a result tells it to answer; larger models don't need this.
ANSWER_NOW = "\n\nNow answer the user's question without calling a tool."


def get_weather(city: str) -> str:
    return f"It is sunny and 24 C in {city}." + ANSWER_NOW


def calculator(expression: str) -> str:
    try:
        return format_number(evaluate(expression)) + ANSWER_NOW
    except CalculationError as e:
        return f"Error: {e}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=default_base_url())
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    session = Session(client(base_url=args.base_url), model=args.model, tools=TOOLS, temperature=0,
                      max_tokens=args.max_tokens)
    answer = session.run(args.question, {"get_weather": get_weather, "calculator": calculator})
    for i, step in enumerate(session.steps, 1):
        print(f"step {i}: {step.prompt_tokens} prompt tokens, {step.cached_tokens} reused "
              f"({step.reused_fraction:.0%}), finish_reason={step.finish_reason}")
    print(f"answer: {answer}")
    return answer


if __name__ == "__main__":
    main()
