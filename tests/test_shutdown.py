"""How a real `infercept serve` process holds connections and ends. An idle keep-alive connection
outlives a client pool's expiry (so a pooled connection is never closed under a request). SIGTERM
while streams are generating, a response runs in the background and a generation is paused at a tool
call: the streams finish (or, past the grace period, end with an error event and [DONE]), the background
turn and the paused generation are released, and the process exits 0. An engine thread that dies: the process exits 1 on its own, so a supervisor restarts
it."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


SERVE = ["serve", "--port", "0", "--dtype", "float32", "--kv-cache-gb", "0.05", "--host-kv-gb", "0.02",
         "--threads", "1", "--served-model-name", "smol"]
# `infercept serve` whose engine thread dies once a request arrives: a bug outside a step.
DYING_ENGINE = """
import sys
from infercept.engine import async_engine
from infercept.server.cli import main

def serve(self):
    while self._running and self._commands.empty():
        self._wake.wait(timeout=0.1)
    raise RuntimeError("injected: the engine thread's loop failed")

async_engine.AsyncEngine._serve = serve
main(sys.argv[1:])
"""


def start(argv: list[str], log) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})


@pytest.fixture
def served(default_model_dir, tmp_path):
    """`infercept serve` in its own process on a free port: (process, base URL, path of its log)."""
    log = tmp_path / "serve.log"
    proc = start([sys.executable, "-m", "infercept.server.cli", *SERVE, "--model", default_model_dir], log)
    base = None
    deadline = time.monotonic() + 240  # a fresh machine measures the policy's profile first
    while base is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"infercept serve exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "infercept serve did not start"
        if " on http://" in line:
            base = line.rsplit(" on ", 1)[1].strip()
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def stream_lines(base: str, max_tokens: int, started: threading.Event, lines: list[str]) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    started.set()
    except httpx.HTTPError as e:  # recorded: the assertions say the stream was cut
        lines.append(f"<cut: {e!r}>")
    finally:
        started.set()


def test_an_idle_connection_outlives_the_client_pools_expiry(served):
    # httpx and the openai SDK reuse a pooled connection for 5 s. A server that closed idle ones at 5 s
    # (uvicorn's default) raced that reuse: now and then a request met a closed socket (ReadError).
    _, base, _ = served
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    for pause in (0.0, httpx.Limits().keepalive_expiry + 1):
        time.sleep(pause)
        connection.request("GET", "/health")  # on the first request's socket: a closed one raises here
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.read()
    connection.close()


def test_sigterm_finishes_streams_releases_paused_generations_and_exits_0(served):
    proc, base, log = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    paused = client.chat.completions.create(
        model="smol", messages=QUESTION, tools=[WEATHER], max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert paused.choices[0].finish_reason == "tool_calls"
    background = client.responses.create(model="smol", input="Write a long story.", max_output_tokens=4000,
                                         background=True, extra_body={"ignore_eos": True})  # (runs past the grace)

    streams = []
    for max_tokens in (16, 800):  # one finishes well within the grace period (6 s), one cannot
        started, lines = threading.Event(), []
        thread = threading.Thread(target=stream_lines, args=(base, max_tokens, started, lines), daemon=True)
        thread.start()
        assert started.wait(60), "the stream did not start"
        streams.append((thread, lines))

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    for thread, _ in streams:
        thread.join(timeout=30)
        assert not thread.is_alive()

    short, long = [lines for _, lines in streams]
    assert short[-1] == "[DONE]", short[-3:]
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]", long[-3:]  # past the grace period: cut, but with an error event
    assert "error" in json.loads(long[-2]), long[-2]
    text = log.read_text()
    released = [line for line in text.splitlines() if paused.id in line and "shutdown" in line]
    assert released, text[-3000:]
    assert "Task was destroyed" not in text and f"background response {background.id} failed" not in text, text[-3000:]


def test_an_engine_that_dies_stops_the_process_with_status_1(default_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc = start([sys.executable, "-c", DYING_ENGINE, *SERVE, "--model", default_model_dir], log)
    try:
        line = ""
        while " on http://" not in line:
            line = proc.stdout.readline()
            assert line, f"infercept serve exited before serving: {log.read_text()[-2000:]}"
        base = line.rsplit(" on ", 1)[1].strip()
        response = httpx.post(base + "/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 4},
                              timeout=60)
        assert response.status_code == 503 and "internal error" in response.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the engine failed; exiting with status 1" in log.read_text()
