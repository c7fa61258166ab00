"""Structured outputs through the real `openai` SDK against the live server and its embedded model:
Responses `text.format` (JSON, the same grammar path as Chat Completions' response_format), vLLM's
`structured_outputs` regex / choice on Chat Completions, Completions and Responses (and the older
`guided_regex` / `guided_choice` on the first two), `n` > 1 samples, and the 400s where a request cannot hold together."""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from infercept.engine import SamplingParams
from infercept.engine.sampling_params import GuidedDecodingParams
from infercept.engine.vllm_backend.params import vllm_sampling_fields
from live_server import MODEL

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"  # (\d would allow any Unicode digit, as Python's re does)
MOODS = ["positive", "negative", "neutral"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
SEEDED = dict(temperature=1.0, seed=7)  # sampled, not greedy: the grammar, not the argmax, keeps the shape


def chat(client, question: str, **kw):
    kw = {"max_tokens": 24} | kw
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kw)


def complete(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, **({"max_tokens": 24} | kw))


def person_format(name: str = "person") -> dict:
    return {"type": "json_schema", "name": name, "schema": PERSON, "strict": True}


# -- Responses text.format ---------------------------------------------------------------------------

def test_responses_text_format_json_schema_and_json_object(srv):
    client = srv.client()
    free = client.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=24, temperature=0)
    assert free.output_text.lstrip()[:1] != "{" and free.text.format.type == "text"  # unconstrained: prose
    for sampling in (dict(temperature=0), dict(temperature=1.0)):
        out = client.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=64,
                                      text={"format": person_format()}, **sampling)
        assert out.status == "completed", out.output_text
        jsonschema.validate(json.loads(out.output_text), PERSON)
        assert out.text.format.type == "json_schema" and out.text.format.name == "person"
        assert out.text.format.schema_ == PERSON and out.text.format.strict is True  # echoed as asked
    obj = client.responses.create(model=MODEL, input="Give me a city.", max_output_tokens=48, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict) and obj.text.format.type == "json_object"
    # Stored, the response keeps the format it was asked for.
    assert client.responses.retrieve(obj.id).text.format.type == "json_object"


