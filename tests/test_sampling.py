"""Sampling, stopping and request lifecycle on the shared fp32 engine (SmolLM2-135M)."""
from __future__ import annotations

import pytest

from conftest import hf_last_logits
from infercept.engine import SamplingParams

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
N = 16


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


@pytest.fixture(scope="module")
def greedy_ref(llm_fp32):
    out = llm_fp32.generate(PROMPT, greedy(max_tokens=N, ignore_eos=True))[0]
    assert len(out.token_ids) == N
    return out


# -- seeds and random sampling ------------------------------------------------------------------------

def sampled(seed, temperature=1.0, **kw):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=N, ignore_eos=True, **kw)


def test_same_seed_same_tokens_across_calls_and_batches(llm_fp32, engine):
    a = llm_fp32.generate(PROMPT, sampled(1234))[0].token_ids
    b = llm_fp32.generate(PROMPT, sampled(1234))[0].token_ids
    # The same request inside a batch with other (differently seeded / greedy) requests.
    batch = llm_fp32.generate([PROMPT, "Tell me a story about a dragon.", PROMPT, PROMPT],
                              [sampled(7), sampled(99), sampled(1234), greedy(max_tokens=N, ignore_eos=True)])
    assert a == b == batch[2].token_ids
    assert len(a) == N


def test_different_seeds_differ(llm_fp32, engine, greedy_ref):
    outs = llm_fp32.generate([PROMPT] * 4, [sampled(s, temperature=1.5) for s in (1, 2, 3, 4)])
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs)) >= 3  # 16 tokens at temperature 1.5: collisions would mean seeds are ignored
    assert sum(s == tuple(greedy_ref.token_ids) for s in seqs) <= 1


def test_top_k_1_and_tiny_top_p_equal_greedy(llm_fp32, engine, greedy_ref):
    # 5e-324 underflows to 0 in fp32 and 1e-45 would overflow the logits: found by schemathesis as 500s.
    params = [sampled(5, top_k=1), sampled(6, top_p=1e-6), sampled(7, top_p=5e-324),
              sampled(8, temperature=1e-45)]
    outs = llm_fp32.generate([PROMPT] * len(params), params)
    for out in outs:
        assert out.token_ids == greedy_ref.token_ids


def test_top_k_restricts_to_the_k_most_likely(llm_fp32, engine, hf_model_fp32, tokenizer):
    """The first token of many top_k=3 samples is always one of HF's 3 most likely tokens."""
    ids = tokenizer.encode(PROMPT)
    top3 = set(hf_last_logits(hf_model_fp32, ids).topk(3).indices.tolist())
    outs = llm_fp32.generate([ids] * 12, [SamplingParams(temperature=2.0, top_k=3, seed=s, max_tokens=1)
                                          for s in range(12)])
    firsts = {o.token_ids[0] for o in outs}
    assert firsts <= top3
    assert len(firsts) >= 2  # temperature 2 over three candidates: not always the same token


# -- stopping ---------------------------------------------------------------------------------------------

def test_max_tokens_gives_length(llm_fp32, engine, greedy_ref):
    out = llm_fp32.generate(PROMPT, greedy(max_tokens=5, ignore_eos=True))[0]
    assert out.finished and out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == greedy_ref.token_ids[:5]


def stop_string_case(greedy_ref, tokenizer):
    """A stop string that starts inside the greedy text's 4th token and ends in a later one."""
    ids = greedy_ref.token_ids
    pieces = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    text = pieces[-1]
    start = len(pieces[3]) + 1 if len(pieces[4]) - len(pieces[3]) > 1 else len(pieces[3])
    stop = text[start:len(pieces[6]) + 1]
    assert len(stop) >= 2 and text.index(stop) == start, (text, stop)
    # tokens up to and including the one that completes the stop string
    n_tokens = next(i for i in range(len(ids) + 1) if len(pieces[i]) >= start + len(stop))
    return stop, text[:start], n_tokens


