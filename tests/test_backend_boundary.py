"""The server over a scripted `EngineBackend`: the boundary is the whole contract between them.

No model runs here: a fake backend answers from a script (a plain answer, a tool call that pauses, a
resume, bad input, a failure mid-stream) and reports snapshots one scrape late, as a backend running
its engine in another process may. The real server (uvicorn on a loopback port, its lifespan included)
is driven by the official openai SDK and plain HTTP.
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import serve_in_thread
from scripted_backend import WEATHER, ScriptedBackend

from infercept.engine.backend import EngineSnapshot, KVLocation
from infercept.server.app import build_app
from infercept.server.settings import ServerSettings


@pytest.fixture(scope="module")
def fake(default_model_dir):
    backend = ScriptedBackend(default_model_dir)
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="fake")))
    yield SimpleNamespace(backend=backend, base=base,
                          client=openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30))
    server.should_exit = True
    thread.join(timeout=10)
    assert not backend.running, "the lifespan did not shut the backend down"


def test_info_reaches_models_and_health(fake):
    assert httpx.get(fake.base + "/health").json() == {"status": "ok"}
    card = fake.client.models.list().data[0]
    assert card.id == "fake" and card.model_extra["max_model_len"] == 2048


def test_a_plain_answer(fake):
    r = fake.client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content == "Hello there." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(fake.backend.tokenizer.encode("Hello there.", add_special_tokens=False))


def test_a_tool_call_pauses_and_the_result_resumes_the_same_generation(fake):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = fake.client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Rome"}')
    paused_id = fake.backend.calls[-1][1]
    assert fake.backend.paused_kv_tokens(paused_id) > 0
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = fake.client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny."
    assert fake.backend.calls[-1] == ("resume", paused_id)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # what the backend said it reused


def test_bad_input_is_a_400_and_a_failure_mid_stream_ends_the_stream_with_an_error(fake):
    with pytest.raises(openai.BadRequestError, match="refuses"):
        fake.client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "bad"}])
    with pytest.raises(openai.APIStatusError) as failed:
        fake.client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "crash"}])
    assert failed.value.status_code == 503
    events = []
    with httpx.stream("POST", fake.base + "/v1/chat/completions", timeout=30, json={
            "model": "fake", "messages": [{"role": "user", "content": "crash"}], "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"error"' in events[-1] or '"error"' in events[-2], events[-3:]


def test_metrics_show_the_backend_snapshot_even_when_it_lags(fake):
    def steps() -> float:
        text = httpx.get(fake.base + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("infercept_engine_steps_total"))
        return float(line.split()[-1])

    first, second = steps(), steps()
    assert second == first + 1  # each scrape shows the backend's previous numbers, as it gave them


def test_an_engine_that_fails_for_good_fails_health_and_calls_the_exit_hook(default_model_dir):
    """`infercept serve` passes a hook that ends the process (exit status 1); here it is recorded."""
    backend = ScriptedBackend(default_model_dir)
    called = []
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="fake"),
                                                     on_engine_failure=lambda: called.append(True)))
    try:
        assert httpx.get(base + "/health").status_code == 200
        backend.dead = True
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.05)
        assert called == [True]
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.headers["Retry-After"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_server_imports_no_engine_internals():
    """Every `infercept.engine` import under server/ is the boundary module or the package's public names."""
    import ast
    from pathlib import Path

    server_dir = Path(__file__).resolve().parent.parent / "server"
    offenders = []
    for path in sorted(server_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            offenders += [(path.name, n) for n in names
                          if n.startswith("infercept.engine.") and n != "infercept.engine.backend"]
    assert not offenders, offenders


def test_snapshot_and_kv_location_are_plain_typed_values():
    snap = EngineSnapshot(num_steps=3)
    assert dataclasses.asdict(snap)["num_steps"] == 3
    assert KVLocation(device=4, cached=1).as_dict() == {"device": 4, "host": 0, "discarded": 0, "cached": 1}
