"""Claude Code, the agent (`make test` installs it from npm; pinned in the Makefile), against the live
server with the embedded model: it answers through the Messages API, and its tool loop runs on one
paused generation (tests/claude_code.py; the vLLM backend's run is in test_vllm_backend.py). Claude Code
sends no temperature; this server's operator default is greedy (`--override-generation-config
'{"temperature": 0}'`), so the model's choices are reproducible. Claude Code asks for max_tokens 32,000
on every request (more than the model's context: clamped)."""
from __future__ import annotations

import pytest
from claude_code import check_read_tool_loop, claude, needs_claude_code
from live_server import MODEL, LiveServer

pytestmark = needs_claude_code


@pytest.fixture(scope="module")
def greedy_server(default_model_dir):
    live = LiveServer(default_model_dir, "infercept", override_generation_config={"temperature": 0})
    yield live
    live.close()


def test_claude_code_answers_through_the_messages_api(greedy_server, tmp_path):
    events = claude(greedy_server.base, MODEL, tmp_path, "What is the capital of France?",
                    "--system-prompt", "You are a helpful assistant.", "--tools", "")
    result = events[-1]
    assert not result["is_error"] and result["num_turns"] == 1 and result["stop_reason"] == "end_turn", result
    assert "Paris" in result["result"] and result["usage"]["output_tokens"] > 0
    greedy_server.assert_no_leak()


def test_claude_codes_tool_loop_runs_on_one_paused_generation(greedy_server, tmp_path):
    check_read_tool_loop(greedy_server.base, MODEL, tmp_path)
    greedy_server.abort_paused()  # the second turn's call is still paused: --max-turns ended the loop
    greedy_server.assert_no_leak()
