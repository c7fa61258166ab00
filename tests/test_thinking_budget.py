"""Thinking budgets (`thinking_token_budget`, engine/thinking_budget.py): once a turn has thought that many
tokens, the end-of-thinking marker is forced and the model answers from there.

On the embedded model, whose tokenizer writes <think> and </think> as three tokens each (the markers
spanning several tokens, as on a model without them in its vocabulary): a prompt that opens the thinking
gets exactly the budget's tokens of it, the same tokens an unbudgeted run starts with, then the end
marker; what follows equals a fresh run of the context with that thinking closed, with the engine
scheduling synchronously and asynchronously (where the forcing waits for the step before's token).
The server's side (a thinking model's chat, completions and Anthropic turns) is in test_reasoning.py,
the vLLM backend's in test_vllm_backend.py.
"""
from __future__ import annotations

import httpx
import pytest
import torch

from infercept.engine import LLM, SamplingParams
from infercept.engine.outputs import ScheduledChunk
from infercept.engine.sampler import AllowedTokens
from infercept.engine.thinking_budget import ThinkingBudgets, last_index

from live_server import MODEL
from test_async_output import MODES

# -- the state, on token ids ------------------------------------------------------------------------

START, END = [7, 8], [9]  # a two-token <think>, a one-token </think>


def chunk(request_id: str, budget: int | None, num_output: int = 0, context: list[int] | None = None) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 0, [], True, SamplingParams(thinking_token_budget=budget), num_output,
                          context)


def forced(budgets: ThinkingBudgets, c: ScheduledChunk, vocab: int = 16) -> int | None:
    allowed = budgets.forced_tokens([c], vocab)
    if allowed is None:
        return None
    assert allowed.rows == [0] and int(allowed.mask[0].sum()) == 1
    return int(allowed.mask[0].nonzero()[0, 0])


def test_last_index_finds_the_last_whole_marker():
    assert last_index([7, 8, 1, 7, 2, 7, 8, 3], [7, 8]) == 5
    assert last_index([1, 7], [7, 8]) == -1 and last_index([], [7]) == -1 and last_index([7], [7]) == 0


def test_a_turn_counts_its_thinking_and_is_forced_to_end_it():
    budgets = ThinkingBudgets(START, END)
    # The prompt opened the thinking and thought one token already: a budget of 3 leaves two.
    first = chunk("r", 3, 0, [1, 2, *START, 5])
    assert forced(budgets, first) is None and not budgets.may_force(first)  # 2 thought of 3: not yet
    budgets.take("r", 4)
    assert budgets.may_force(chunk("r", 3, 1))  # the token on its way may be the third
    assert forced(budgets, chunk("r", 3, 1)) is None
    budgets.take("r", 4)
    assert budgets.turns["r"].count == 3 and forced(budgets, chunk("r", 3, 2)) == END[0]
    budgets.take("r", END[0])
    assert not budgets.turns["r"].thinking and forced(budgets, chunk("r", 3, 3)) is None
    # A new <think> (two tokens) opens a new section with a new budget.
    for t in (*START, 4, 4, 4):
        budgets.take("r", t)
    assert budgets.turns["r"].thinking and forced(budgets, chunk("r", 3, 8)) == END[0]


def test_a_closed_thinking_in_the_prompt_or_a_natural_end_forces_nothing():
    budgets = ThinkingBudgets(START, END)
    assert forced(budgets, chunk("closed", 0, 0, [*START, 4, *END])) is None  # the prompt closed it
    assert not budgets.may_force(chunk("closed", 1, 0, [*START, 4, *END]))
    budgets.take("ended", 0)
    assert forced(budgets, chunk("ended", 5, 0, [*START])) is None
    for t in (4, 4, *END):  # the model ends its thinking itself, under the budget
        budgets.take("ended", t)
    assert not budgets.turns["ended"].thinking
    for _ in range(10):
        budgets.take("ended", 4)
    assert forced(budgets, chunk("ended", 5, 13)) is None


def test_a_budget_of_zero_ends_the_thinking_as_it_opens():
    budgets = ThinkingBudgets(START, END)
    assert forced(budgets, chunk("z", 0, 0, [1, *START])) == END[0]
    budgets.free("z")
    c = chunk("z", 0, 0, [1, 7])  # <think>'s first token ends the prompt
    assert forced(budgets, c) is None and budgets.may_force(c)  # its second may come next: sample late
    budgets.take("z", 8)
    assert forced(budgets, chunk("z", 0, 1)) == END[0]


def test_a_multi_token_end_marker_is_forced_token_by_token():
    budgets = ThinkingBudgets(START, [9, 10, 11])
    assert forced(budgets, chunk("m", 0, 0, [*START])) == 9
    budgets.take("m", 9)
    assert forced(budgets, chunk("m", 0, 1)) == 10
    budgets.take("m", 10)
    assert forced(budgets, chunk("m", 0, 2)) == 11
    budgets.take("m", 11)
    assert not budgets.turns["m"].thinking and forced(budgets, chunk("m", 0, 3)) is None


