"""Instructor, unmodified, against the live server with the embedded model (in .venv-frameworks:
tests/frameworks_env.py). `Mode.TOOLS` forces a call of the response model's tool; when the answer fails
validation, Instructor sends the call back with the error as its `tool` result, and that retry resumes the
paused generation (its whole paused context read from the paused KV). `Mode.JSON_SCHEMA` goes out as a
`json_schema` response format and ends without pausing."""
from __future__ import annotations

from frameworks_env import needs_frameworks_env, run_script
from live_server import resumes

pytestmark = needs_frameworks_env


def test_a_retry_after_a_failed_validation_resumes_the_paused_generation(agent_server_url):
    before = resumes(agent_server_url)
    run = run_script("instructor_steps.py", agent_server_url, "smol")
    assert resumes(agent_server_url) == before + 1  # the retry, and only it

    tools = run["tools"]
    assert tools["city"] == "Paris" and len(tools["attempts"]) == 2, tools  # refused once, then accepted
    first, retry = tools["usages"]
    cached, prompt = retry["prompt_tokens_details"]["cached_tokens"], retry["prompt_tokens"]
    print(f"retry: {cached}/{prompt} prompt tokens cached")
    # The whole paused context was reused but its last token (sampled, never fed back).
    assert cached == first["total_tokens"] - 1, (first, retry)

    assert run["json_schema"] == {"city": "Paris", "finish_reason": "stop"}
