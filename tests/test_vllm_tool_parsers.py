"""vLLM's own tool parsers (`--tool-parser NAME` on the vLLM backend), the parts that need no vLLM: which
names serve and where, the output stage's verdict on the calls vLLM's parser found, and the server's
rendering of them (over a scripted backend). The parse itself runs in vLLM's python
(tests/vllm_scheduler_cases.py: `vllms_tool_parsers_read_a_turn_as_vllms_chat_serving_does`), and a live
vLLM writes, pauses on and resumes such calls in tests/test_vllm_backend.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_backend import ScriptedBackend
from stdlib_only import non_stdlib_imports

from infercept.engine.backend import ToolFormat, VllmToolFormat, tool_format_for
from infercept.engine.output_stage import Action, TurnOutput, TurnRule, call_judge
from infercept.engine.request import InterceptParams
from infercept.engine.sampling_params import SamplingParams
from infercept.engine.tool_parsers import ParsedByVllm, ToolCall
from infercept.engine.tool_spec import ToolSpec

WEATHER = ToolSpec.function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"]})
VLLMS = ("hermes", "kimi_k2", "qwen3_coder", "qwen3_json", "xlam")  # as a vLLM worker lists them
# ... and says why those that cannot force a call cannot (xlam: as vLLM 0.32's worker says).
FORCING_REFUSALS = {"xlam": "it has no structural tag for its calls (vLLM would force them as a JSON list, not in "
                            "the model's own format)"}
REPO = Path(__file__).resolve().parent.parent


def test_a_name_serves_ours_first_else_vllms_where_vllm_runs():
    assert type(tool_format_for("hermes", None, VLLMS)) is ToolFormat  # ours, though vLLM has one too
    assert type(tool_format_for("qwen3_coder", None, VLLMS)) is ToolFormat
    vllms = tool_format_for("kimi_k2", None, VLLMS)
    assert isinstance(vllms, VllmToolFormat) and vllms.family == "vllm:kimi_k2"
    assert tool_format_for("vllm:hermes", None, VLLMS).family == "vllm:hermes"  # vLLM's, asked by name
    assert tool_format_for("vllm:qwen3_coder", None, VLLMS).family == "vllm:qwen3_coder"
    with pytest.raises(ValueError, match="one of ours .* or one of vLLM's .*kimi_k2, qwen3_coder"):
        tool_format_for("qwen3_xmll", None, VLLMS)
    # The native engine runs no vLLM parser: the error says where one runs.
    with pytest.raises(ValueError, match="--backend vllm"):
        tool_format_for("kimi_k2", None, ())
    with pytest.raises(ValueError, match="--backend vllm"):
        tool_format_for("vllm:hermes", None, ())


def test_only_the_vllm_backend_judges_a_turn_by_vllms_parser():
    intercept = InterceptParams(tool_parser="vllm:qwen3_coder", tools=(WEATHER,))
    with pytest.raises(ValueError, match="vLLM backend only"):  # the native engine refuses the request
        call_judge(intercept)
    assert isinstance(call_judge(intercept, vllm_parses=True).parser, ParsedByVllm)
    # Inside vLLM nothing watches for its calls: the turn ends where the model ends it.
    assert TurnRule.of(SamplingParams(), intercept).empty
    assert TurnRule.of(SamplingParams(stop=["\n\n"]), intercept) == TurnRule(stop=("\n\n",))


def turn(tokenizer, text: str, intercept: InterceptParams) -> TurnOutput:
    stage = TurnOutput(tokenizer, [1, 2, 3], SamplingParams(temperature=0), intercept, frozenset({2}), vllm_parses=True)
    for token in tokenizer.encode(text, add_special_tokens=False):
        stage.add(token)
    return stage


CALL_TEXT = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_the_turn_pauses_on_the_calls_vllms_parser_found_and_only_at_its_end(tokenizer):
    stage = turn(tokenizer, CALL_TEXT, InterceptParams(tool_parser="vllm:qwen3_coder", tools=(WEATHER,)))
    assert stage.vllm_parser == "qwen3_coder"
    assert stage.decide(stopped=False).action is Action.GO_ON  # never at a call: only where the model ends
    stage.take_vllm_calls([["get_weather", '{"city":"Paris"}', "chatcmpl-tool-1"]], "Sure.")
    verdict = stage.decide(stopped=True)
    assert verdict.action is Action.PAUSE
    (call,) = verdict.calls
    assert (call.name, json.loads(call.arguments), call.id) == ("get_weather", {"city": "Paris"}, "chatcmpl-tool-1")
    out = stage.output("r", [1, 2, 3], [], verdict, "stop", None, None, 0)
    assert out.paused and out.finish_reason == "tool_calls" and out.content == "Sure." and out.tool_calls == [call]


def test_calls_that_do_not_all_count_finish_the_turn_and_a_turn_without_calls_is_an_answer(tokenizer):
    intercept = InterceptParams(tool_parser="vllm:qwen3_coder", tools=(WEATHER,))
    unknown = turn(tokenizer, CALL_TEXT, intercept)
    unknown.take_vllm_calls([["get_weather", '{"city": "Paris"}', "a"], ["get_time", "{}", "b"]], "Sure.")
    verdict = unknown.decide(stopped=True)
    assert verdict.action is Action.FINISH and [c.name for c in verdict.calls] == ["get_weather"]
    assert "<function=get_weather>" in verdict.judged.content  # the turn's text: nothing is lost
    # Arguments that are no JSON object make no call: they stay in the content, as text.
    broken = turn(tokenizer, CALL_TEXT, intercept)
    broken.take_vllm_calls([["get_weather", "Paris", "a"]], "Sure.")
    verdict = broken.decide(stopped=True)
    assert verdict.action is Action.FINISH and not verdict.calls
    answer = turn(tokenizer, "It is sunny.", intercept)
    answer.take_vllm_calls([], None)
    verdict = answer.decide(stopped=True)
    assert verdict.action is Action.FINISH and verdict.judged is None
    assert answer.output("r", [], [], verdict, "stop", 2, None, 0).text == "It is sunny."


def test_a_stream_shows_what_vllms_parser_streamed_as_the_turns_final_content_reads_it(tokenizer):
    """The content vLLM's parser streamed (the worker's, with each output) shows without its leading
    whitespace and with its trailing whitespace held back, as the final content is stripped, and so is a
    tail that may still become a stop string, which the turn's end cuts off; a turn our parser reads has none."""
    intercept = InterceptParams(tool_parser="vllm:qwen3_coder", tools=(WEATHER,))
    stage = TurnOutput(tokenizer, [1, 2, 3], SamplingParams(temperature=0, stop=["END"]), intercept, frozenset({2}),
                       vllm_parses=True)
    shown = []
    for delta in ("\n ", "Sure, ", "it is sunny.\n", "EN"):
        stage.add_vllm_content(delta)
        shown.append(stage.streamed_content)
    assert shown == ["", "Sure", "Sure, it is sunny", "Sure, it is sunny."]
    assert stage.output("r", [1, 2, 3], [], stage.decide(stopped=False), None, None, None, 0).streamed_content == \
        "Sure, it is sunny."
    ours = TurnOutput(tokenizer, [1, 2, 3], SamplingParams(temperature=0), InterceptParams(tool_parser="hermes"),
                      frozenset({2}), vllm_parses=True)
    assert ours.streamed_content is None
    assert ours.output("r", [1, 2, 3], [], ours.decide(stopped=False), None, None, None, 0).streamed_content is None