def test_a_grammar_that_does_not_allow_the_end_marker_keeps_its_mask():
    budgets = ThinkingBudgets(START, END)
    c, other = chunk("g", 0, 0, [*START]), chunk("h", 0, 0, [*START])
    grammar_mask = torch.zeros(2, 16, dtype=torch.bool)
    grammar_mask[0, 3] = True  # row 0's grammar allows only token 3; row 1's allows </think> too
    grammar_mask[1, [3, END[0]]] = True
    merged = budgets.forced_tokens([c, other], 16, AllowedTokens([0, 1], grammar_mask))
    assert merged.rows == [0, 1]
    assert merged.mask[0].nonzero().flatten().tolist() == [3]
    assert merged.mask[1].nonzero().flatten().tolist() == [END[0]]


def test_a_resumed_turn_starts_afresh_and_a_turn_without_a_budget_drops_the_state():
    budgets = ThinkingBudgets(START, END)
    forced(budgets, chunk("r", 2, 0, [*START]))
    budgets.take("r", 4)
    assert budgets.turns["r"].count == 1
    forced(budgets, chunk("r", 2, 0, [*START, 4, 4, *END, 5]))  # resumed: its context closed the thinking
    assert not budgets.turns["r"].thinking
    assert forced(budgets, chunk("r", None, 0, [*START])) is None and "r" not in budgets.turns


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)


# -- the engine, on the embedded model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def markers(llm_fp32):
    budgets = llm_fp32.engine.runner.thinking
    assert len(budgets.start_ids) > 1 and len(budgets.end_ids) > 1  # the markers span tokens here
    return budgets.start_ids, budgets.end_ids


def opened_prompt(llm, text: str, start_ids) -> list[int]:
    return llm.engine.tokenizer.encode(text) + start_ids


QUESTIONS = ["Question: what is 2+2? Let me think.", "Plan a trip to Paris. First, some thoughts:"]


@pytest.fixture(scope="module", params=["sync", *MODES])
def llm(request, default_model_dir, llm_fp32):
    if request.param == "sync":
        return llm_fp32
    return LLM(default_model_dir, dtype="float32", kv_cache_gb=0.25, host_kv_gb=0.01, max_num_batched_tokens=32,
               progress=False, **MODES[request.param])


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_thinking_ends_at_the_budget_and_the_answer_equals_a_fresh_run(llm, llm_fp32, markers, budget):
    start, end = markers
    prompts = [opened_prompt(llm, q, start) for q in QUESTIONS]
    n = 24
    free = llm_fp32.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)] * 2)
    # With one request unbudgeted beside them in the batch, which the budgets leave alone.
    outs = llm.generate([*prompts, prompts[0]], [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, thinking_token_budget=budget),
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, thinking_token_budget=budget + 2),
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)])
    assert outs[2].token_ids == free[0].token_ids
    for prompt, unbudgeted, out, b in zip(prompts, free, outs, (budget, budget + 2)):
        assert last_index(unbudgeted.token_ids[:b + len(end)], end) < 0  # the model would think on
        assert out.token_ids[:b] == unbudgeted.token_ids[:b]
        assert out.token_ids[b:b + len(end)] == end
        closed = prompt + out.token_ids[:b + len(end)]
        (fresh,) = llm_fp32.generate([closed], [SamplingParams(temperature=0, max_tokens=n - b - len(end),
                                                               ignore_eos=True)])
        assert out.token_ids[b + len(end):] == fresh.token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.device.num_blocks and not llm.engine.runner.thinking.turns


def test_a_prompt_that_closed_its_thinking_is_not_forced(llm_fp32, markers):
    start, end = markers
    tok = llm_fp32.engine.tokenizer
    prompt = tok.encode("Question: what is 2+2?") + start + tok.encode(" easy") + end
    free, budgeted = llm_fp32.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thinking_token_budget=0)])
    assert budgeted.token_ids == free.token_ids


# -- the server, without a reasoning parser -----------------------------------------------------------

def test_a_budget_without_a_reasoning_parser_is_a_400_but_anthropics_is_ignored(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "thinking_token_budget": 8}
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in r.json()["error"]["message"]
    unlimited = httpx.post(f"{server.url}/chat/completions", json=body | {"thinking_token_budget": -1}, timeout=60)
    assert unlimited.status_code == 200
    r = httpx.post(f"{server.url}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                      "thinking_token_budget": -2}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                    "thinking_token_budget": 8}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    # Anthropic's clients send a budget whatever the model: a model that does not think keeps none.
    r = httpx.post(f"{server.base}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 200, r.text