def test_responses_text_format_streamed_and_parsed(srv):
    client = srv.client()
    full = client.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=64,
                                   temperature=0, text={"format": person_format()})
    with client.responses.stream(model=MODEL, input="Describe a person as JSON.", max_output_tokens=64,
                                 temperature=0, text={"format": person_format()}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) >= 3 and "".join(deltas) == full.output_text == final.output_text

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    parsed = client.responses.parse(model=MODEL, input="Describe a person as JSON.", max_output_tokens=64,
                                    temperature=0, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}, "cannot be enforced"),
    ({"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}, "cannot be enforced"),
    ({"type": "json_schema", "name": "x"}, "schema"),
    ({"type": "yaml"}, "text.format"),
])
def test_responses_text_formats_that_cannot_be_served_are_400(srv, fmt, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        srv.client().responses.create(model=MODEL, input="Hi", text={"format": fmt})
    assert raised.value.body["param"].startswith("text.format")


# -- regex and choice --------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_chat_regex_and_choice(srv, field):
    def body(regex=None, choice=None) -> dict:
        if field == "guided":
            return {"guided_regex": regex} if regex is not None else {"guided_choice": choice}
        return {"structured_outputs": {"regex": regex} if regex is not None else {"choice": choice}}

    client = srv.client()
    free = chat(client, "What is the phone number of the office?", temperature=0)
    assert not re.fullmatch(PHONE, free.choices[0].message.content)  # unconstrained, the model writes prose
    for sampling in (dict(temperature=0), SEEDED):
        phone = chat(client, "What is the phone number of the office?", extra_body=body(regex=PHONE), **sampling)
        assert re.fullmatch(PHONE, phone.choices[0].message.content), phone.choices[0].message.content
        assert phone.choices[0].finish_reason == "stop"
        mood = chat(client, "Is 'I love it' positive or negative?", extra_body=body(choice=MOODS), **sampling)
        assert mood.choices[0].message.content in MOODS and mood.choices[0].finish_reason == "stop"
    stream = chat(client, "What is the phone number of the office?", extra_body=body(regex=PHONE), temperature=0,
                  stream=True)
    assert re.fullmatch(PHONE, "".join(c.delta.content or "" for chunk in stream for c in chunk.choices))
    # tool_choice none keeps the tools in the prompt and calls out: the regex alone constrains the turn.
    none = chat(client, "Weather in Oslo?", tools=[WEATHER], tool_choice="none", extra_body=body(choice=MOODS))
    assert none.choices[0].message.content in MOODS


def test_responses_regex_and_choice(srv):
    """vLLM's Responses API takes `structured_outputs` as its Chat Completions does: the output text
    fullmatches the regex, or is one of the choices; streamed alike."""
    client = srv.client()

    def respond(question: str, constraint: dict, seed: int | None = None, **kw):
        return client.responses.create(model=MODEL, input=question, max_output_tokens=24,
                                       extra_body={"structured_outputs": constraint, "seed": seed}, **kw)

    for sampling in (dict(temperature=0), SEEDED):  # (the SDK's Responses has no seed: vLLM's, in the body)
        phone = respond("What is the phone number of the office?", {"regex": PHONE}, **sampling)
        assert re.fullmatch(PHONE, phone.output_text) and phone.status == "completed", phone.output_text
        mood = respond("Is 'I love it' positive or negative?", {"choice": MOODS}, **sampling)
        assert mood.output_text in MOODS and mood.status == "completed", mood.output_text
    with client.responses.stream(model=MODEL, input="What is the phone number of the office?", max_output_tokens=24,
                                 temperature=0, extra_body={"structured_outputs": {"regex": PHONE}}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert re.fullmatch(PHONE, text), text
    none = respond("Weather in Oslo?", {"choice": MOODS}, tools=[RESPONSES_WEATHER], tool_choice="none")
    assert none.output_text in MOODS


@pytest.mark.parametrize("kw, param, message", [
    (dict(tools=[RESPONSES_WEATHER], extra_body={"structured_outputs": {"regex": PHONE}}), "structured_outputs",
     "cannot also make tool calls"),
    (dict(text={"format": {"type": "json_object"}}, extra_body={"structured_outputs": {"choice": MOODS}}),
     "structured_outputs", "JSON text.format"),
    (dict(extra_body={"structured_outputs": {"regex": "(?<=a)b"}}), "structured_outputs", "cannot be enforced"),
    (dict(extra_body={"guided_regex": PHONE}), "guided_regex", "Unrecognized"),  # (not a Responses field in vLLM)
])
def test_responses_constraints_that_cannot_hold_are_400(srv, kw, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        srv.client().responses.create(model=MODEL, input="Hi", max_output_tokens=8, **kw)
    assert raised.value.body["param"] == param


def test_completions_regex_and_choice(srv):
    client = srv.client()
    prompt = "The office phone number is"
    assert not re.fullmatch(PHONE, complete(client, prompt, temperature=0).choices[0].text)
    for sampling in (dict(temperature=0), SEEDED):
        out = complete(client, prompt, extra_body={"structured_outputs": {"regex": PHONE}}, **sampling)
        assert re.fullmatch(PHONE, out.choices[0].text), out.choices[0].text
        out = complete(client, "The review 'I love it' is", extra_body={"guided_choice": MOODS}, **sampling)
        assert out.choices[0].text in MOODS
    stream = complete(client, prompt, extra_body={"guided_regex": PHONE}, temperature=0, stream=True)
    assert re.fullmatch(PHONE, "".join(c.text for chunk in stream for c in chunk.choices))


@pytest.mark.parametrize("kw, param, message", [
    (dict(tools=[WEATHER], extra_body={"structured_outputs": {"regex": PHONE}}), "structured_outputs",
     "cannot also make tool calls"),
    (dict(tools=[WEATHER], tool_choice="required", extra_body={"guided_choice": MOODS}), "guided_choice",
     "cannot also make tool calls"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": PHONE}), "guided_regex",
     "give one of them"),
    (dict(extra_body={"guided_regex": PHONE, "structured_outputs": {"choice": MOODS}}), "guided_regex",
     "give one of"),
    (dict(extra_body={"structured_outputs": {"regex": PHONE, "choice": MOODS}}), "structured_outputs",
     "exactly one of regex and choice"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice", "at least 1"),
    (dict(extra_body={"structured_outputs": {"json": {}}}), "structured_outputs.json", "Unrecognized"),
    (dict(extra_body={"structured_outputs": {"regex": "(?<=a)b"}}), "structured_outputs", "cannot be enforced"),
    (dict(extra_body={"guided_regex": PHONE, "min_tokens": 4}), "guided_regex", "grammar-constrained"),
])
def test_chat_constraints_that_cannot_hold_are_400(srv, kw, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        chat(srv.client(), "Hi", **kw)
    assert raised.value.body["param"] == param


def test_completions_bad_regex_is_400(srv):
    with pytest.raises(openai.BadRequestError, match="cannot be enforced") as raised:
        complete(srv.client(), "Hi", extra_body={"guided_regex": "[a-"})
    assert raised.value.body["param"] == "guided_regex"


# -- n > 1 -------------------------------------------------------------------------------------------

def test_chat_n_samples(srv):
    client = srv.client()
    out = chat(client, "Write a short poem.", n=3, max_tokens=12, extra_body={"return_token_ids": True}, **SEEDED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # independent samples, not one repeated
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    assert out.usage.prompt_tokens == len(out.prompt_token_ids)  # the prompt counted once
    again = chat(client, "Write a short poem.", n=3, max_tokens=12, **SEEDED)  # seeded: reproducible
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    # n samples under a constraint: each follows it.
    moods = chat(client, "Is 'I love it' positive?", n=4, extra_body={"guided_choice": MOODS}, temperature=1.0)
    assert len(moods.choices) == 4 and all(c.message.content in MOODS for c in moods.choices)
    # With tools and tool_choice none the turn cannot pause, so it can fork.
    assert len(chat(client, "Weather?", tools=[WEATHER], tool_choice="none", n=2, max_tokens=4).choices) == 2


def test_chat_n_samples_stream(srv):
    client = srv.client()
    full = chat(client, "Write a short poem.", n=2, max_tokens=12, **SEEDED)
    stream = chat(client, "Write a short poem.", n=2, max_tokens=12, stream=True,
                  stream_options={"include_usage": True}, **SEEDED)
    texts, finished, usage = {}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert usage.completion_tokens == full.usage.completion_tokens


def test_completions_n_samples(srv):
    client = srv.client()
    prompts = ["Once upon a time", "The capital of France"]
    out = complete(client, prompts, n=2, max_tokens=8, extra_body={"return_token_ids": True}, **SEEDED)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt p's samples are p*n ... p*n + n-1
    ids = [c.model_extra["prompt_token_ids"] for c in out.choices]
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[2])  # each prompt once, not once per sample
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in out.choices)
    stream = complete(client, prompts, n=2, max_tokens=8, stream=True, **SEEDED)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in out.choices]


@pytest.mark.parametrize("call, message", [
    (lambda c: chat(c, "Weather?", tools=[WEATHER], n=2), "may end in tool calls"),
    (lambda c: chat(c, "Hi", n=2, extra_body={"session_id": "s-n"}), "session"),
    (lambda c: complete(c, "Hi", n=2, extra_body={"intercept": {"kind": "tool"}}), "intercept"),
])
def test_n_where_a_turn_could_pause_is_400(srv, call, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        call(srv.client())
    assert raised.value.body["param"] == "n" and "cannot pause" in raised.value.body["message"]


# -- the vLLM backend: the same grammars as vLLM's structured outputs ---------------------------------

GRAMMARS = [(GuidedDecodingParams(regex=PHONE), {"regex": PHONE}),
            (GuidedDecodingParams(choice=tuple(MOODS)), {"choice": MOODS})]


def test_vllm_backend_sends_regex_and_choice_as_their_own_kinds():
    for guided, expected in GRAMMARS:
        assert vllm_sampling_fields(SamplingParams(guided=guided), resumable=False)["structured_outputs"] == expected


def vllm_python() -> str:
    from infercept.engine import default_vllm_python

    return default_vllm_python()


@pytest.mark.skipif(not os.path.isfile(vllm_python()), reason="no vLLM environment (`make vllm-env`)")
def test_vllms_structured_outputs_take_regex_and_choice():
    """The worker's own conversion (worker.sampling_params) in vLLM's python: vLLM keeps each kind. One
    process converts every grammar (importing vLLM takes seconds)."""
    worker_dir = Path(__file__).resolve().parent.parent / "engine" / "vllm_backend"
    code = ("import json, pickle, sys; sys.path.insert(0, sys.argv[1]); from worker import sampling_params; "
            "kept = [sampling_params(fields).structured_outputs for fields in pickle.load(sys.stdin.buffer)]; "
            "print(json.dumps([[s.regex, s.choice] for s in kept]))")
    fields = [vllm_sampling_fields(SamplingParams(guided=guided), resumable=False) for guided, _ in GRAMMARS]
    run = subprocess.run([vllm_python(), "-c", code, str(worker_dir)], capture_output=True, timeout=300,
                         input=pickle.dumps(fields))
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    sent = json.loads(run.stdout.decode().strip().splitlines()[-1])
    assert sent == [[expected.get("regex"), expected.get("choice")] for _, expected in GRAMMARS]
