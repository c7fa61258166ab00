"""Sampling defaults for the fields a request leaves out: the model's generation_config.json (as its authors
recommend), neutral with --generation-config none, and --override-generation-config over either, read as
vLLM reads them; over HTTP the backend receives them, and a request's own values win."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from live_server import serve_in_thread
from scripted_backend import ScriptedBackend

from infercept.server.app import build_app
from infercept.server.generation_defaults import sampling_defaults
from infercept.server.settings import ServerSettings

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


@pytest.fixture
def qwen3_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    return str(tmp_path)


def test_the_models_own_defaults_none_and_overrides(qwen3_config, tmp_path_factory):
    assert sampling_defaults(qwen3_config) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults(qwen3_config, "none") == {}
    assert sampling_defaults(qwen3_config, "none", {"temperature": 0}) == {"temperature": 0}
    assert sampling_defaults(qwen3_config, overrides={"top_k": -1, "max_new_tokens": 512}) == {
        "temperature": 0.6, "top_k": -1, "top_p": 0.95, "max_tokens": 512}
    other = tmp_path_factory.mktemp("other")
    # transformers' own defaults, written out by a tool that saves every field, are no one's choice.
    (other / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 50, "top_p": 0.8,
                                                              "repetition_penalty": 1.05}))
    assert sampling_defaults(qwen3_config, str(other)) == {"top_p": 0.8, "repetition_penalty": 1.05}
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        sampling_defaults(qwen3_config, str(other))


@pytest.mark.parametrize("flags, message", [
    (["--override-generation-config", '{"temp": 0}'], "'temp' is not one of temperature"),
    (["--override-generation-config", "0.5"], "expected a JSON object"),
    (["--override-generation-config", '{"temperature": "hot"}'], "temperature must be a number, not 'hot'"),
    (["--override-generation-config", '{"top_p": 1.5}'], "top_p must be in (0, 1]"),
    (["--generation-config", "/nonexistent"], "expected auto, none or a folder holding generation_config.json"),
])
def test_bad_settings_stop_serve_before_the_model_loads(flags, message):
    r = subprocess.run([sys.executable, "-m", "infercept.server.cli", "serve", *flags], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_backend_gets_the_defaults_where_the_request_leaves_fields_out(default_model_dir, qwen3_config):
    backend = ScriptedBackend(default_model_dir)
    settings = ServerSettings(served_model_name="fake", generation_config=qwen3_config,
                              override_generation_config={"top_k": 5, "max_new_tokens": 7})
    server, thread, base = serve_in_thread(build_app(backend, settings))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        hi = [{"role": "user", "content": "Hi"}]
        client.chat.completions.create(model="fake", messages=hi)
        client.chat.completions.create(model="fake", messages=hi, temperature=0.2, max_tokens=3)
        client.completions.create(model="fake", prompt="Hi", top_p=0.5)
        leave_out, give, completion = backend.params
        assert (leave_out.temperature, leave_out.top_p, leave_out.top_k, leave_out.max_tokens) == (0.6, 0.95, 5, 7)
        assert (give.temperature, give.top_p, give.top_k, give.max_tokens) == (0.2, 0.95, 5, 3)
        assert (completion.temperature, completion.top_p, completion.top_k) == (0.6, 0.5, 5)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
