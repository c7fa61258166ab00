"""What an operator sets at `infercept serve`, over HTTP against a scripted backend (no model runs):

- sampling defaults for the fields a request leaves out: the model's generation_config.json (as its
  authors recommend), neutral with --generation-config none, --override-generation-config over either,
  read as vLLM reads them; the backend receives them, and a request's own values win;
- --served-model-name with several names: each answers and is listed (an agent asking for a Claude model);
- --chat-template: the prompt is rendered with it instead of the model's own.
Bad values stop `infercept serve` before the model loads, with the reason."""
from __future__ import annotations

import json

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
    with pytest.raises(ValueError, match=r"generation_config.json \(--generation-config none leaves it unread\): top_p"):
        sampling_defaults(qwen3_config, str(other))


@pytest.mark.parametrize("flags, message", [
    (["--override-generation-config", '{"temp": 0}'], "'temp' is not one of temperature"),
    (["--override-generation-config", "0.5"], "expected a JSON object"),
    (["--override-generation-config", '{"temperature": "hot"}'], "temperature must be a number, not 'hot'"),
    (["--override-generation-config", '{"top_p": 1.5}'], "top_p must be in (0, 1]"),
    (["--generation-config", "/nonexistent"], "expected auto, none or a folder holding generation_config.json"),
    (["--chat-template", "chat.jinja"], "no such file, and not a Jinja template"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"], "--chat-template: line 1: unexpected '}'"),
    (["--kv-cache-fraction", "0"], "argument --kv-cache-fraction: 0: a share of free memory, over 0 and at most 1"),
    (["--kv-cache-fraction", "1.5"], "argument --kv-cache-fraction: 1.5: a share of free memory"),
])
def test_bad_settings_stop_serve_before_the_model_loads(flags, message, capsys):
    from infercept.server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model", "/no/model/here", *flags])  # the model is never reached
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "/no/model/here" not in err, err


def test_a_vllm_serve_command_line_runs_unchanged():
    """`vllm serve MODEL --enable-auto-tool-choice --tool-call-parser hermes` as it is: the model by position,
    vLLM's name of --tool-parser, and its switches for what is always on here (auto tool choice, chunked
    prefill) or on by default (prefix caching) accepted."""
    from infercept.server import cli

    args = cli.build_parser().parse_args(["serve", "Qwen/Qwen3-8B", "--enable-auto-tool-choice",
                                          "--tool-call-parser", "hermes", "--max-model-len", "8192",
                                          "--enable-prefix-caching", "--enable-chunked-prefill"])
    cli.model_from_tag(args)
    assert (args.model, args.tool_parser, args.max_model_len) == ("Qwen/Qwen3-8B", "hermes", 8192)
    assert args.prefix_caching and cli.engine_kwargs(args)["enable_prefix_caching"]
    assert cli.build_parser().parse_args(["serve"]).prefix_caching
    assert not cli.build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).prefix_caching
    assert cli.server_settings(args).tool_parser == "hermes"
    same = cli.build_parser().parse_args(["serve", "org/m", "--model", "org/m"])
    cli.model_from_tag(same)
    assert same.model == "org/m"


def test_two_models_on_one_command_line_are_refused(capsys):
    from infercept.server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "/no/model/a", "--model", "/no/model/b"])
    assert exited.value.code == 2 and "two models given: '/no/model/a' and --model" in capsys.readouterr().err


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


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}: {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>ASSISTANT:{% endif %}")


def test_more_served_names_and_a_chat_template_of_the_operators(default_model_dir, tmp_path):
    import anthropic
    import httpx

    from infercept.server import cli

    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    args = cli.build_parser().parse_args(["serve", "--served-model-name", "fake", "claude-haiku-4-5",
                                          "--chat-template", str(tmp_path / "chat.jinja")])
    backend = ScriptedBackend(default_model_dir)
    server, thread, base = serve_in_thread(build_app(backend, cli.server_settings(args)))
    try:
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["fake", "claude-haiku-4-5"]
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=30)
        assert claude.models.retrieve("claude-haiku-4-5").id == "claude-haiku-4-5"
        answer = claude.messages.create(model="claude-haiku-4-5", max_tokens=8,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert answer.content[0].text == "Hello there."
        rendered = httpx.post(base + "/v1/chat/completions/render", json={
            "model": "fake", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        assert backend.tokenizer.decode(rendered.json()["token_ids"]) == ("<|im_start|>SYSTEM: Be brief.<|im_end|>\n"
                                                 "<|im_start|>USER: Hi<|im_end|>\n<|im_start|>ASSISTANT:"), rendered.text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_without_a_pool_size_the_engine_takes_its_devices_share_of_free_memory(default_model_dir, monkeypatch):
    """A quarter of a CPU's available memory (the machine's, shared with everything on it), 0.8 of a GPU's
    free memory after the weights (tests/test_gpu.py measures it on one); --kv-cache-fraction overrides."""
    import importlib

    import torch

    from infercept.engine import Engine
    from infercept.engine.config import kv_cache_fraction_or_default
    from infercept.engine.kv_cache import KVCache

    assert kv_cache_fraction_or_default(None, "cpu") == 0.25 and kv_cache_fraction_or_default(None, "cuda") == 0.8
    assert kv_cache_fraction_or_default(0.1, "cuda") == 0.1
    monkeypatch.setattr(importlib.import_module("infercept.engine.engine"), "available_memory_bytes",
                        lambda device: 2**30)
    for fraction, share in ((None, 0.25), (0.1, 0.1)):
        engine = Engine(default_model_dir, dtype="float32", device="cpu", kv_cache_fraction=fraction, host_kv_gb=0.01,
                        progress=False)
        assert engine.kv_cache.num_blocks == int(share * 2**30) // KVCache.block_bytes(engine.spec, torch.float32, 16)
