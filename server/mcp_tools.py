"""Tools of the operator's MCP servers (`--mcp-config`), run by the server itself.

Each tool of a configured MCP server is a server tool (the `infercept.tools` interface), so a call of it
runs here while the generation waits paused in the engine, like the calculator's (tool_loop.py).

Names. A request enables `mcp:<server>/<tool>` (one tool) or `mcp:<server>` (every tool of that server)
in `server_tools`. The model sees each tool as a function named `<server>__<tool>` (`function_name`):
function names are `[A-Za-z0-9_.-]{1,64}`, and server names never contain `__` (mcp_config.py), so the
first `__` separates the two and different tools get different names.

Connections. Each server is held by one long-lived task (`McpConnection._hold`): it enters the SDK's
`Client` (a transport and anyio task groups) and leaves it, because an anyio cancel scope must be left
by the task that entered it; requests only send calls through the connected client. Start-up waits for
every server, each at most the timeout; a server that cannot be reached is logged, has no tools (a
request naming them gets 400 unknown server tool) and is tried again every tools TTL, which is also how
often a connected server's tools are listed again; a listing that fails drops the connection, which is
then made again. Nothing an MCP server does can stop the inference server.

Calls. `call_tool` is bounded by the timeout. A timeout, an error result (`isError`), a result with no
text, a lost connection: each raises `McpCallError`, whose message the tool loop (`tool_loop.run_tool`)
gives the model as the call's result, `error: ...`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx2
import mcp_types
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from infercept.tools.base import Tool

from .mcp_config import McpServerConfig, function_name
from .settings import McpSettings

logger = logging.getLogger("infercept.server")

PREFIX = "mcp:"  # how a request names MCP tools in server_tools
_MAX_PAGES = 100  # tools/list pages read per listing: a server whose cursor never ends cannot hang start-up
_STOP_GRACE_S = 10.0  # a stdio server gets 2 s after its stdin closes, then SIGTERM, then SIGKILL (SDK)


class McpCallError(Exception):
    """A call that gave the model no result; the message says why (the model reads it). `code` is the
    JSON-RPC error code (the server's own, or -32001 for a timeout, -32000 for a transport failure);
    `content` the text blocks of a tool that answered with an error result (`isError`), else None."""

    def __init__(self, message: str, code: int = -32000, content: list[dict] | None = None):
        super().__init__(message)
        self.code = code
        self.content = content

    def error_item(self) -> dict:
        """The Responses API's `mcp_call.error`: the tool's own error, or the protocol's."""
        if self.content is not None:
            return {"type": "mcp_tool_execution_error", "content": self.content}
        return {"type": "mcp_protocol_error", "code": self.code, "message": str(self)}


class McpTool(Tool):
    """One tool of an MCP server, as a server tool named for the model (`function_name`)."""

    def __init__(self, connection: McpConnection, listed: mcp_types.Tool):
        self.connection = connection
        self.remote_name = listed.name
        self.name = function_name(connection.name, listed.name)
        self.description = listed.description or f"Tool {listed.name} of the MCP server {connection.name}."
        self.parameters = listed.input_schema
        self.listed = listed  # as the server lists it (the Responses API's mcp_list_tools shows it)

    async def run(self, arguments: dict[str, Any]) -> str:
        return await self.connection.call(self.remote_name, arguments)


class McpConnection:
    """One MCP server: connected, listed and closed by its own task; calls go through its client."""

    def __init__(self, config: McpServerConfig, settings: McpSettings):
        self.config = config
        self.name = config.name
        self.timeout = settings.call_timeout_s
        self.ttl = settings.tools_ttl_s
        self.tools: dict[str, McpTool] = {}  # by the tool's name on the server; replaced whole on each listing
        self.client: Client | None = None  # set while connected
        self.last_error: str | None = None  # why the last attempt to connect or list failed
        self._stop = anyio.Event()
        self._first_attempt = anyio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Connect and list the tools; returns once that worked or failed (at most the timeout)."""
        self._task = asyncio.create_task(self._hold(), name=f"mcp server {self.name}")
        await self._first_attempt.wait()

    async def stop(self) -> None:
        """Close the connection (in its own task); a server that will not close in time is cancelled."""
        if self._task is None:
            return
        self._stop.set()
        done, _ = await asyncio.wait([self._task], timeout=_STOP_GRACE_S)
        if not done:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _hold(self) -> None:
        """Connect, list, serve until stopped, re-listing every TTL; after a failure try again each TTL."""
        reported = False  # a server that stays down is logged once, not every TTL
        while not self._stop.is_set():
            try:
                # The deadline bounds connecting and the first listing; it is lifted once connected. The
                # scope encloses the whole `async with`, so the SDK's task groups nest inside it.
                with anyio.CancelScope(deadline=anyio.current_time() + self.timeout) as connecting:
                    async with AsyncExitStack() as stack:
                        client = await stack.enter_async_context(await self._client(stack))
                        self.tools = await self._list(client)
                        connecting.deadline = math.inf
                        self.client = client
                        logger.info("MCP server %s: connected, tools %s", self.name, ", ".join(self.tools) or "none")
                        reported = False
                        self._first_attempt.set()
                        await self._serve(client)
                if connecting.cancelled_caught:
                    raise TimeoutError(f"no answer within {self.timeout:g} s")
            except Exception as e:  # noqa: BLE001 -- whatever the server or its transport did, we go on
                self.last_error = _reason(e)
                if self.client is not None:
                    logger.warning("MCP server %s: connection lost, connecting again: %s", self.name, _reason(e))
                elif not reported:
                    logger.warning("MCP server %s (%s) is unavailable, its tools are unknown until it answers "
                                   "(tried again every %g s): %s", self.name, self._where(), self.ttl, _reason(e))
                    reported = True
            finally:
                self.client = None
                self.tools = {}
                self._first_attempt.set()
            with anyio.move_on_after(self.ttl):
                await self._stop.wait()

    async def _serve(self, client: Client) -> None:
        """Until stopped: list the tools again every TTL. A listing that fails (the server died, or
        stopped answering) ends the connection, and `_hold` connects again."""
        while True:
            with anyio.move_on_after(self.ttl):
                await self._stop.wait()
                return
            with anyio.fail_after(self.timeout):
                self.tools = await self._list(client)

    async def _client(self, stack: AsyncExitStack) -> Client:
        """The SDK client for this server's transport (its HTTP client, if any, entered on `stack`).
        The SDK's own response cache is off: the tool list is kept here, with the operator's TTL."""
        info = mcp_types.Implementation(name="infercept", version="0.1.0")
        if self.config.transport == "stdio":
            server = StdioServerParameters(command=self.config.command, args=list(self.config.args),
                                           env=dict(self.config.env) or None, cwd=self.config.cwd)
            return Client(server, client_info=info, cache=None)
        # The SDK's default HTTP timeouts (30 s; reads 300 s for long SSE streams), plus the headers.
        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers=dict(self.config.headers), timeout=httpx2.Timeout(30.0, read=300.0)))
        return Client(streamable_http_client(self.config.url, http_client=http), client_info=info, cache=None)

    async def _list(self, client: Client) -> dict[str, McpTool]:
        tools: dict[str, McpTool] = {}
        taken: set[str] = set()
        cursor = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            for listed in page.tools:
                tool = McpTool(self, listed)
                if listed.input_schema.get("type") != "object":
                    logger.warning("MCP server %s: tool %s takes no JSON object, so it is not offered",
                                   self.name, listed.name)
                elif tool.name in taken:
                    logger.warning("MCP server %s: tool %s maps to the function name %s of another tool; "
                                   "it is not offered", self.name, listed.name, tool.name)
                else:
                    tools[listed.name] = tool
                    taken.add(tool.name)
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """The text result of `tool`, or McpCallError saying why there is none."""
        client = self.client
        where = f"MCP tool {self.name}/{tool}"
        if client is None:
            raise McpCallError(f"{where}: the MCP server {self.name} is not connected")
        try:
            with anyio.fail_after(self.timeout):
                result = await client.call_tool(tool, arguments)
        except TimeoutError:
            raise McpCallError(f"{where} gave no result within {self.timeout:g} s", code=-32001) from None
        except MCPError as e:
            raise McpCallError(f"{where}: the MCP server refused the call: {e}", code=e.code) from None
        except Exception as e:  # noqa: BLE001 -- a lost connection, a malformed result: the model is told
            raise McpCallError(f"{where} failed: {_reason(e)}") from None
        return result_text(result, where)

    def _where(self) -> str:
        return " ".join((self.config.command, *self.config.args)) if self.config.transport == "stdio" else self.config.url


def result_text(result: mcp_types.CallToolResult, where: str) -> str:
    """What the model reads of a tool result: its text blocks (and embedded text resources), or its
    structured content as JSON when it has no text. Other blocks (images, audio, links, binary
    resources) cannot be shown to a text model: they are named in a note, and a result of nothing else
    is an error."""
    texts, other = [], []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(block.resource, mcp_types.TextResourceContents):
            texts.append(block.resource.text)
        else:
            other.append(block.type)
    if result.is_error:
        raise McpCallError(f"{where} failed: {' '.join(texts) or 'no message'}",
                           content=[{"type": "text", "text": t} for t in texts])
    if not texts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    if not texts:
        raise McpCallError(f"{where} returned no text" + (f", only {', '.join(other)} content, which this server "
                                                          "cannot pass to the model" if other else ""))
    note = f"\n[{len(other)} non-text block(s) not shown: {', '.join(other)}]" if other else ""
    return "\n".join(texts) + note


def _reason(e: BaseException) -> str:
    """The innermost cause of an error, however many task groups wrapped it."""
    while len(getattr(e, "exceptions", ())) == 1:  # an ExceptionGroup (a backport's on Python 3.10)
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


class McpTools:
    """The operator's MCP servers as server tools, looked up by `mcp:<server>[/<tool>]`."""

    def __init__(self, settings: McpSettings):
        self.connections = {s.name: McpConnection(s, settings) for s in settings.servers}

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.connections.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.connections.values()))

    def lookup(self, name: str) -> McpTool | list[McpTool]:
        """`mcp:<server>/<tool>`: that tool; `mcp:<server>`: all of its tools. KeyError if the server is
        not configured or not connected, or has no such tool."""
        server, _, tool = name.removeprefix(PREFIX).partition("/")
        connection = self.connections.get(server)
        if connection is None or connection.client is None:
            raise KeyError(f"MCP server {server!r} is not configured or not connected")
        tools = connection.tools
        if not tool:
            return list(tools.values())
        if tool not in tools:
            raise KeyError(f"MCP server {server!r} has no tool {tool!r}")
        return tools[tool]

    def before(self, fallback: Callable[[str], Any]) -> Callable[[str], Any]:
        """A server-tool lookup: names starting with `mcp:` here, every other name by `fallback`."""
        return lambda name: self.lookup(name) if name.startswith(PREFIX) else fallback(name)
