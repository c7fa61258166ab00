"""A LangChain ReAct agent (`create_agent`) on InferCept with two tools, a calculator and a weather lookup.

    make serve   # in another terminal
    python examples/langchain_react_agent.py --question "What is the weather in Paris?"

The LangGraph thread_id is sent to the server as its session id, and between steps the generation
stays paused in the server: each step after the first prints a high share of reused prompt tokens.
"""
from __future__ import annotations

import argparse
import uuid

from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from infercept.integrations.langchain import ChatInferCept
from infercept.integrations.openai import default_base_url, default_model
from infercept.tools.calculator import CalculationError, evaluate, format_number

# The embedded 135M model keeps calling tools unless a result tells it to answer; larger models don't need this.
ANSWER_NOW = "\n\nNow answer the user's question without calling a tool."


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 24 C in {city}." + ANSWER_NOW


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 24*9/5+32."""
    try:
        return format_number(evaluate(expression)) + ANSWER_NOW
    except CalculationError as e:
        return f"Error: {e}"


def main(argv: list[str] | None = None) -> list[AIMessage]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=default_base_url())
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--thread-id", default=f"react-{uuid.uuid4().hex[:12]}")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    model = ChatInferCept(base_url=args.base_url, model=args.model, temperature=0, max_tokens=args.max_tokens)
    agent = create_agent(model, tools=[get_weather, calculator], checkpointer=InMemorySaver())
    result = agent.invoke({"messages": [{"role": "user", "content": args.question}]},
                          {"configurable": {"thread_id": args.thread_id}, "recursion_limit": 12})
    steps = [m for m in result["messages"] if isinstance(m, AIMessage)]
    for i, message in enumerate(steps, 1):
        usage = message.usage_metadata
        reused = usage["input_token_details"].get("cache_read", 0)
        did = ", ".join(f"{c['name']}({c['args']})" for c in message.tool_calls) or "answer"
        print(f"step {i}: {usage['input_tokens']} prompt tokens, {reused} reused "
              f"({reused / usage['input_tokens']:.0%}): {did}")
    print(f"answer: {steps[-1].text}")
    return steps


if __name__ == "__main__":
    main()
