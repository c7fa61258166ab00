"""LlamaIndex, unmodified, against the live server with the embedded model (in .venv-frameworks:
tests/frameworks_env.py): a `FunctionAgent` with one function tool on `OpenAILike` (what a LlamaIndex user
points at a vLLM server). It sends the call back as `tool_calls` with a `tool` message and the same tools,
so its next step resumes the paused generation, its whole context read from the paused KV."""
from __future__ import annotations

from frameworks_env import needs_frameworks_env, run_script
from live_server import resumes

pytestmark = needs_frameworks_env


def test_the_agents_next_step_resumes_the_paused_generation(agent_server_url):
    before = resumes(agent_server_url)
    run = run_script("llamaindex_agent.py", agent_server_url, "smol")
    assert resumes(agent_server_url) == before + 1  # the step after the call (the early stop's answer is no resume)

    assert run["cities"] == ["Paris"] and run["tool_results"] == ["get_weather"] and run["answer"], run
    first, resumed = run["usages"][:2]
    cached, prompt = resumed["prompt_tokens_details"]["cached_tokens"], resumed["prompt_tokens"]
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    # The whole paused context was reused but its last token (sampled, never fed back).
    assert cached == first["total_tokens"] - 1, run["usages"]
