"""Tenants (server/tenants.py): every id-taking route answers another key's ids with 404, implicit resume
never crosses keys, per-key quotas release that key's oldest paused generation first, and keys are
compared in constant time. The real server over the scripted backend (tests/test_backend_boundary.py)."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import serve_in_thread
from scripted_backend import WEATHER, ScriptedBackend

from infercept.server import tenants
from infercept.server.app import build_app
from infercept.server.settings import ServerSettings, Tenant

ALICE, BOB = Tenant("alice", "key-alice", max_paused=2), Tenant("bob", "key-bob")
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def two(default_model_dir):
    backend = ScriptedBackend(default_model_dir)
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="fake",
                                                                             tenants=(ALICE, BOB))))

    def http(tenant: Tenant) -> httpx.Client:
        return httpx.Client(base_url=base + "/v1", timeout=30, headers={"Authorization": f"Bearer {tenant.key}"})

    def sdk(tenant: Tenant) -> openai.OpenAI:
        return openai.OpenAI(base_url=base + "/v1", api_key=tenant.key, max_retries=0, timeout=30)

    yield SimpleNamespace(backend=backend, base=base, alice=http(ALICE), bob=http(BOB), alice_sdk=sdk(ALICE),
                          bob_sdk=sdk(BOB))
    server.should_exit = True
    thread.join(timeout=10)


def paused_turn(client: openai.OpenAI, **extra) -> tuple[list[dict], str]:
    """A chat turn that ends in a call (paused), and the conversation that brings its result."""
    first = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], **extra)
    call = first.choices[0].message.tool_calls[0]
    return ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], first.id


def test_a_key_is_required_and_only_configured_keys_pass(two):
    r = httpx.get(two.base + "/v1/models", headers={"Authorization": "Bearer key-mallory"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert two.bob.get("/models").status_code == 200


def test_the_tokenizer_routes_take_the_key_as_v1_does(two):
    """vLLM leaves /tokenize open; here it renders the key's conversations, paused turns included."""
    for path, body in (("/tokenize", {"messages": ASK}), ("/detokenize", {"tokens": [1, 2]})):
        for headers in ({}, {"Authorization": "Bearer key-mallory"}):
            r = httpx.post(two.base + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = httpx.post(two.base + path, json=body, headers={"Authorization": f"Bearer {BOB.key}"})
        assert r.status_code == 200, (path, r.text)


def test_sessions_of_another_key_are_404(two):
    created = two.alice.post("/sessions", json={"system": "Be brief."}).json()
    url = f"/sessions/{created['id']}"
    for request in (lambda c: c.get(url), lambda c: c.delete(url),
                    lambda c: c.post(url + "/messages", json={"content": "Hi"})):
        r = request(two.bob)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert two.alice.get(url).status_code == 200  # untouched by bob's tries


def test_stored_responses_of_another_key_are_404(two):
    made = two.alice.post("/responses", json={"model": "fake", "input": "Hi"}).json()
    assert two.bob.get(f"/responses/{made['id']}").status_code == 404
    assert two.bob.delete(f"/responses/{made['id']}").status_code == 404
    chained = two.bob.post("/responses", json={"model": "fake", "input": "And?", "previous_response_id": made["id"]})
    assert chained.status_code == 404 and chained.json()["error"]["code"] == "previous_response_not_found"
    assert two.alice.get(f"/responses/{made['id']}").status_code == 200


def test_implicit_resume_never_crosses_keys(two):
    backend = two.backend
    conversation, _ = paused_turn(two.alice_sdk)
    alices = backend.calls[-1][1]
    # Bob repeats alice's conversation, her call id included: served fresh, her pause stays hers.
    two.bob_sdk.chat.completions.create(model="fake", messages=conversation, tools=[WEATHER])
    assert ("resume", alices) not in backend.calls and alices in backend.paused
    answer = two.alice_sdk.chat.completions.create(model="fake", messages=conversation, tools=[WEATHER])
    assert backend.calls[-1] == ("resume", alices) and answer.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_session_ids_are_per_key(two):
    conversation, _ = paused_turn(two.alice_sdk, extra_body={"session_id": "shared-name"})
    results_only = {"model": "fake", "messages": conversation[-1:], "tools": [WEATHER], "session_id": "shared-name"}
    r = two.bob.post("/chat/completions", json=results_only)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert two.alice.post("/chat/completions", json=results_only).status_code == 200


def test_token_resume_never_crosses_keys(two):
    backend = two.backend
    first = two.alice.post("/completions", json={"model": "fake", "prompt": "weather?", "return_token_ids": True,
                                                 "intercept": {"kind": "tool"}}).json()["choices"][0]
    alices = backend.calls[-1][1]
    longer = first["prompt_token_ids"] + first["token_ids"] + [13]
    two.bob.post("/completions", json={"model": "fake", "prompt": longer, "max_tokens": 4})
    assert ("resume", alices) not in backend.calls
    two.alice.post("/completions", json={"model": "fake", "prompt": longer, "max_tokens": 4})
    assert backend.calls[-1] == ("resume", alices)


def test_a_quota_releases_the_keys_own_oldest_paused_generation_first(default_model_dir):
    backend = ScriptedBackend(default_model_dir)
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="fake",
                                                                             tenants=(ALICE, BOB))))
    try:
        alice, bob = (openai.OpenAI(base_url=base + "/v1", api_key=t.key, max_retries=0, timeout=30)
                      for t in (ALICE, BOB))
        _, bobs = paused_turn(bob)
        alices = [paused_turn(alice)[1] for _ in range(3)]  # alice may keep 2
        assert ("abort", alices[0]) in backend.calls  # her oldest went ...
        assert sorted(backend.paused) == sorted([bobs, *alices[1:]])  # ... never bob's, though his is older
        assert 'infercept_paused_evictions_total{cause="quota",model="fake"} 1.0' in httpx.get(base + "/metrics").text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_each_keys_prompts_are_cached_apart_unless_the_operator_shares_the_cache(default_model_dir):
    """The real engine: a prompt alice sent is in the prefix cache for her next request, never for bob's
    (cached_tokens would tell him what she sent); a request's `cache_salt` (vLLM's) splits her own cache
    further. With --shared-prefix-cache the keys share it."""
    from live_server import MODEL, LiveServer

    ask = [{"role": "user", "content": "List three rivers of France and one city on each of them, briefly."}]
    for shared in (False, True):
        live = LiveServer(default_model_dir, "preserve", tenants=(ALICE, BOB), shared_prefix_cache=shared)
        try:
            def cached(tenant: Tenant, **extra) -> int:
                client = openai.OpenAI(base_url=live.url, api_key=tenant.key, max_retries=0, timeout=60)
                out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, temperature=0,
                                                     extra_body=extra)
                return out.usage.prompt_tokens_details.cached_tokens

            assert cached(ALICE) == 0
            again = cached(ALICE)
            assert again > 16
            assert cached(BOB) == (again if shared else 0)
            assert cached(ALICE, cache_salt="project-x") == 0 and cached(ALICE, cache_salt="project-x") == again
        finally:
            live.close()


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    compared = []
    real = tenants.hmac.compare_digest

    def counting(a, b):
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(tenants.hmac, "compare_digest", counting)
    auth = tenants.Authenticator((ALICE, BOB))
    assert auth.tenant_for("Bearer key-alice") is ALICE
    assert compared == [b"key-alice", b"key-bob"]  # no early exit on the first match
    assert auth.tenant_for("Bearer key-al") is None and auth.tenant_for("key-alice") is None