def test_vllms_parser_runs_in_vllms_python_only():
    """tool_calls.py runs in the worker, beside vLLM: the standard library and vllm (of ours, only modules
    beside it that are themselves the standard library: tests/test_vllm_backend.py checks them)."""
    assert set(non_stdlib_imports(REPO / "engine" / "vllm_backend" / "tool_calls.py")) <= {"vllm"}


# -- the server over a backend that reports vLLM's parsers --------------------------------------------

class StreamedTurns(ScriptedBackend):
    """Turns as the vLLM backend reports those vLLM's parser reads, picked by a word of the prompt
    (STREAMED_TURNS): each output carries the content the parser streamed so far (`streamed_content`),
    the last the calls and content of the whole turn."""

    async def generate(self, prompt, params, request_id, intercept=None):
        asked = self.tokenizer.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        steps, text, calls, content = next(turn for word, turn in STREAMED_TURNS.items() if word in asked)
        for written, streamed in steps:
            out = self._out(request_id, prompt, written)
            out.streamed_content = streamed
            yield out
        if calls:
            self.paused[request_id] = len(prompt)
        yield self._out(request_id, prompt, text, finished=not calls, paused=bool(calls), content=content,
                        tool_calls=[ToolCall(*call) for call in calls])


ROME = ("get_weather", '{"city": "Rome"}', "", "chatcmpl-tool-9")
STREAMED_TURNS = {  # word: (outputs' (text, streamed content), the turn's text, its calls, its content)
    "look": ([("Let", "Let"), ("Let me", "Let me"), ("Let me look.\n", "Let me look."),
              ("Let me look.\n<tool_call>", "Let me look.")], "Let me look.\n" + CALL_TEXT, [ROME], "Let me look."),
    # An answer whose text starts blank: its content is its text as written, the stream's went on from its start.
    "blank": ([("\n It", "It"), ("\n It is", "It is")], "\n It is sunny.", [], None),
    # vLLM's parser read the turn as it was written otherwise than whole: what was shown stays, alone.
    "differ": ([("It is sun", "It is sun")], "It is sun" + CALL_TEXT, [ROME], "Sunny."),
}


