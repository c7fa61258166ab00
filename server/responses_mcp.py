"""The Responses API's MCP tools (`tools: [{"type": "mcp", ...}]`): the server lists the MCP server's
tools, the model calls them, and the server runs each call while the generation waits paused in the
engine, then resumes it with the result, all within one `responses.create` (tool_loop.serve_turns).

Servers. `server_label` alone names an operator-configured server (--mcp-config, server/mcp_tools.py).
With `server_url` (+ `headers`, `authorization`) the request brings its own server, which must match a
`--mcp-allow-url` pattern (else 400): the server must not become a way to reach arbitrary hosts. Such
connections are kept per URL and headers (`McpServerPool`), their tool lists re-listed every tools TTL
like the configured servers', and closed once unused for a TTL. A server whose tools cannot be listed
fails the request with 424, as OpenAI's API does ("Error retrieving tool list from MCP server").

Output items. `mcp_list_tools` per server (unless the previous response or the input already has it),
then per server round the turn's text, if any, and an `mcp_call` per call (`output`, or `error`: the
tool's own error result as `mcp_tool_execution_error`, a timeout, lost connection or refused call as
`mcp_protocol_error`; the model reads `error: ...` as the result either way), then the last turn.
`Output` builds them as the turns run, so a stream shows each as it happens (OpenAI's mcp events).

Approvals. A call of a tool that `require_approval` covers (OpenAI's default: every tool) is not run:
the response ends with an `mcp_approval_request` whose id is the call's (`mcpr_<x>` for `call_<x>`),
and the generation stays paused, held by the stored response like any paused Responses turn. The
request that brings the `mcp_approval_response` (after `previous_response_id`, with the mcp tool sent
again) runs the approved call, or gives the model a refusal as the call's result, and its turn resumes
the same paused generation. Calls of tools needing no approval in the same turn run with it.

Tool choice. A forced choice (`required`, a function, `{"type": "mcp", "server_label", "name"}`)
holds for the first turn only: the turns after the server ran its calls are `auto` (as the Agents SDK
resets it), and once `max_tool_calls` calls ran they are `none` (the tools stay in the prompt, so each
turn extends the paused context). `max_output_tokens` bounds each turn.
"""
from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from infercept.engine.backend import ToolSpec

from .chat import Call, Message, validate_tool_flow
from .mcp_config import function_name
from .protocol import APIError, bad_request, new_id, now
from .responses_input import (Continued, ResponseTurn, approval_id, call_id_of, input_messages, mcp_call_id,
                              mcp_item_messages, refusal, request_fields, tool_spec)
from .protocol_responses import (FunctionTool, FunctionToolChoice, McpApprovalRequestItem,
                                 McpApprovalResponseItem, McpCallItem, McpListToolsItem, McpToolChoice, McpToolFilter,
                                 McpToolParam, OutputFunctionCall, OutputMcpApprovalRequest, OutputMcpCall,
                                 OutputMcpListTools, OutputMessage, OutputText, ResponsesRequest)
from .settings import McpSettings
from .tenants import owner_of
from .tool_loop import LoopOutcome, events_then_result, serve_turns, tool_outcome
from .tool_mode import tool_mode
from .turns import Turn, TurnFinished, TurnSpec, TurnUsage

logger = logging.getLogger("infercept.server")

MAX_URL_CONNECTIONS = 32  # per-request MCP servers kept connected at once; the least recently used goes
MCP_ITEMS = (McpApprovalResponseItem, McpApprovalRequestItem, McpCallItem, McpListToolsItem)


def wanted(req: ResponsesRequest) -> bool:
    """Whether the request involves MCP tools (then responses_mcp serves it)."""
    return (any(isinstance(t, McpToolParam) for t in req.tools or ()) or isinstance(req.tool_choice, McpToolChoice)
            or (not isinstance(req.input, str) and any(isinstance(i, MCP_ITEMS) for i in req.input)))


# -- per-request servers ----------------------------------------------------------------------------