def test_stop_string_truncates_text(llm_fp32, engine, greedy_ref, tokenizer):
    stop, expected_text, n_tokens = stop_string_case(greedy_ref, tokenizer)
    out = llm_fp32.generate(PROMPT, greedy(max_tokens=N, stop=[stop, "never-generated-xyz"], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == expected_text
    assert stop not in out.text
    assert out.token_ids == greedy_ref.token_ids[:n_tokens]


def test_stop_string_given_as_str(llm_fp32, engine, greedy_ref, tokenizer):
    stop, expected_text, _ = stop_string_case(greedy_ref, tokenizer)
    params = greedy(max_tokens=N, stop=stop)
    assert params.stop == [stop]
    out = llm_fp32.generate(PROMPT, params)[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected_text, "stop", stop)


def test_stop_string_on_the_last_allowed_token_reports_stop(llm_fp32, engine, greedy_ref, tokenizer):
    """max_tokens ends the request on the very token that completes a stop string: the text is cut at
    the stop string, so the request stopped on it (finish_reason "stop", as in vLLM/OpenAI)."""
    stop, expected_text, n_tokens = stop_string_case(greedy_ref, tokenizer)
    out = llm_fp32.generate(PROMPT, greedy(max_tokens=n_tokens, stop=stop, ignore_eos=True))[0]
    assert out.text == expected_text
    assert out.token_ids == greedy_ref.token_ids[:n_tokens]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_streamed_text_never_shows_a_stop_string(llm_fp32, engine, greedy_ref, tokenizer):
    stop, expected_text, _ = stop_string_case(greedy_ref, tokenizer)
    rid = engine.add_request(PROMPT, greedy(max_tokens=N, stop=stop, ignore_eos=True))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            texts.append(out.text)
            assert stop not in out.text
    assert texts[-1] == expected_text
    assert all(expected_text.startswith(t) for t in texts)
    assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:]))