def serve_vllms_parser(model_dir: str, parser: str, call_id: str, backend_cls: type = ScriptedBackend):
    """A live server over a scripted backend (`backend_cls`) that runs vLLM's parsers, serving
    `--tool-parser PARSER`: its "weather" turn ends in a call with the id `call_id` from vLLM's parser, as
    the vLLM backend's output stage returns one. Yields (backend, an openai client)."""
    from dataclasses import replace

    import openai
    from live_server import serve_in_thread

    from infercept.server.app import build_app
    from infercept.server.settings import ServerSettings

    backend = backend_cls(model_dir)
    backend.info = replace(backend.info, vllm_tool_parsers=VLLMS, vllm_forcing_refusals=FORCING_REFUSALS)
    scripted_generate = backend.generate

    async def generate(prompt, params, request_id, intercept=None):
        backend.intercepts.append(intercept)
        backend.params.append(params)
        async for out in scripted_generate(prompt, params, request_id, intercept):
            if out.tool_calls:
                out.tool_calls = [replace(c, id=call_id) for c in out.tool_calls]
            yield out

    backend.intercepts, backend.params = [], []
    backend.generate = generate
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="m",
                                                                             tool_parser=parser)))
    yield backend, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(default_model_dir):
    yield from serve_vllms_parser(default_model_dir, "vllm:qwen3_coder", "chatcmpl-tool-7")


@pytest.fixture(scope="module")
def served_streamed(default_model_dir):
    yield from serve_vllms_parser(default_model_dir, "vllm:qwen3_coder", "chatcmpl-tool-9", StreamedTurns)


@pytest.fixture(scope="module")
def served_xlam(default_model_dir):
    yield from serve_vllms_parser(default_model_dir, "xlam", "chatcmpl-tool-11")


@pytest.fixture(scope="module")
def served_kimi(default_model_dir):
    """vLLM's kimi_k2 parser takes a call's id from the model's text: Kimi-K2 writes `functions.NAME:INDEX`,
    INDEX counting the calls of its conversation, so every conversation's first call has the same id."""
    yield from serve_vllms_parser(default_model_dir, "kimi_k2", "functions.get_weather:0")


def test_the_server_returns_vllms_calls_and_resumes_them(served):
    backend, client = served
    tools = [dict(WEATHER.definition)]
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=tools)
    assert backend.intercepts[-1].tool_parser == "vllm:qwen3_coder"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
        ("chatcmpl-tool-7", "get_weather", {"city": "Rome"})
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=tools)
    assert backend.calls[-1][0] == "resume" and second.choices[0].message.content == "It is sunny."


def test_a_stream_shows_vllms_calls_once_judged(served):
    _, client = served
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[dict(WEATHER.definition)], stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert [(tc.id, tc.function.name) for tc in calls if tc.id] == [("chatcmpl-tool-7", "get_weather")]
    assert chunks[-1].finish_reason == "tool_calls"


