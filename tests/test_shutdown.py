"""SIGTERM on a real `infercept serve` process while a stream is generating and a generation is paused
at a tool call: the stream finishes (or, past the grace period, ends with an error event and [DONE]),
the paused generation is released, and the process exits 0."""
from __future__ import annotations

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


@pytest.fixture
def served(default_model_dir, tmp_path):
    """`infercept serve` in its own process on a free port: (process, base URL, path of its log)."""
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infercept.server.cli", "serve", "--model", default_model_dir, "--port", "0",
             "--dtype", "float32", "--kv-cache-gb", "0.05", "--host-kv-gb", "0.02", "--threads", "1",
             "--served-model-name", "smol"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
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


def test_sigterm_finishes_streams_releases_paused_generations_and_exits_0(served):
    proc, base, log = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    paused = client.chat.completions.create(
        model="smol", messages=QUESTION, tools=[WEATHER], max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert paused.choices[0].finish_reason == "tool_calls"

    streams = []
    for max_tokens in (64, 800):  # one finishes within the grace period, one cannot
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

    (short, _), (long, _) = [(lines, None) for _, lines in streams]
    assert short[-1] == "[DONE]", short[-3:]
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]", long[-3:]  # past the grace period: cut, but with an error event
    assert "error" in json.loads(long[-2]), long[-2]
    text = log.read_text()
    released = [line for line in text.splitlines() if paused.id in line and "shutdown" in line]
    assert released, text[-3000:]