class McpUnavailable(Exception):
    """An MCP server whose tools could not be listed; the message says why."""


class McpServerPool:
    """Connections to the MCP servers requests name by `server_url`, by URL and headers."""

    def __init__(self, settings: McpSettings):
        self.settings = settings
        self._held: OrderedDict[tuple, tuple[Any, float]] = OrderedDict()  # key -> (McpConnection, last used)
        self._locks: dict[tuple, asyncio.Lock] = {}

    def check_url(self, url: str, param: str) -> None:
        """400 unless the operator allowed `url` (--mcp-allow-url) and it is a plain http(s) URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
            raise bad_request(f"server_url {url!r} is not an http:// or https:// URL with a host (and no user info)",
                              param=param)
        if not any(fnmatch.fnmatchcase(url, pattern) for pattern in self.settings.allow_urls):
            raise bad_request(f"server_url {url!r} is not allowed on this server: MCP servers are the operator's "
                              "(--mcp-config, named by server_label) or match an --mcp-allow-url pattern",
                              param=param, code="mcp_server_url_not_allowed")

    async def connection(self, url: str, headers: dict[str, str]):
        """A connected McpConnection to `url`, its tools listed (cached); McpUnavailable if it cannot be."""
        from .mcp_config import McpServerConfig
        from .mcp_tools import McpConnection  # the MCP SDK: imported once a request needs it

        key = (url, tuple(sorted(headers.items())))
        async with self._locks.setdefault(key, asyncio.Lock()):
            await self._expire()
            held = self._held.pop(key, (None, 0.0))[0]
            if held is not None and held.client is None:  # lost since: connect again now, not at its next try
                await held.stop()
                held = None
            if held is None:
                name = urlsplit(url).hostname or "url"
                held = McpConnection(McpServerConfig(name, url=url, headers=dict(headers)), self.settings)
                await held.start()
                if held.client is None:
                    await held.stop()  # no retries in the background: the next request tries again
                    raise McpUnavailable(held.last_error or "not connected")
            self._held[key] = (held, time.monotonic())
            while len(self._held) > MAX_URL_CONNECTIONS:
                await self._held.popitem(last=False)[1][0].stop()
            return held

    async def _expire(self) -> None:
        now_ = time.monotonic()
        for key, (conn, used) in list(self._held.items()):
            if now_ - used > self.settings.tools_ttl_s:
                del self._held[key]
                await conn.stop()
        for key, lock in list(self._locks.items()):  # one lock per URL ever named would add up
            if key not in self._held and not lock.locked():
                del self._locks[key]

    async def stop(self) -> None:
        held, self._held = self._held, OrderedDict()
        await asyncio.gather(*(conn.stop() for conn, _ in held.values()))


# -- one request's MCP tools ------------------------------------------------------------------------

@dataclass
class RequestTool:
    """One MCP tool as a server tool of this request (the `infercept.tools` interface)."""

    name: str  # the function the model calls: <server_label>__<tool>
    description: str
    parameters: dict
    label: str
    remote_name: str
    needs_approval: bool
    connection: Any  # McpConnection

    async def run(self, arguments: dict) -> str:
        return await self.connection.call(self.remote_name, arguments)

    def spec(self) -> ToolSpec:
        definition = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return ToolSpec(self.name, self.parameters, {"type": "function", "function": definition})


def _matches(f: McpToolFilter | None, remote_name: str, listed) -> bool:
    if f is None or (f.tool_names is None and f.read_only is None):
        return False
    read_only = bool(getattr(listed.annotations, "read_only_hint", None)) if listed.annotations else False
    return ((f.tool_names is None or remote_name in f.tool_names)
            and (f.read_only is None or f.read_only == read_only))


def _allowed(param: McpToolParam, remote_name: str, listed) -> bool:
    allowed = param.allowed_tools
    if allowed is None:
        return True
    if isinstance(allowed, list):
        return remote_name in allowed
    return _matches(allowed, remote_name, listed)


def _needs_approval(param: McpToolParam, remote_name: str, listed) -> bool:
    """OpenAI's rule: "never" / "always"; a filter: `never` matches run freely, everything else asks
    (unset is "always": approval is asked before data goes to an MCP server unless the request says not)."""
    policy = param.require_approval
    if policy in (None, "always"):
        return True
    if policy == "never":
        return False
    return not _matches(policy.never, remote_name, listed)


@dataclass
class RequestServers:
    """The request's MCP servers: their tools by function name, and the mcp_list_tools items."""

    tools: dict[str, RequestTool] = field(default_factory=dict)
    listings: list[OutputMcpListTools] = field(default_factory=list)

    def by_label(self, label: str) -> list[RequestTool]:
        return [t for t in self.tools.values() if t.label == label]


