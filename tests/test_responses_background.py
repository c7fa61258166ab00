"""Responses run in the background (`background: true`) against the live server, driven by the official
`openai` SDK: answered at once and polled to the answer a synchronous request gets; streamed, the client
leaving it running, and streamed again from a sequence number; cancelled mid-turn (its generation
released); its calls paused and resumed by a chained request; and the 400s / 404s of what cannot be."""
from __future__ import annotations

import time

import openai
import pytest

from live_server import MODEL
from test_responses import QUESTION, RESULT, TOOLS, assert_resumed

GREEDY = dict(model=MODEL, temperature=0)


def settled(client: openai.OpenAI, response_id: str, timeout: float = 60):
    """The response once it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"{response_id} still {r.status}"
        time.sleep(0.05)


def test_a_background_response_is_answered_at_once_and_polled_to_the_synchronous_answer(srv):
    client = srv.client()
    question = dict(input="Name three colours.", max_output_tokens=12, **GREEDY)
    queued = client.responses.create(background=True, **question)
    assert queued.status in ("queued", "in_progress") and queued.background is True and queued.output == []
    (item,) = client.responses.input_items.list(queued.id)  # (listed while it runs, as when it is stored)
    assert item.content[0].text == question["input"]
    done = settled(client, queued.id)
    assert [i.id for i in client.responses.input_items.list(done.id)] == [item.id]
    alike = client.responses.create(**question)
    assert done.status == alike.status and done.output_text == alike.output_text and done.output_text
    assert done.usage.output_tokens == alike.usage.output_tokens and done.background is True
    srv.assert_no_leak()


def test_a_background_stream_goes_on_without_its_client_and_streams_again(srv):
    client = srv.client()
    question = dict(input="Count from one to twenty in words.", max_output_tokens=24, **GREEDY)
    with client.responses.create(background=True, stream=True, **question) as stream:
        first = [next(stream) for _ in range(4)]  # created, in_progress, the text's item and part: then leave
    assert first[0].type == "response.created" and first[0].response.status == "queued"
    assert [e.sequence_number for e in first] == [0, 1, 2, 3]
    done = settled(client, first[0].response.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    # Streamed again, whole and after sequence number 2: the same events, to the end.
    again = list(client.responses.retrieve(done.id, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(again)))
    assert again[-1].type == f"response.{done.status}" and again[-1].response.output_text == done.output_text
    assert "".join(e.delta for e in again if e.type == "response.output_text.delta") == done.output_text
    tail = list(client.responses.retrieve(done.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in tail] == [e.sequence_number for e in again[3:]]
    before_the_first = list(client.responses.retrieve(done.id, stream=True, starting_after=-5))
    assert [e.sequence_number for e in before_the_first] == [e.sequence_number for e in again]
    srv.assert_no_leak()


def test_a_background_response_is_cancelled_mid_turn(srv):
    client = srv.client()
    running = client.responses.create(background=True, input="Write a long story.", max_output_tokens=4000,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(running.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # (again: as it is)
    events = list(client.responses.retrieve(running.id, stream=True))
    assert events and events[-1].type != "response.completed"
    srv.assert_no_leak()  # its turn ended, nothing of it is held
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)


def test_a_background_response_pauses_at_its_call_and_a_chained_request_resumes_it(srv):
    client = srv.client()
    queued = client.responses.create(background=True, input=QUESTION, tools=TOOLS, max_output_tokens=40, **GREEDY)
    first = settled(client, queued.id)
    (call,) = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    second = client.responses.create(previous_response_id=first.id, tools=TOOLS, max_output_tokens=6,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": RESULT}], **GREEDY)
    assert_resumed(second.usage)
    srv.assert_no_leak()


def test_what_a_background_response_cannot_be(srv):
    client = srv.client()
    with pytest.raises(openai.BadRequestError, match="store") as raised:
        client.responses.create(background=True, store=False, input="Hi", max_output_tokens=2, **GREEDY)
    assert raised.value.body["param"] == "background"
    plain = client.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="only a background response") as raised:
        client.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        list(client.responses.retrieve(plain.id, stream=True))
    for unknown in (lambda: client.responses.cancel("resp_unknown"),
                    lambda: list(client.responses.retrieve("resp_unknown", stream=True))):
        with pytest.raises(openai.NotFoundError):
            unknown()
    srv.assert_no_leak()