def test_the_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key name quotas\nk1 team-a max_paused=4 max_paused_tokens=9000\n\nk2\n")
    assert tenants.load_keys_file(path) == (Tenant("team-a", "k1", 4, 9000), Tenant("line-4", "k2"))
    path.write_text("k1 team-a max_paused=lots\n")
    with pytest.raises(ValueError, match=r"keys:1: 'max_paused=lots'"):
        tenants.load_keys_file(path)
    with pytest.raises(ValueError, match="unique"):
        ServerSettings(api_key="k1", tenants=(Tenant("other", "k1"),))



def test_anthropic_clients_authenticate_with_their_sdk_or_an_x_api_key_header(two):
    """Anthropic's SDK sends its key as a bearer token (2.x) or as `x-api-key` (earlier clients, Claude
    Code): both pass; a wrong or missing key is Anthropic's 401 on its API's paths."""
    import anthropic

    ask = dict(model="fake", messages=ASK)
    url = two.base + "/v1/messages/count_tokens"
    assert anthropic.Anthropic(base_url=two.base, api_key=ALICE.key, max_retries=0).messages.count_tokens(**ask)
    assert httpx.post(url, json=ask, headers={"x-api-key": ALICE.key}).json()["input_tokens"] > 0
    for headers in ({"x-api-key": "key-mallory"}, {}):
        r = httpx.post(url, json=ask, headers=headers)
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=two.base, api_key="key-mallory", max_retries=0).messages.count_tokens(**ask)