class ResponsesMcp:
    """Serves the Responses requests that involve MCP tools (`wanted`), for `ResponsesServing`."""

    def __init__(self, settings: McpSettings, configured=None):
        self.settings = settings
        self.configured = configured  # McpTools of --mcp-config, or None
        self.pool = McpServerPool(settings)

    async def stop(self) -> None:
        await self.pool.stop()

    # -- servers and their tools -------------------------------------------------------------------
    async def resolve(self, req: ResponsesRequest, taken: set[str], listed_before: set[str]) -> RequestServers:
        servers = RequestServers()
        labels: set[str] = set()
        for i, param in enumerate(req.tools or ()):
            if not isinstance(param, McpToolParam):
                continue
            where = f"tools[{i}]"
            label = param.server_label
            if label in labels:
                raise bad_request(f"two mcp tools have the server_label {label!r}", param=f"{where}.server_label")
            labels.add(label)
            if param.connector_id is not None or param.tunnel_id is not None:
                raise bad_request("connector_id and tunnel_id are OpenAI's hosted connectors; this server reaches "
                                  "MCP servers by server_label (--mcp-config) or server_url", param=where)
            connection = await self._connection(param, where)
            remote = list(connection.tools.values())
            listing = []
            for tool in remote:
                if not _allowed(param, tool.remote_name, tool.listed):
                    continue
                name = function_name(label, tool.remote_name)
                if name in taken:
                    raise bad_request(f"the MCP tool {label}/{tool.remote_name} is named {name!r} for the model, "
                                      "like another tool of the request", param=where)
                taken.add(name)
                description = tool.description + (f" ({param.server_description})" if param.server_description else "")
                servers.tools[name] = RequestTool(name, description, tool.parameters, label, tool.remote_name,
                                                  _needs_approval(param, tool.remote_name, tool.listed), connection)
                annotations = tool.listed.annotations
                listing.append({"name": tool.remote_name, "input_schema": tool.parameters,
                                "description": tool.listed.description,
                                "annotations": annotations.model_dump(mode="json", exclude_none=True)
                                if annotations is not None else None})
            if label not in listed_before:
                servers.listings.append(OutputMcpListTools(id=new_id("mcpl_"), server_label=label, tools=listing))
        return servers

    async def _connection(self, param: McpToolParam, where: str):
        label = param.server_label
        if param.server_url is None:
            if param.headers or param.authorization:
                raise bad_request(f"headers and authorization go with a server_url; {label!r} names a configured "
                                  "server, which has its own", param=where)
            connection = self.configured.connections.get(label) if self.configured is not None else None
            if connection is None:
                raise bad_request(f"server_label {label!r} is not an MCP server of this server (--mcp-config) and "
                                  "the tool has no server_url", param=f"{where}.server_label")
            if connection.client is None:
                raise _unavailable(label, connection.last_error or "not connected")
            return connection
        self.pool.check_url(param.server_url, f"{where}.server_url")
        headers = dict(param.headers or {})
        if param.authorization:
            headers["Authorization"] = f"Bearer {param.authorization}"
        try:
            return await self.pool.connection(param.server_url, headers)
        except McpUnavailable as e:
            raise _unavailable(label, str(e)) from None

    # -- serving -----------------------------------------------------------------------------------
    async def create(self, serving, continued: Continued, raw):
        """The request `continued` holds (its input dereferenced), with its MCP tools run here."""
        req, owner = continued.request, owner_of(raw)
        history, previous, record = continued.history, continued.previous, continued.in_conversation
        model = req.model or serving.model_name
        serving.check_model(model)
        functions = [t for t in req.tools or () if isinstance(t, FunctionTool)]
        items = [] if isinstance(req.input, str) else list(req.input)
        listed_before = _listed_in_chain(serving.conversations, previous, owner) | {  # (in the context already)
            i.server_label for i in items if isinstance(i, McpListToolsItem)} | {
            i["server_label"] for i in continued.input_items if i["type"] == "mcp_list_tools"}
        servers = await self.resolve(req, {t.name for t in functions}, listed_before)

        # Approvals: each answers a call waiting for one (of the previous response or of the input).
        pending = _pending_calls(history, items)
        approvals: dict[str, tuple[McpApprovalResponseItem, Call, RequestTool]] = {}
        for item in items:
            if not isinstance(item, McpApprovalResponseItem):
                continue
            call = pending.get(call_id_of(item.approval_request_id, "mcpr_"))
            if call is None or item.approval_request_id in approvals:
                raise bad_request(f"approval_request_id {item.approval_request_id!r} is not an mcp_approval_request "
                                  "waiting for an answer (of the previous response or of the input)", param="input")
            tool = servers.tools.get(call.name)
            if tool is None:
                raise bad_request(f"the approval answers a call of {call.name!r}, which is not a tool of this "
                                  "request's mcp tools: send the mcp tool again with the approval", param="tools")
            approvals[item.approval_request_id] = (item, call, tool)

        def other(item, messages: list[Message]) -> None:
            if isinstance(item, McpApprovalResponseItem):  # (each answers a waiting call: its result, as it ran)
                messages.append(answers[item.approval_request_id])
            else:
                mcp_item_messages(item, messages)

        system = (Message("system", req.instructions),) if req.instructions else ()
        answers = {key: Message("tool", "", tool_call_id=call.id) for key, (_, call, _) in approvals.items()}
        if not history + tuple(input_messages(req.input, other)):
            raise bad_request("input must not be empty", param="input")
        validate_tool_flow(system + history + tuple(input_messages(req.input, other)))  # before a call runs
        # The approved calls run now, while the generation waits paused; a refusal is the call's result.
        output: list = list(servers.listings)
        for key, (item, call, tool) in approvals.items():
            if item.approve:
                content, error = await tool_outcome(tool, call)
                output.append(_call_item(tool, call, content, error, key))
            else:
                content = refusal(item.reason)
            answers[key] = Message("tool", content, tool_call_id=call.id)
        conversation = history + tuple(input_messages(req.input, other))
        specs = [tool_spec(t) for t in functions] + [t.spec() for t in servers.tools.values()]
        choice = self._choice(req, servers)
        if approvals and choice not in (None, "none"):
            # The answered calls are those a forced tool_choice made (clients send the same settings with
            # the approval): the first turn is one after calls, as the turns after calls the server ran are.
            choice = "auto"
        num_approved = sum(isinstance(o, OutputMcpCall) for o in output)  # calls run already count
        if req.max_tool_calls is not None and num_approved >= req.max_tool_calls:
            if choice not in (None, "auto", "none"):
                raise bad_request("tool_choice forces a call, but max_tool_calls allows no more", param="tool_choice")
            choice = "none"
        parallel = req.parallel_tool_calls is not False
        mode = tool_mode(specs or None, choice, parallel, servers.tools)
        spec = TurnSpec("chat", messages=system + conversation, mode=mode, id_prefix="resp_", param="input",
                        owner=owner, holder=record, **request_fields(req, mode))
        turn = await serving.open(spec)  # (its conversation generating until the last turn closes)
        rt = ResponseTurn(req, model, new_id("msg_"), now(), conversation, turn, in_conversation=record,
                          kept_items=continued.kept_items, input_items=continued.input_items)
        current = turn

        def on_turn(opened: Turn) -> None:
            nonlocal current
            current = opened

        def respec(spec: TurnSpec, messages: list[Message], num_calls: int) -> TurnSpec:
            done = req.max_tool_calls is not None and num_approved + num_calls >= req.max_tool_calls
            later = "none" if done else "auto" if choice not in (None, "none") else choice
            return replace(spec, messages=tuple(messages),
                           mode=tool_mode(specs or None, later, parallel, servers.tools))

        runnable = {name: t for name, t in servers.tools.items() if not t.needs_approval}
        out = Output(rt, servers, output, serving.token_logprobs)
        queue: asyncio.Queue = asyncio.Queue()
        streamed = req.stream or req.background  # (a background response's events are kept for its streams)
        emit = (lambda kind, data: queue.put_nowait(("event", data))) if streamed else (lambda *_: None)
        out.emit = emit

        async def work() -> dict:
            outcome = await serve_turns(serving.turns, turn, runnable, out.on_loop_event, on_turn, respec,
                                        out.on_result)
            return await out.finish(serving, current, outcome, len(system))

        async def cleanup() -> None:
            await current.close()
            await serving.close(turn)

        async def events():
            snapshot = serving._response(rt, "in_progress").model_dump(mode="json")
            _redact(snapshot)
            yield rt.event("response.created", response=snapshot)
            yield rt.event("response.in_progress", response=snapshot)
            for index, item in enumerate(output):  # listed and approved before the first turn
                for event in out.done_item_events(index, item):
                    yield event
            async for kind, data in events_then_result(work(), queue):
                if kind == "event":
                    yield data
                else:
                    yield rt.event("response.completed" if data["status"] == "completed" else "response.incomplete",
                                   response=data)

        return await serving.answer(raw, rt, events, work, cleanup)

    @staticmethod
    def _choice(req: ResponsesRequest, servers: RequestServers) -> str | None:
        choice = req.tool_choice
        if isinstance(choice, McpToolChoice):
            tools = servers.by_label(choice.server_label)
            if choice.name is not None:
                tools = [t for t in tools if t.remote_name == choice.name]
            if not tools:
                raise bad_request(f"tool_choice names the MCP tool {choice.server_label}/{choice.name or '*'}, which "
                                  "is not among the request's mcp tools", param="tool_choice")
            return tools[0].name if len(tools) == 1 else "required"
        if isinstance(choice, FunctionToolChoice):
            return choice.name
        return choice