def test_stop_token_ids(llm_fp32, engine, greedy_ref):
    ids = greedy_ref.token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = llm_fp32.generate(PROMPT, greedy(max_tokens=N, stop_token_ids=[ids[k]], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert out.token_ids == ids[:k + 1]


def test_eos_stops_unless_ignored_and_min_tokens_suppresses_it(llm_fp32, engine, tokenizer, hf_model_fp32):
    eos = tokenizer.eos_token_id
    plain = llm_fp32.chat(CHAT, greedy(max_tokens=N))
    assert plain.finish_reason == "stop" and plain.stop_reason == eos
    assert plain.token_ids[-1] == eos and eos not in plain.token_ids[:-1]
    k = len(plain.token_ids) - 1  # eos is the greedy choice at output index k
    assert 1 <= k < 10

    ignored = llm_fp32.chat(CHAT, greedy(max_tokens=k + 3, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.token_ids[:k + 1] == plain.token_ids

    forced = llm_fp32.chat(CHAT, greedy(max_tokens=N, min_tokens=k + 4))
    assert len(forced.token_ids) >= k + 4
    assert eos not in forced.token_ids[:k + 4]
    assert forced.token_ids[:k] == plain.token_ids[:k]
    # At index k, eos was banned: the engine takes HF's best non-eos token.
    logits = hf_last_logits(hf_model_fp32, forced.prompt_token_ids + plain.token_ids[:k])
    logits[eos] = float("-inf")
    assert forced.token_ids[k] == int(logits.argmax())

    # min_tokens bans stop_token_ids too.
    t = plain.token_ids[0]
    out = llm_fp32.chat(CHAT, greedy(max_tokens=4, min_tokens=2, stop_token_ids=[t], ignore_eos=True))
    assert out.token_ids[0] != t


# -- logprobs ---------------------------------------------------------------------------------------------

def test_logprobs_match_transformers(llm_fp32, engine, tokenizer, hf_model_fp32):
    ids = tokenizer.encode(PROMPT)
    ref = hf_last_logits(hf_model_fp32, ids).log_softmax(-1)
    out = llm_fp32.generate(ids, greedy(max_tokens=3, logprobs=5, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(ref.argmax())
    assert abs(first.logprob - float(ref[first.token_id])) < 1e-3
    top = ref.topk(5)
    assert list(first.top_logprobs) == top.indices.tolist()
    for token_id, lp in first.top_logprobs.items():
        assert abs(lp - float(ref[token_id])) < 1e-3
    assert first.top_logprobs[first.token_id] == pytest.approx(first.logprob)
    assert all(lp.logprob <= 0 and lp.token_id == t for lp, t in zip(out.logprobs, out.token_ids))


def test_logprobs_of_sampled_tokens_and_k0(llm_fp32, engine, tokenizer, hf_model_fp32):
    ids = tokenizer.encode(PROMPT)
    ref = hf_last_logits(hf_model_fp32, ids).log_softmax(-1)
    out = llm_fp32.generate(ids, SamplingParams(temperature=1.0, seed=3, max_tokens=2, logprobs=0))[0]
    first = out.logprobs[0]
    assert first.top_logprobs is None or first.top_logprobs == {}
    # Logprobs are of the model's distribution (before temperature), for whatever token was drawn.
    assert abs(first.logprob - float(ref[out.token_ids[0]])) < 1e-3
    assert llm_fp32.generate(ids, greedy(max_tokens=2))[0].logprobs is None


# -- allowed token ids and bad words (vLLM's) ----------------------------------------------------------------

def hf_greedy_masked(hf_model, ids: list[int], n: int, forbid) -> list[int]:
    """Transformers' greedy continuation with `forbid(output so far)` (token ids) masked at each step."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_last_logits(hf_model, ids + out)
        logits[list(forbid(out))] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def test_allowed_token_ids_restrict_every_token_as_transformers_would(llm_fp32, engine, tokenizer, hf_model_fp32):
    ids = tokenizer.encode(PROMPT)
    # The second to sixth likeliest first tokens: the likeliest is not among them, so the output differs.
    allowed = hf_last_logits(hf_model_fp32, ids).topk(6).indices.tolist()[1:]
    out = llm_fp32.generate(ids, greedy(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed))[0]
    others = sorted(set(range(tokenizer.vocab_size)) - set(allowed))
    assert out.token_ids == hf_greedy_masked(hf_model_fp32, ids, 6, lambda _: others)
    assert set(out.token_ids) <= set(allowed)


def test_bad_words_are_never_written_as_transformers_would_avoid_them(llm_fp32, engine, tokenizer, hf_model_fp32):
    """A one-token word is never sampled, bare or after a space; a two-token word's second token is
    forbidden right after its first (vLLM's rule: the output so far, not the prompt)."""
    ids = tokenizer.encode(PROMPT)
    plain = llm_fp32.generate(ids, greedy(max_tokens=12, ignore_eos=True))[0]
    word = tokenizer.decode(plain.token_ids[:1]).strip()  # the answer's first word
    pair = ["answer", "is"]  # the plain answer goes on "The answer is"
    assert word and " answer is" in plain.text
    one = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    two = [tokenizer.encode(w, add_special_tokens=False) for w in ("answer is", " answer is")]
    assert all(len(t) == 1 for t in one) and all(len(t) == 2 for t in two)

    out = llm_fp32.generate(ids, greedy(max_tokens=12, ignore_eos=True, bad_words=[word]))[0]
    assert out.token_ids == hf_greedy_masked(hf_model_fp32, ids, 12, lambda _: [t[0] for t in one])
    assert word not in out.text
    out = llm_fp32.generate(ids, greedy(max_tokens=12, ignore_eos=True, bad_words=[" ".join(pair)]))[0]
    assert out.token_ids == hf_greedy_masked(hf_model_fp32, ids, 12,
                                             lambda out: [t[1] for t in two if out and out[-1] == t[0]])
    cut = plain.text.index(" answer is") + len(" answer")
    assert out.text[:cut] == plain.text[:cut] and " answer is" not in out.text


def test_bad_allowed_token_ids_and_bad_words_are_refused():
    for kw in ({"allowed_token_ids": []}, {"bad_words": [" "]}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# -- request lifecycle ------------------------------------------------------------------------------------

def test_abort_running_request_frees_its_blocks(llm_fp32, engine):
    bm = engine.block_manager
    total = bm.device.num_blocks
    long_prompt = "word " * 60  # > 32 tokens: two chunks
    keep = engine.add_request(PROMPT, greedy(max_tokens=6, ignore_eos=True))
    victim = engine.add_request(long_prompt, greedy(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
        bm.check_integrity()
    request = engine.scheduler.requests[victim]
    assert request.num_output_tokens >= 1 and len(bm.block_table(victim)) >= 4
    assert bm.num_free_blocks < total

    engine.abort(victim)
    bm.check_integrity()
    assert bm.block_table(victim) == []
    assert victim not in engine.scheduler.requests
    engine.abort(victim)  # twice is harmless

    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            if out.finished:
                finals[out.request_id] = out
    assert finals[keep].finish_reason == "length" and len(finals[keep].token_ids) == 6
    bm.check_integrity()
    assert bm.num_free_blocks == total


def test_abort_waiting_request(llm_fp32, engine):
    rid = engine.add_request(PROMPT, greedy(max_tokens=4))
    engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.device.num_blocks


def test_bad_prompts_are_rejected(llm_fp32, engine):
    vocab = engine.spec.vocab_size
    with pytest.raises(ValueError):
        engine.add_request([], greedy())
    with pytest.raises(ValueError):
        engine.add_request([1, vocab], greedy())
    with pytest.raises(ValueError):
        engine.add_request([1, -1], greedy())
    with pytest.raises(ValueError):
        engine.add_request([1] * engine.config.scheduler.max_model_len, greedy())
    rid = engine.add_request([1, 2], greedy(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError):
        engine.add_request([1, 2], greedy(max_tokens=1), request_id="dup")
    engine.abort(rid)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-1),
    dict(min_tokens=5, max_tokens=4), dict(min_tokens=-1), dict(logprobs=21), dict(logprobs=-1),
    dict(stop=[""]), dict(stop=""),
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_valid():
    p = SamplingParams()
    assert not p.greedy and p.max_tokens >= 1 and p.stop == []
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_p=1.0, top_k=0, min_tokens=3, max_tokens=3, logprobs=20)
