"""A LangChain agent (`create_agent`) whose tool the InferCept server runs itself, over MCP.

    infercept serve --mcp-allow-url 'http://127.0.0.1:*/mcp'   # in another terminal
    python examples/langchain_mcp_agent.py

`ChatInferCept` on the Responses API gets OpenAI's remote MCP tool as a provider tool (a dict), so the
agent has no tool of its own to run: the server lists the MCP server's tools, runs the model's call
while the generation waits paused in the engine and resumes it with the result, and the `mcp_call`
comes back in the message's content. The MCP server is examples/mcp_agent.py's (`multiply`, started
on a free loopback port). The LangGraph thread keeps the conversation and each step goes on from the
last response (`use_previous_response_id`); each prints its MCP items and how many input tokens were reused.
"""
from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver

from infercept.integrations.langchain import ChatInferCept
from infercept.integrations.openai import default_base_url, default_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcp_agent import QUESTIONS, mcp_tool, serve_mcp, tool_choice  # noqa: E402  (the MCP server of that example)


def describe(block: dict) -> str:
    if block["type"] == "mcp_list_tools":
        return f"mcp_list_tools {block['server_label']}: {', '.join(t['name'] for t in block['tools'])}"
    result = block.get("output") if block.get("error") is None else f"error {block['error']}"
    return f"mcp_call {block['server_label']}/{block['name']}({block['arguments']}) -> {result}"


def main(argv: list[str] | None = None) -> list[AIMessage]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=default_base_url())
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--question", action="append", help=f"one per step (default: {QUESTIONS})")
    parser.add_argument("--tool-choice", default="multiply", choices=("multiply", "auto", "required"))
    parser.add_argument("--thread-id", default=f"mcp-{uuid.uuid4().hex[:12]}")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    @wrap_model_call
    def one_mcp_call(request, handler):
        """The tool choice (mcp_agent.tool_choice says why `multiply` is forced by default), and at most one
        call per step: after it the model answers."""
        return handler(request.override(tool_choice=tool_choice(args.tool_choice),
                                        model_settings={**request.model_settings, "max_tool_calls": 1}))

    # output_version: the Responses API's own items (mcp_list_tools, mcp_call) as the message's content.
    model = ChatInferCept(base_url=args.base_url, model=args.model, temperature=0, max_tokens=args.max_tokens,
                          use_responses_api=True, use_previous_response_id=True, output_version="responses/v1")
    url, mcp_server = serve_mcp()
    agent = create_agent(model, tools=[mcp_tool(url)], middleware=[one_mcp_call], checkpointer=InMemorySaver())
    steps: list[AIMessage] = []
    try:
        for i, question in enumerate(args.question or QUESTIONS, 1):
            result = agent.invoke({"messages": [{"role": "user", "content": question}]},
                                  {"configurable": {"thread_id": args.thread_id}})
            message = result["messages"][-1]
            steps.append(message)
            usage = message.usage_metadata
            reused = usage["input_token_details"].get("cache_read", 0)
            print(f"step {i}: {question}")
            for block in message.content:
                if isinstance(block, dict) and block.get("type") in ("mcp_list_tools", "mcp_call"):
                    print(f"  {describe(block)}")
            print(f"  answer: {message.text!r}")
            print(f"  {usage['input_tokens']} input tokens, {reused} reused ({reused / usage['input_tokens']:.0%})")
    finally:
        mcp_server.should_exit = True
    return steps


if __name__ == "__main__":
    main()
