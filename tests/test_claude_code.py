"""Claude Code, the agent (`make test` installs it from npm; pinned in the Makefile), against the live
server with the embedded model: it answers through the Messages API, and its tool loop runs on one
paused generation. Claude Code sends no temperature; this server's operator default is greedy
(`--override-generation-config '{"temperature": 0}'`), so the model's choices are reproducible. Claude
Code asks for max_tokens 32,000 on every request (more than the model's context: clamped)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from live_server import MODEL, LiveServer

CLAUDE = Path(__file__).resolve().parents[1] / ".claude-code" / "node_modules" / ".bin" / "claude"
pytestmark = pytest.mark.skipif(not CLAUDE.exists(), reason="needs Claude Code (make claude-code: npm)")


@pytest.fixture(scope="module")
def greedy_server(default_model_dir):
    live = LiveServer(default_model_dir, "infercept", override_generation_config={"temperature": 0})
    yield live
    live.close()


def claude(server: LiveServer, workdir: Path, prompt: str, *flags: str) -> list[dict]:
    """Claude Code in print mode (`-p`), its events as JSON lines; only the server is reachable to it."""
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir / "home"), "ANTHROPIC_BASE_URL": server.base,
           "ANTHROPIC_API_KEY": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1"}
    r = subprocess.run([str(CLAUDE), "-p", prompt, "--bare", "--model", MODEL, "--output-format", "stream-json",
                        "--verbose", "--no-session-persistence", *flags],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=180)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert events and events[-1]["type"] == "result", (r.returncode, r.stdout[-2000:], r.stderr)
    # Status 1 only where --max-turns ended the loop, as asked.
    assert r.returncode == (1 if events[-1]["subtype"] == "error_max_turns" else 0), (r.returncode, events[-1], r.stderr)
    return events


def resumes(server: LiveServer) -> float:
    text = httpx.get(server.base + "/metrics").text
    return sum(float(v) for v in re.findall(r'^infercept_resumes_total\{[^}]*how="implicit"[^}]*\} (\S+)', text, re.M))


def test_claude_code_answers_through_the_messages_api(greedy_server, tmp_path):
    events = claude(greedy_server, tmp_path, "What is the capital of France?",
                    "--system-prompt", "You are a helpful assistant.", "--tools", "")
    result = events[-1]
    assert not result["is_error"] and result["num_turns"] == 1 and result["stop_reason"] == "end_turn", result
    assert "Paris" in result["result"] and result["usage"]["output_tokens"] > 0
    greedy_server.assert_no_leak()


def test_claude_codes_tool_loop_runs_on_one_paused_generation(greedy_server, tmp_path):
    """The model calls Claude Code's Read tool; Claude Code reads the file and sends the result back with
    the whole conversation; the server resumes the paused generation (the first request's prompt and
    call read from the cache) and the model goes on. Two turns (`--max-turns 2`)."""
    (tmp_path / "weather.txt").write_text("Sunny, 24 C\n")
    before = resumes(greedy_server)
    events = claude(greedy_server, tmp_path, "Call the Read tool with file_path weather.txt.",
                    "--system-prompt", "You are a helpful assistant with tools.", "--tools", "Read",
                    "--allowedTools", "Read", "--max-turns", "2")
    assert events[-1]["subtype"] == "error_max_turns", events[-1]
    answers = [e["message"] for e in events if e["type"] == "assistant"]
    results = [b for e in events if e["type"] == "user" for b in e["message"]["content"] if b["type"] == "tool_result"]
    assert len(answers) == 2, answers
    (use,) = [b for b in answers[0]["content"] if b["type"] == "tool_use"]
    assert use["name"] == "Read" and use["input"]["file_path"] == "weather.txt", use  # read in its folder
    assert results[0]["tool_use_id"] == use["id"] and "Sunny, 24 C" in str(results[0]["content"]), results
    assert resumes(greedy_server) == before + 1
    first = answers[0]["usage"]  # at message_start: the whole prompt as input, none cached yet
    # Over both requests: at least the first request's prompt was read from the cache (the resume reads
    # the paused context: that prompt and the call).
    assert events[-1]["usage"]["cache_read_input_tokens"] >= first["input_tokens"] > 300, events[-1]["usage"]
    greedy_server.abort_paused()  # the second turn's call is still paused: --max-turns ended the loop
    greedy_server.assert_no_leak()
