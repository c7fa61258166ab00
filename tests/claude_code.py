"""Claude Code, the agent, run against a live server in print mode (tests/test_claude_code.py and the vLLM
backend's tests): installed by `make claude-code` (npm; pinned in the Makefile), skipped without it."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

CLAUDE = Path(__file__).resolve().parents[1] / ".claude-code" / "node_modules" / ".bin" / "claude"
needs_claude_code = pytest.mark.skipif(not CLAUDE.exists(), reason="needs Claude Code (make claude-code: npm)")
READ_PROMPT = "Call the Read tool with file_path weather.txt."  # the embedded model calls Read on it, greedy
READ_SYSTEM = "You are a helpful assistant with tools."


def claude(base: str, model: str, workdir: Path, prompt: str, *flags: str) -> list[dict]:
    """Claude Code in print mode (`-p`) in `workdir`, its events as JSON lines; only the server at `base`
    is reachable to it (no telemetry, no updates, a HOME of its own)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir / "home"), "ANTHROPIC_BASE_URL": base,
           "ANTHROPIC_API_KEY": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1"}
    r = subprocess.run([str(CLAUDE), "-p", prompt, "--bare", "--model", model, "--output-format", "stream-json",
                        "--verbose", "--no-session-persistence", *flags],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=180)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert events and events[-1]["type"] == "result", (r.returncode, r.stdout[-2000:], r.stderr)
    # Status 1 only where --max-turns ended the loop, as asked.
    assert r.returncode == (1 if events[-1]["subtype"] == "error_max_turns" else 0), (r.returncode, events[-1], r.stderr)
    return events


def check_read_tool_loop(base: str, model: str, workdir: Path) -> None:
    """Two turns of Claude Code's tool loop (`--max-turns 2`): the model calls Read on weather.txt; Claude
    Code reads the file and sends the result back with the whole conversation; the server resumes the
    paused generation (the first request's prompt and call read from the cache) and the model goes on."""
    # (imported here: the GPU tests import this module on hosts without the server's dependencies)
    from live_server import resumes

    (workdir / "weather.txt").write_text("Sunny, 24 C\n")
    before = resumes(base)
    events = claude(base, model, workdir, READ_PROMPT, "--system-prompt", READ_SYSTEM, "--tools", "Read",
                    "--allowedTools", "Read", "--max-turns", "2")
    assert events[-1]["subtype"] == "error_max_turns", events[-1]
    answers = [e["message"] for e in events if e["type"] == "assistant"]
    results = [b for e in events if e["type"] == "user" for b in e["message"]["content"] if b["type"] == "tool_result"]
    assert len(answers) == 2, answers
    (use,) = [b for b in answers[0]["content"] if b["type"] == "tool_use"]
    assert use["name"] == "Read" and use["input"]["file_path"] == "weather.txt", use  # read in its folder
    assert results[0]["tool_use_id"] == use["id"] and "Sunny, 24 C" in str(results[0]["content"]), results
    assert resumes(base) == before + 1
    first = answers[0]["usage"]  # at message_start: the whole prompt as input, none cached yet
    # Over both requests: at least the first request's prompt was read from the cache (the resume reads
    # the paused context: that prompt and the call).
    assert events[-1]["usage"]["cache_read_input_tokens"] >= first["input_tokens"] > 300, events[-1]["usage"]
