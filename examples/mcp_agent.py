"""An agent whose tool runs inside the server: the official OpenAI SDK, InferCept's Responses API and an MCP tool.

    infercept serve --mcp-allow-url 'http://127.0.0.1:*/mcp'   # in another terminal
    python examples/mcp_agent.py

The example starts a small MCP server of its own (the official `mcp` SDK's MCPServer over streamable
HTTP, one `multiply` tool) on a free loopback port and names it in each request as
`{"type": "mcp", "server_url": ...}`; the server only reaches URLs `--mcp-allow-url` allows. Within one
`responses.create` the server lists the MCP server's tools, runs the model's call while the generation
waits paused in the engine, and resumes that same generation with the result: no client round trip.
The steps are chained by `previous_response_id`; each prints its output items and how many of its
input tokens the server reused.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import uvicorn
from mcp.server.mcpserver import MCPServer
from openai.types.responses import Response

from infercept.integrations.openai import client, default_base_url, default_model

QUESTIONS = ["What is 6 times 7?", "And 12 times 12?", "And 7 times 123?"]

calc = MCPServer("calc", log_level="WARNING")  # (the SDK sets up logging for the whole process)


@calc.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def serve_mcp() -> tuple[str, uvicorn.Server]:
    """`calc` over streamable HTTP on a free loopback port, in a daemon thread: its URL and the uvicorn
    server (`should_exit = True` stops it)."""
    server = uvicorn.Server(uvicorn.Config(calc.streamable_http_app(), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the MCP server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}/mcp", server


def mcp_tool(url: str) -> dict:
    """OpenAI's remote MCP tool; "never": the server runs each call at once (no approval round trip)."""
    return {"type": "mcp", "server_label": "calc", "server_url": url, "require_approval": "never"}


def tool_choice(name: str) -> dict | str:
    """`multiply`: force the call (the embedded 135M model does not call tools on its own reliably; the
    turns after it are `auto`); `auto` or `required` for a model that can decide."""
    return {"type": "mcp", "server_label": "calc", "name": name} if name == "multiply" else name


def describe(item) -> str:
    if item.type == "mcp_list_tools":
        return f"mcp_list_tools {item.server_label}: {', '.join(t.name for t in item.tools)}"
    if item.type == "mcp_call":
        result = item.output if item.error is None else f"error {item.error}"
        return f"mcp_call {item.server_label}/{item.name}({item.arguments}) -> {result}"
    if item.type == "message":
        return f"message: {json.dumps(item.content[0].text if item.content else '')}"
    return item.type


def main(argv: list[str] | None = None) -> list[Response]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=default_base_url())
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--question", action="append", help=f"one per step (default: {QUESTIONS})")
    parser.add_argument("--tool-choice", default="multiply", choices=("multiply", "auto", "required"))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    openai = client(base_url=args.base_url)
    url, mcp_server = serve_mcp()
    steps: list[Response] = []
    try:
        for i, question in enumerate(args.question or QUESTIONS, 1):
            # max_tool_calls=1: after one call the model answers (its turns are tool_choice "none").
            r = openai.responses.create(model=args.model, input=question, tools=[mcp_tool(url)],
                                        tool_choice=tool_choice(args.tool_choice), max_tool_calls=1,
                                        previous_response_id=steps[-1].id if steps else None,
                                        temperature=0, max_output_tokens=args.max_tokens)
            steps.append(r)
            reused = r.usage.input_tokens_details.cached_tokens
            print(f"step {i}: {question}")
            for item in r.output:
                print(f"  {describe(item)}")
            print(f"  {r.usage.input_tokens} input tokens, {reused} reused ({reused / r.usage.input_tokens:.0%})")
    finally:
        mcp_server.should_exit = True
    return steps


if __name__ == "__main__":
    main()