class Output:
    """A response's output items, built as its turns run (the same for a stream and for JSON), and the
    stream events that show them: text as it is generated, each mcp_call as it runs."""

    def __init__(self, rt, servers: RequestServers, output: list, token_logprobs: Callable):
        self.rt = rt
        self.servers = servers
        self.output = output  # the items so far
        # Frontend.token_logprobs, for the text's tokens where the request includes their logprobs
        self.token_logprobs = token_logprobs
        self.emit: Callable[[str, dict], None] = lambda *_: None  # ("event", event): a stream's
        self.text: OutputMessage | None = None  # the turn's message while its text streams
        self.calls: dict[str, int] = {}  # call id -> index of its mcp_call item

    def _event(self, kind: str, **fields) -> None:
        self.emit("event", self.rt.event(kind, **fields))

    # -- what the loop reports -----------------------------------------------------------------------
    def on_loop_event(self, kind: str, data: dict) -> None:
        if kind == "delta":
            top = self.rt.request.logprobs()
            self._text_delta(data["content"], [] if top is None else self.token_logprobs(*data["tokens"], top))
        elif kind == "tool_call":
            self._close_text("completed")
            if data["server"]:  # run now by the loop: its item opens, its result closes it
                tool = self.servers.tools[data["name"]]
                item = OutputMcpCall(id=mcp_call_id(data["id"]), server_label=tool.label, name=tool.remote_name,
                                     arguments=data["arguments"])
                index = self.calls[data["id"]] = self._add(item.model_copy(update={"status": "in_progress"}))
                fields = {"item_id": item.id, "output_index": index}
                self._event("response.mcp_call_arguments.delta", **fields, delta=item.arguments)
                self._event("response.mcp_call_arguments.done", **fields, arguments=item.arguments)
                self._event("response.mcp_call.in_progress", **fields)

    def on_result(self, call: Call, content: str, error: Exception | None) -> None:
        index = self.calls[call.id]
        item = _call_item(self.servers.tools[call.name], call, content, error)
        self.output[index] = item
        self._event("response.mcp_call.failed" if error else "response.mcp_call.completed", item_id=item.id,
                    output_index=index)
        self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))

    def _add(self, item) -> int:
        self.output.append(item)
        self._event("response.output_item.added", output_index=len(self.output) - 1, item=item.model_dump(mode="json"))
        return len(self.output) - 1

    def _text_delta(self, text: str, logprobs: list) -> None:
        """A turn's text as it is generated, with its tokens' logprobs (a message's text is one turn's)."""
        if self.text is None:
            self.text = OutputMessage(id=new_id("msg_"), status="in_progress", content=[])
            index = self._add(self.text)
            self._event("response.content_part.added", item_id=self.text.id, output_index=index, content_index=0,
                        part=OutputText(text="").model_dump())
            self.text.content.append(OutputText(text=""))
        part = self.text.content[0]
        part.text += text
        part.logprobs += logprobs
        self._event("response.output_text.delta", item_id=self.text.id, output_index=len(self.output) - 1,
                    content_index=0, delta=text, logprobs=[lp.model_dump() for lp in logprobs])

    def _close_text(self, status: str) -> None:
        if self.text is None:
            return
        item, self.text = self.text, None
        item.status = status
        index = self.output.index(item)
        fields = {"item_id": item.id, "output_index": index, "content_index": 0}
        self._event("response.output_text.done", **fields, text=item.content[0].text,
                    logprobs=[lp.model_dump() for lp in item.content[0].logprobs])
        self._event("response.content_part.done", **fields, part=item.content[0].model_dump())
        self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))

    def done_item_events(self, index: int, item) -> list[dict]:
        """The events of an item that is complete when shown (listings, approved calls, approval requests,
        function calls)."""
        rt, dump = self.rt, item.model_dump(mode="json")
        events = []
        if isinstance(item, OutputMcpListTools):
            events.append(rt.event("response.output_item.added", output_index=index, item={**dump, "tools": []}))
            events.append(rt.event("response.mcp_list_tools.in_progress", item_id=item.id, output_index=index))
            events.append(rt.event("response.mcp_list_tools.completed", item_id=item.id, output_index=index))
        elif isinstance(item, OutputMcpCall):
            events.append(rt.event("response.output_item.added", output_index=index,
                                   item={**dump, "output": None, "error": None, "status": "in_progress"}))
            events.append(rt.event("response.mcp_call_arguments.done", item_id=item.id, output_index=index,
                                   arguments=item.arguments))
            events.append(rt.event("response.mcp_call.failed" if item.error else "response.mcp_call.completed",
                                   item_id=item.id, output_index=index))
        elif isinstance(item, OutputFunctionCall):
            events.append(rt.event("response.output_item.added", output_index=index,
                                   item={**dump, "arguments": "", "status": "in_progress"}))
            events.append(rt.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                   delta=item.arguments))
            events.append(rt.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                   name=item.name, arguments=item.arguments))
        else:
            events.append(rt.event("response.output_item.added", output_index=index, item=dump))
        events.append(rt.event("response.output_item.done", output_index=index, item=dump))
        return events

    # -- the end -------------------------------------------------------------------------------------
    async def finish(self, serving, last_turn: Turn, outcome: LoopOutcome, num_system: int) -> dict:
        """The last turn's items (its text, function calls, approval requests; calls of tools needing no
        approval that came with those run now), the response stored."""
        rt, result = self.rt, outcome.result
        self._close_text("incomplete" if result.finish_reason == "length" else "completed")
        messages = list(outcome.messages)
        calls = result.calls
        functions = [c for c in calls if c.name not in self.servers.tools]
        last = serving._output_items(rt, replace(result, content=None, calls=functions), text_announced=False)
        for call in calls:
            tool = self.servers.tools.get(call.name)
            if tool is None:
                continue
            if tool.needs_approval:
                last.append(OutputMcpApprovalRequest(id=approval_id(call.id), server_label=tool.label,
                                                     name=tool.remote_name, arguments=call.arguments))
            else:  # it came with a call the client answers: it runs now, the generation waits on
                content, error = await tool_outcome(tool, call)
                last.append(_call_item(tool, call, content, error))
                messages.append(Message("tool", content, tool_call_id=call.id))
        for item in last:
            self.output.append(item)
            for event in self.done_item_events(len(self.output) - 1, item):
                self.emit("event", event)
        u = outcome.usage()
        usage = TurnUsage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
        end = TurnFinished(result, outcome.last, usage)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        body = serving._response(rt, status, self.output, end).model_dump(mode="json")
        _redact(body)
        serving.keep_in_conversation(rt, body["output"])
        if rt.request.store is not False:
            serving.conversations.store_response(rt.id, body, tuple(messages[num_system:]),
                                                 last_turn.engine.request_id, last_turn.spec.owner, rt.input_items)
        return body


