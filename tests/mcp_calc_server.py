"""A small MCP server for the tests, built on the official SDK (`mcp.server.mcpserver.MCPServer`).

    python tests/mcp_calc_server.py stdio          # over stdin/stdout
    python tests/mcp_calc_server.py http PORT      # streamable HTTP on http://127.0.0.1:PORT/mcp

Tools: `multiply(a, b)`, `fail()` (raises), `hang(seconds)` (sleeps past a client's timeout), `stall()`
(sleeps an hour, whatever the arguments) and
`picture()` (an image only, no text). With MCP_CALC_PIDFILE set, the server writes its process id there
(so a test can check that the client stopped it).
"""
from __future__ import annotations

import base64
import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.utilities.types import Image

server = MCPServer("calc")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def fail() -> str:
    """Always fails."""
    raise RuntimeError("the calculator is broken")


@server.tool()
async def hang(seconds: float) -> str:
    """Answer after `seconds`."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
async def stall() -> str:
    """Never answers (within an hour): a call of it outlasts any client timeout, whatever the model asks."""
    await anyio.sleep(3600)
    return "done"


@server.tool()
def picture() -> Image:
    """A 1x1 PNG."""
    return Image(data=base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="),
        format="png")


if __name__ == "__main__":
    if os.environ.get("MCP_CALC_PIDFILE"):
        with open(os.environ["MCP_CALC_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    if sys.argv[1] == "stdio":
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
