"""The engine's greedy output on SmolLM2-135M equals transformers' fp32 greedy output token for token.

The prompts are 5 to ~150 tokens long and generated in one batch with a 32-token step budget, so the
long prompts are prefilled in chunks (attending to their own earlier chunks through the paged cache)
in the same forward passes as the short prompts' decodes.
"""
from __future__ import annotations

import pytest

from conftest import hf_greedy
from infercept.engine import SamplingParams

NEW_TOKENS = 24

PROMPTS = [
    "The capital of France is",
    "Here is a short list of fruits that are commonly eaten for breakfast: apples, bananas,",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the "
    "green pigment chlorophyll and generates oxygen as a byproduct. In simple terms, photosynthesis",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "named Elias. Every morning he opened his shop at seven o'clock sharp, swept the wooden floor, and "
    "wound each of the hundred clocks that hung on his walls. The villagers said that his clocks were the "
    "most accurate in the whole country, and travelers came from distant cities to buy them. One winter "
    "evening, a young girl knocked on his door carrying a broken pocket watch that had belonged to her "
    "grandmother. The glass was cracked, the hands were bent, and the little golden case was dented on "
    "one side as if it had been dropped on a stone. Elias looked at the watch for a long time, and then "
    "he said",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [len(i) for i in ids]
    assert lengths[0] <= 8 and lengths[-1] >= 140, lengths
    return ids


@pytest.fixture(scope="module")
def hf_refs(hf_model_fp32, prompt_ids):
    return [hf_greedy(hf_model_fp32, ids, NEW_TOKENS) for ids in prompt_ids]


def record_steps(engine, monkeypatch) -> list:
    """Record every SchedulerOutput the engine runs."""
    steps = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks])
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    return steps


def test_batched_greedy_matches_transformers(llm_fp32, engine, prompt_ids, hf_refs, monkeypatch):
    steps = record_steps(engine, monkeypatch)
    outs = llm_fp32.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))

    budget = engine.config.scheduler.max_num_batched_tokens
    assert budget == 32
    assert all(sum(n for _, _, n, _ in step) <= budget for step in steps)
    # The premise of the test: some step mixed a continued prefill chunk (start_pos > 0, several
    # tokens) with single-token decodes of other requests.
    assert any(any(n > 1 and start > 0 for _, start, n, _ in step) and any(n == 1 for _, _, n, _ in step)
               for step in steps), steps

    for ids, out, ref in zip(prompt_ids, outs, hf_refs):
        assert out.prompt_token_ids == ids
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == ref, f"prompt of {len(ids)} tokens diverged"
        assert out.text == llm_fp32.tokenizer.decode(ref, skip_special_tokens=True)


def test_order_and_batch_composition_do_not_change_greedy_output(llm_fp32, engine, prompt_ids, hf_refs):
    """The same prompts in reverse order (different chunk boundaries and batch mixes) and alone."""
    outs = llm_fp32.generate(prompt_ids[::-1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                              ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_refs[::-1]
    alone = llm_fp32.generate(prompt_ids[2], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                            ignore_eos=True))
    assert alone[0].token_ids == hf_refs[2]


def test_string_prompts_are_tokenized_like_transformers(llm_fp32, engine, prompt_ids, hf_refs):
    outs = llm_fp32.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompt_ids[:2]
    assert [o.token_ids for o in outs] == hf_refs[:2]


@pytest.mark.parametrize("question", ["What is the capital of France?",
                                      "Write one sentence about the ocean."])
def test_chat_matches_transformers(llm_fp32, engine, tokenizer, hf_model_fp32, question):
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")

    out = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert out.prompt_token_ids == ids

    ref = hf_greedy(hf_model_fp32, ids, NEW_TOKENS)
    eos = tokenizer.eos_token_id
    if eos in ref:  # the engine stops at (and includes) the first end-of-sequence token
        ref = ref[:ref.index(eos) + 1]
        assert out.finish_reason == "stop" and out.stop_reason == eos
    else:
        assert out.finish_reason == "length"
    assert out.token_ids == ref
    assert out.text == tokenizer.decode(ref, skip_special_tokens=True)
