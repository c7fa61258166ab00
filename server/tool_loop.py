"""Server tools: turns served back to back while the model calls only tools the server runs itself.

A turn that ends in calls pauses its generation (kept by the store: for the turn's holder, a chat or
native session, or as an implicit record). When every call names an enabled server tool, the tools run
here while the generation waits paused, their results extend the conversation, and the next turn is
opened on it (the same `TurnSpec` with the longer conversation): it claims the paused generation and
resumes it, so the interception never leaves the server. The loop stops at a turn without calls, at a
call of a client tool (the client answers all of that turn's calls), or after `MAX_SERVER_TOOL_ROUNDS`.

Server tools follow the `infercept.tools` interface: `.name`, `.description`, `.parameters` (a JSON
schema) and `async run(arguments: dict) -> str`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from infercept.engine.backend import RequestOutput

from .chat import Call, Message
from .protocol import ToolParam, bad_request
from .turns import CallDone, TextDelta, Turn, TurnFinished, TurnResult, Turns, TurnSpec

logger = logging.getLogger("infercept.server")

MAX_SERVER_TOOL_ROUNDS = 8  # server-tool rounds per request before its calls go to the client anyway

# (event kind, payload): "delta" (its `content`, and as `tokens` the engine output it came with and the
# range of that output's tokens whose text it carries), "tool_call", "tool_result"
Emit = Callable[[str, dict], None]


def wire(data: dict) -> dict:
    """An event's payload as a client's stream shows it: without the engine's `tokens`."""
    return {k: v for k, v in data.items() if k != "tokens"}


def resolve_server_tools(names: list[str] | None, lookup: Callable[[str], Any], client_tools: list[ToolParam],
                         param: str) -> tuple[dict[str, Any], list[ToolParam]]:
    """The tool objects `names` enable, by the name the model calls them, and their definitions for the
    prompt (400 on unknown names or on a name the client's tools use too). A name may enable several
    tools (`mcp:<server>`: all of that MCP server's), and its tools may be called by other names
    (`mcp:calc/multiply` is the function `calc__multiply`)."""
    taken = {t.function.name for t in client_tools}
    tools: dict[str, Any] = {}
    for name in names or ():
        try:
            found = lookup(name)
        except KeyError:
            raise bad_request(f"unknown server tool {name!r}", param=param) from None
        for tool in found if isinstance(found, list) else [found]:
            if tools.get(tool.name) is tool:
                continue  # enabled twice, by its own name and by its server's
            if tool.name in taken:
                raise bad_request(f"tool {tool.name!r} is both a client tool and a server tool", param=param)
            taken.add(tool.name)
            tools[tool.name] = tool
    definitions = [ToolParam.model_validate({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}) for t in tools.values()]
    return tools, definitions


def call_view(call: Call, server_tools: Mapping[str, Any]) -> dict:
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "server": call.name in server_tools}


@dataclass
class Step:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass
class LoopOutcome:
    messages: list[Message]  # the conversation with every turn and server-tool result appended
    result: TurnResult  # the last turn
    last: RequestOutput  # its last engine output
    steps: list[Step]

    def usage(self) -> dict:
        prompt = sum(s.prompt_tokens for s in self.steps)
        completion = sum(s.completion_tokens for s in self.steps)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in self.steps)}}


def _same_spec(spec: TurnSpec, messages: list[Message], num_calls: int) -> TurnSpec:
    return replace(spec, messages=tuple(messages))


async def serve_turns(turns: Turns, turn: Turn, server_tools: Mapping[str, Any], emit: Emit,
                      on_turn: Callable[[Turn], None] = lambda turn: None,
                      respec: Callable[[TurnSpec, list[Message], int], TurnSpec] = _same_spec,
                      on_result: Callable[[Call, str, Exception | None], None] = lambda *_: None) -> LoopOutcome:
    """Serve the opened `turn`, and after each round of server-tool calls the next turn of its spec with
    the conversation so far (`on_turn` is told of each such turn as it opens). `respec(spec, messages,
    num_calls)` makes the next turn's spec from the last one, the conversation and the number of server
    calls run so far (the Responses API's MCP tools lift a forced tool_choice after the first round and
    forbid calls past max_tool_calls; the tool mode changes, the rendered tools do not). `on_result` is
    told of each server call's result and failure (None when it succeeded)."""
    messages = list(turn.spec.messages)
    steps: list[Step] = []
    rounds = num_calls = 0
    while True:
        try:
            end = await _serve_turn(turn, server_tools, emit)
        finally:
            await turn.close()
        result = end.result
        messages.append(result.message)
        steps.append(Step(end.usage.prompt_tokens, end.usage.cached_tokens, end.usage.completion_tokens,
                          result.finish_reason))
        if not result.calls or rounds == MAX_SERVER_TOOL_ROUNDS \
                or any(c.name not in server_tools for c in result.calls):
            return LoopOutcome(messages, result, end.output, steps)
        outputs = await asyncio.gather(*(tool_outcome(server_tools[c.name], c) for c in result.calls))
        for call, (output, error) in zip(result.calls, outputs):
            emit("tool_result", {"tool_call_id": call.id, "name": call.name, "content": output})
            on_result(call, output, error)
            messages.append(Message("tool", output, tool_call_id=call.id))
        rounds += 1
        num_calls += len(result.calls)
        turn = await turns.open(respec(turn.spec, messages, num_calls))
        on_turn(turn)


async def _serve_turn(turn: Turn, server_tools: Mapping[str, Any], emit: Emit) -> TurnFinished:
    """One turn to its end, its content emitted as `delta`s while it is generated, then its calls."""
    shown = None  # the turn's tokens whose text the deltas so far carried (the first follow its thinking)
    async for event in turn.events():
        if isinstance(event, TextDelta):
            if shown is None:
                shown = turn.usage(event.output).reasoning_tokens or 0
            tokens, shown = (event.output, shown, len(event.output.token_ids)), len(event.output.token_ids)
            emit("delta", {"content": event.text, "tokens": tokens})
        elif isinstance(event, CallDone):
            emit("tool_call", call_view(event.call, server_tools))
        elif isinstance(event, TurnFinished):
            return event


async def run_tool(tool, call: Call) -> str:
    """A server tool's result; a failure is reported to the model as the result, so it can answer."""
    return (await tool_outcome(tool, call))[0]


async def tool_outcome(tool, call: Call) -> tuple[str, Exception | None]:
    """What the model reads of a server tool's call (a failure as `error: ...`), and the failure if any."""
    arguments = call.arguments_value()
    if not isinstance(arguments, dict):
        error = ValueError(f"the arguments of {call.name} are not a JSON object")
        return f"error: {error}", error
    try:
        return str(await tool.run(arguments)), None
    except Exception as e:
        logger.info("server tool %s failed: %s", call.name, e)
        return f"error: {e}", e


async def events_then_result(work: Awaitable, events: asyncio.Queue) -> AsyncIterator[tuple[str, Any]]:
    """The (kind, payload) events put on `events` while `work` runs, then ("done", its result). An
    exception of `work` propagates after the events it emitted."""
    waiter = asyncio.ensure_future(work)
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not events.empty():
                yield events.get_nowait()
            yield "done", waiter.result()
            return
    finally:
        waiter.cancel()  # the consumer left early (a client gone): the work stops too
