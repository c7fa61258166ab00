"""The Vercel AI SDK (npm `ai` with `@ai-sdk/openai-compatible` and `@ai-sdk/openai`, pinned in the Makefile),
unmodified, against the live server with the embedded model on each backend: `generateText` and `streamText`
run an agent's tool loop (tests/ai_sdk_agent.mjs: a tool the SDK executes, then the answer), and the step
after the tool resumes the paused generation, its whole context but the last token read from the cache. The
OpenAI provider's Responses model does the same over two chat turns (tests/ai_sdk_responses.mjs), the second
sending the first's answer back as an `item_reference` to the stored response's item. Installed by
`make ai-sdk` (npm); skipped without it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from live_server import resumes

AI_SDK = Path(__file__).resolve().parents[1] / ".ai-sdk"
AGENT = Path(__file__).with_name("ai_sdk_agent.mjs")
RESPONSES_CHAT = Path(__file__).with_name("ai_sdk_responses.mjs")
needs_ai_sdk = pytest.mark.skipif(not (AI_SDK / "node_modules" / "ai").is_dir() or shutil.which("node") is None,
                                  reason="needs the AI SDK (make ai-sdk: npm) and node")


def run_agent(backend_url: str, mode: str, script: Path = AGENT):
    env = {"PATH": os.environ["PATH"], "AI_SDK_DIR": str(AI_SDK), "BASE_URL": backend_url, "MODEL": "smol",
           "MODE": mode}
    r = subprocess.run(["node", str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout.splitlines()[-1])


@needs_ai_sdk
@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_the_ai_sdks_tool_loop_resumes_the_paused_generation(backend_url, mode):
    base = backend_url.removesuffix("/v1")
    before = resumes(base)
    first, answer = run_agent(backend_url, mode)
    assert first["finishReason"] == "tool-calls" and first["text"] == ""
    assert first["toolCalls"] == [{"name": "get_weather", "input": {"city": "Paris"}}]
    assert first["toolResults"] == [{"city": "Paris", "temperature": 21, "sky": "clear"}]
    assert answer["finishReason"] == "stop" and answer["text"] and not answer["toolCalls"]
    assert resumes(base) == before + 1
    # The answer's prompt holds the first step's whole context, read from the cache but its last token
    # (sampled, never fed back).
    assert_answer_resumed(first, answer)


def assert_answer_resumed(first: dict, answer: dict) -> None:
    cached = answer["usage"]["inputTokenDetails"]["cacheReadTokens"]
    assert cached == first["usage"]["totalTokens"] - 1, (answer["usage"], first["usage"])


@needs_ai_sdk
def test_the_openai_providers_responses_chat_sends_references_and_resumes(backend_url):
    base = backend_url.removesuffix("/v1")
    before = resumes(base)
    run = run_agent(backend_url, "generate", RESPONSES_CHAT)
    assert resumes(base) == before + 2  # each turn's answer after its tool
    for (first, answer), city in zip(run["turns"], ["Paris", "Rome"]):
        assert first["toolCalls"] == [{"name": "get_weather", "input": {"city": city}}]
        assert answer["finishReason"] == "stop" and answer["text"] and not answer["toolCalls"]
        assert_answer_resumed(first, answer)
    # The second turn sends the first turn's answer by reference (the provider stores responses by default).
    second_turn = [item.get("type", item.get("role")) for item in run["bodies"][2]["input"]]
    assert second_turn == ["user", "item_reference", "user"], second_turn
