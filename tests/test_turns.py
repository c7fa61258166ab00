"""The typed turn API (server/turns.py) on its own, over the scripted backend: the events a turn yields,
in order, what it leaves in the conversation store, and admission. The HTTP front ends are adapters over
this (tests/test_server.py, test_responses.py, test_sessions_api.py drive them)."""
from __future__ import annotations

import asyncio

import pytest
from scripted_backend import WEATHER, ScriptedBackend

from infercept.server.app import build_app
from infercept.server.chat import Message, tool_specs
from infercept.server.protocol import APIError, ToolParam
from infercept.server.settings import ServerSettings
from infercept.server.tool_mode import tool_mode
from infercept.server.turns import (CallArguments, CallDone, CallOpened, Sampling, TextDelta, TurnFinished, TurnPaused,
                                    TurnSpec)


@pytest.fixture()
def served(default_model_dir):
    backend = ScriptedBackend(default_model_dir)
    app = build_app(backend, ServerSettings(served_model_name="fake", max_concurrent_requests=1))
    backend.start()
    yield backend, app.state.turns
    backend.shutdown()


def chat_spec(*messages: Message, tools=True) -> TurnSpec:
    specs = tool_specs([ToolParam.model_validate(WEATHER)]) if tools else None
    return TurnSpec("chat", Sampling(max_tokens=32), messages, mode=tool_mode(specs, None))


async def events_of(turn) -> list:
    try:
        return [event async for event in turn.events()]
    finally:
        await turn.close()


def test_a_text_turn_streams_its_text_and_finishes(served):
    backend, turns = served

    async def run():
        turn = await turns.open(chat_spec(Message("user", "Hi"), tools=False))
        assert turns.admission.in_flight == 1
        events = await events_of(turn)
        assert turns.admission.in_flight == 0
        return events

    events = asyncio.run(run())
    assert [type(e) for e in events] == [TextDelta, TextDelta, TurnFinished]
    assert "".join(e.text for e in events[:-1]) == "Hello there."
    end = events[-1]
    assert end.result.finish_reason == "stop" and end.result.message == Message("assistant", "Hello there.")
    assert end.usage.completion_tokens == len(end.output.token_ids) and end.usage.cached_tokens == 0


def test_a_call_pauses_the_turn_and_the_results_resume_it(served):
    backend, turns = served
    asked = Message("user", "What is the weather in Rome?")

    async def run():
        first = await events_of(await turns.open(chat_spec(asked)))
        call = first[-1].result.calls[0]
        results = (asked, first[-1].result.message, Message("tool", "sunny", tool_call_id=call.id))
        turn = await turns.open(chat_spec(*results))
        second = await events_of(turn)
        return first, turn, second

    first, resumed, second = asyncio.run(run())
    assert [type(e) for e in first] == [CallOpened, CallArguments, CallDone, TurnPaused, TurnFinished]
    opened, arguments, done, paused, end = first
    assert (opened.name, arguments.delta) == ("get_weather", '{"city": "Rome"}')
    assert done.call.id == opened.id == end.result.calls[0].id and end.result.finish_reason == "tool_calls"
    assert paused.handle.request_id == end.output.request_id
    # The store kept the pause, and the turn with the results took it and resumed the same generation.
    assert resumed.engine.resumed and resumed.engine.request_id == paused.handle.request_id
    assert ("resume", paused.handle.request_id) in backend.calls and not backend.paused
    assert turns.conversations.paused() == []
    assert [type(e) for e in second] == [TextDelta, TurnFinished]
    assert second[-1].usage.cached_tokens == len(paused.handle.token_ids)


def test_a_pause_not_kept_is_aborted_when_its_turn_closes(served):
    backend, turns = served

    async def run():
        turn = await turns.open(chat_spec(Message("user", "weather in Oslo?")))
        end = await turn.result(keep=False)
        assert backend.paused  # paused in the engine, not yet in the store
        await turn.close()
        return end

    end = asyncio.run(run())
    assert ("abort", end.output.request_id) in backend.calls and not backend.paused
    assert turns.conversations.paused() == []


def test_admission_refuses_before_anything_is_claimed(served):
    backend, turns = served

    async def run():
        turn = await turns.open(chat_spec(Message("user", "Hi"), tools=False))
        with pytest.raises(APIError) as refused:
            await turns.open(chat_spec(Message("user", "Hi"), tools=False))
        await turn.close()
        return refused.value

    assert asyncio.run(run()).status == 429
