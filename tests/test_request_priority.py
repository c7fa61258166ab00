"""vLLM's request `priority` (lower first) on Chat Completions, Completions and Responses: it reaches the
engine's SamplingParams, which the native scheduler orders its queues by (tests/test_policy_parts.py
checks that order and the preemption it implies); the vLLM backend runs vLLM's queues in arrival order,
so there it is accepted and has no effect, as in vLLM under its default scheduling policy."""
from __future__ import annotations

import httpx
import pytest

from infercept.server.protocol import ChatCompletionRequest
from infercept.server.turn_types import Sampling, TurnSpec
from live_server import MODEL

QUESTION = [{"role": "user", "content": "Hi"}]


def test_a_requests_priority_reaches_the_engines_params(srv):
    req = ChatCompletionRequest(model=MODEL, messages=QUESTION, priority=-3)
    params = srv.app.state.turns.sampling_params(TurnSpec("chat", Sampling.of(req, 4)), 10)
    assert params.priority == -3
    assert srv.app.state.turns.sampling_params(TurnSpec("chat", Sampling()), 10).priority == 0


@pytest.mark.parametrize("backend", ["native", "vllm"])
def test_priority_on_every_endpoint_of_each_backend(request, backend):
    url = request.getfixturevalue("agent_server_url" if backend == "native" else "vllm_agent_server_url")
    bodies = {"/chat/completions": {"messages": QUESTION, "max_tokens": 2},
              "/completions": {"prompt": "Hi", "max_tokens": 2},
              "/responses": {"input": "Hi", "max_output_tokens": 2}}
    with httpx.Client(base_url=url, timeout=120) as http:
        for path, body in bodies.items():
            for priority in (0, -1, 7):
                r = http.post(path, json={"model": MODEL, "temperature": 0, "priority": priority, **body})
                assert r.status_code == 200, (path, priority, r.text)
            r = http.post(path, json={"model": MODEL, "priority": "high", **body})
            assert r.status_code == 400 and "priority" in r.json()["error"]["param"], r.text