def _redact(body: dict) -> None:
    for tool in body["tools"]:  # credentials are not echoed
        tool.pop("headers", None), tool.pop("authorization", None)


def _pending_calls(history: Sequence[Message], items: list) -> dict[str, Call]:
    """Calls that wait for results: those of the history's last assistant turn without a tool message,
    and those of approval requests sent back in the input."""
    pending: dict[str, Call] = {}
    for m in history:
        if m.role == "assistant":
            pending = {c.id: c for c in m.tool_calls}
        elif m.role == "tool":
            pending.pop(m.tool_call_id, None)
        else:
            pending = {}
    for item in items:
        if isinstance(item, McpApprovalRequestItem):
            call = Call.make(call_id_of(item.id, "mcpr_"), function_name(item.server_label, item.name), item.arguments)
            pending[call.id] = call
    return pending


def _unavailable(label: str, reason: str) -> APIError:
    return APIError(424, f"Error retrieving tool list from MCP server: '{label}': {reason}", param="tools",
                    code="mcp_server_unavailable", type="external_connector_error")


def _call_item(tool: RequestTool, call: Call, content: str, error: Exception | None,
               approval: str | None = None) -> OutputMcpCall:
    item = OutputMcpCall(id=mcp_call_id(call.id), server_label=tool.label, name=tool.remote_name,
                         arguments=call.arguments, approval_request_id=approval)
    if error is None:
        return item.model_copy(update={"output": content})
    error_item = error.error_item() if hasattr(error, "error_item") else {
        "type": "mcp_protocol_error", "code": -32602, "message": str(error)}  # arguments that are no JSON object
    return item.model_copy(update={"error": error_item, "status": "failed"})


# A chain of responses longer than this is not searched further back for tool listings (the server lists
# the tools again then; it never lists too few).
MAX_CHAIN_SEARCH = 256


def _listed_in_chain(conversations, previous, owner: str | None) -> set[str]:
    """Server labels whose tools a response of the chain ending at `previous` listed (`mcp_list_tools`):
    they are in the context, so they are not listed again (as OpenAI does)."""
    labels: set[str] = set()
    record, seen = previous, 0
    while record is not None and seen < MAX_CHAIN_SEARCH:
        body = record.body or {}
        labels |= {o.get("server_label") for o in body.get("output", []) if o.get("type") == "mcp_list_tools"}
        parent = body.get("previous_response_id")
        record = conversations.response(parent, owner) if parent else None
        seen += 1
    return labels
