"""Prompt logprobs (vLLM's `prompt_logprobs`, and Completions' echo with logprobs, which evaluation
harnesses score a text with): each prompt token's logprob given the tokens before it, its rank and the
top k, against transformers in fp32, across prefill chunks, with the prompt's blocks already in the
prefix cache (it is computed whole all the same), and through the HTTP API."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from infercept.engine import SamplingParams

from live_server import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # 61 tokens: two of llm_fp32's 32-token chunks
K = 3


@pytest.fixture(scope="module")
def reference(tokenizer, hf_model_fp32):
    """The prompt's ids and transformers' fp32 log-softmax at each position."""
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        return ids, hf_model_fp32(torch.tensor([ids])).logits[0].log_softmax(-1)


def assert_scored_as_transformers(scored, ids, ref, k=K):
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        row, s = ref[i - 1], scored[i]
        assert s.token_id == ids[i]
        assert s.logprob == pytest.approx(float(row[ids[i]]), abs=1e-3)
        assert s.rank == int((row > row[ids[i]]).sum()) + 1
        if k:
            assert list(s.top_logprobs) == row.topk(k).indices.tolist()
            assert list(s.top_logprobs.values()) == pytest.approx(row.topk(k).values.tolist(), abs=1e-3)
        else:
            assert s.top_logprobs is None


def test_prompt_logprobs_equal_transformers_across_chunks_and_cached_blocks(llm_fp32, engine, reference):
    ids, ref = reference
    first = llm_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K))[0]
    assert_scored_as_transformers(first.prompt_logprobs, ids, ref)
    assert any(s.rank > 1 for s in first.prompt_logprobs[1:])  # (the ranks are not all trivially 1)
    # The prompt's blocks are cached now: a request that scores it computes it whole all the same, one
    # that does not reuses them.
    again = llm_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    assert_scored_as_transformers(again.prompt_logprobs, ids, ref, k=0)
    plain = llm_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.token_ids == first.token_ids == again.token_ids


def test_a_scored_prompt_may_reuse_only_the_blocks_whose_logprobs_it_has(llm_fp32, engine, reference):
    """A request preempted half-way through its prompt computes it again from the cache: only the part
    already scored may come from there."""
    ids, _ = reference
    llm_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=1))  # its blocks in the prefix cache
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    request = engine.scheduler.requests[rid]
    engine.step()  # the first 32-token chunk: logprobs of tokens 1..32 of 61
    assert len(request.prompt_logprobs) == 33 and request.needs_prompt_logprobs
    bs = engine.block_manager.block_size
    assert len(engine.scheduler._prefix_hit(request)) == 32 // bs  # of the (61 - 1) // bs cached
    engine.abort(rid)


def test_bad_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


# -- the HTTP API ------------------------------------------------------------------------------------

def test_completions_echo_with_logprobs_scores_the_prompt_then_the_output(srv, reference):
    """What lm-evaluation-harness sends to score a continuation (echo, logprobs 1, max_tokens 1), through
    the openai SDK: the prompt's tokens come first, the first with no logprob, then the generated one."""
    ids, ref = reference
    tokens = [srv.engine.tokenizer.decode([t]) for t in ids]
    out = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True,
                                          temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.tokens[:len(ids)] == tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                          abs=1e-3)
    greedy = [tokens[i] == max(top, key=top.get) for i, top in enumerate(lp.top_logprobs[1:len(ids)], 1)]
    assert greedy == [int(ref[i - 1].argmax()) == ids[i] for i in range(1, len(ids))]
    assert lp.text_offset[:3] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert lp.text_offset[len(ids)] == len(PROMPT)
    # vLLM's own field comes with it; the generated token is the one a plain request generates.
    assert len(choice.model_extra["prompt_logprobs"]) == len(ids)
    plain = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text


def test_completions_echo_with_logprobs_streams_the_scored_prompt_first(srv, reference):
    ids, ref = reference
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0,
            "stream": True}
    with httpx.stream("POST", srv.url + "/completions", json=body, timeout=60) as r:
        chunks = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    first = json.loads(chunks[0])["choices"][0]
    assert first["text"] == PROMPT and len(first["logprobs"]["tokens"]) == len(ids)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][-1] == pytest.approx(float(ref[-2, ids[-1]]), abs=1e-3)
    generated = [t for c in chunks[1:-1] for t in json.loads(c)["choices"][0]["logprobs"]["tokens"]]
    assert len(generated) == 2 and chunks[-1] == "[DONE]"


def test_chat_prompt_logprobs_are_vllms(srv, tokenizer, hf_model_fp32):
    """`prompt_logprobs` on a chat request: the rendered prompt's tokens, as vLLM returns them ({id:
    {logprob, rank, decoded_token}}, the prompt token first), beside an ordinary answer."""
    messages = [{"role": "user", "content": "Name a color."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ref = hf_model_fp32(torch.tensor([ids])).logits[0].log_softmax(-1)
    out = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                               extra_body={"prompt_logprobs": 2})
    scored = out.model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None and out.choices[0].message.content
    for i in (1, len(ids) // 2, len(ids) - 1):
        entries = scored[i]
        own = entries[str(ids[i])]
        assert list(entries)[0] == str(ids[i]) and own["decoded_token"] == tokenizer.decode([ids[i]])
        assert own["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-3)
        assert own["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        top = ref[i - 1].topk(2).indices.tolist()
        assert all(entries[str(t)]["rank"] == r for r, t in enumerate(top, 1))


def test_max_tokens_0_with_echo_scores_the_prompt_alone(srv, reference):
    """The classic way to score a text (OpenAI's GPT-3 API, vLLM): echo, logprobs, max_tokens 0. Nothing
    generated is shown or counted; without echo it is a 400."""
    ids, ref = reference
    client = srv.client()
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == srv.engine.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.model_extra["token_ids"] == []
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(float(ref[-2, ids[-1]]), abs=1e-3)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["text"] for c in chunks] == [choice.text, ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and not chunks[-1]["choices"][0]["logprobs"]["tokens"]
    r = httpx.post(srv.url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