def streamed_chat(client, question: str) -> tuple[list[str], list, str]:
    """(the content's deltas, the calls' deltas, the finish reason) of a streamed chat turn with tools."""
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                            tools=[dict(WEATHER.definition)], stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    return [c.delta.content for c in chunks if c.delta.content], \
        [tc for c in chunks for tc in c.delta.tool_calls or []], chunks[-1].finish_reason


def test_a_stream_shows_the_content_vllms_parser_streamed_as_it_came_and_the_calls_once_judged(served_streamed):
    _, client = served_streamed
    content, calls, finish = streamed_chat(client, "look it up")
    assert content == ["Let", " me", " look."] and finish == "tool_calls"
    assert [(tc.id, tc.function.name) for tc in calls if tc.id] == [("chatcmpl-tool-9", "get_weather")]
    # The answer's text as written, though the stream's content started after its blanks.
    content, calls, finish = streamed_chat(client, "blank")
    assert content == ["It", " is", " sunny."] and not calls and finish == "stop"
    # The turn's content is not what vLLM's parser streamed: nothing is shown twice nor spliced.
    content, calls, finish = streamed_chat(client, "differ")
    assert content == ["It is sun"] and [tc.function.name for tc in calls if tc.id] == ["get_weather"]
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "differ"}],
                                           tools=[dict(WEATHER.definition)]).choices[0].message
    assert whole.content == "Sunny." and whole.tool_calls[0].function.name == "get_weather"


def test_forced_calls_go_to_the_backend_to_be_written_in_the_models_format(served, served_xlam):
    """A vLLM parser with a structural tag forces calls: the turn reaches the backend with what it must call
    and no grammar of ours (the worker builds it from vLLM's parser) and no prefill; one without is
    refused, saying why. A JSON answer beside calls stays refused; tool_choice none parses no call."""
    import openai

    backend, client = served
    tools = [dict(WEATHER.definition)]
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, forced in (("required", "required"), (named, "get_weather")):
        message = client.chat.completions.create(model="m", messages=messages, tools=tools,
                                                 tool_choice=choice).choices[0].message
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        intercept, params = backend.intercepts[-1], backend.params[-1]
        assert intercept.forced_call == forced and intercept.text_prefix == "" and params.guided is None, intercept
    # min_tokens / ignore_eos would hold back the end the worker's grammar decides: refused, as beside ours.
    for extra in ({"min_tokens": 4}, {"ignore_eos": True}):
        with pytest.raises(openai.BadRequestError, match="min_tokens and ignore_eos do not combine") as e:
            client.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice="required",
                                           extra_body=extra)
        assert e.value.body["param"] == "tool_choice"
    _, refusing = served_xlam
    for choice, said in (("required", "tool_choice required"), (named, "naming 'get_weather'")):
        with pytest.raises(openai.BadRequestError, match=f"{said} cannot be enforced with vLLM's tool parser "
                                                         "'xlam': it has no structural tag") as e:
            refusing.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="vllm:qwen3_coder"):
        client.chat.completions.create(model="m", messages=messages, tools=tools,
                                       response_format={"type": "json_object"})
    # tool_choice none: no grammar to keep calls out (nothing here knows how they are written), none parsed.
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                            tool_choice="none")
    assert answer.choices[0].message.content == "Hello there."
    assert backend.intercepts[-1] is None


def test_conversations_whose_calls_share_an_id_each_resume_their_own_pause(served_kimi):
    backend, client = served_kimi
    tools = [dict(WEATHER.definition)]
    conversations = [[{"role": "user", "content": "What is the weather in Rome?"}],
                     [{"role": "user", "content": "Rome: how is the weather there now?"}]]
    paused = []
    for messages in conversations:  # both pause on a call named functions.get_weather:0
        message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
        assert [c.id for c in message.tool_calls] == ["functions.get_weather:0"]
        paused.append(backend.calls[-1][1])
        messages += [message, {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    for messages, request_id in zip(conversations, paused):  # the older one first: its id is not the newest
        answer = client.chat.completions.create(model="m", messages=messages, tools=tools)
        assert backend.calls[-1] == ("resume", request_id)
        assert answer.choices[0].message.content == "It is sunny."
