"""Presence, frequency and repetition penalties, logit_bias, min_p and chat_template_kwargs.

Each field's effect is checked against a reference on the same logits: transformers' logits processors
(`RepetitionPenaltyLogitsProcessor`, `MinPLogitsWarper`, `SequenceBiasLogitsProcessor`) and, for
presence and frequency, the formula vLLM uses (vllm/model_executor/layers/utils.py `apply_penalties`:
over the output tokens only). Then through the engine, greedy and in float32, on a tiny random model:
token by token equal to transformers' `generate` with the same processors, batched with requests that
set none (which must not change), across a chunked prefill and across a pause and resume. Then the
server: every field is accepted where it used to be a 400, bad values are 400s; and the vLLM backend's
mapping onto vLLM's own `SamplingParams` fields.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LogitsProcessor,
                          LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from infercept.engine import LLM, SamplingParams
from infercept.engine import sampler as sampler_module
from infercept.engine.request import InterceptParams
from infercept.engine.sampler import TokenHistory, apply_logit_bias, apply_min_p, apply_penalties, sample
from infercept.engine.vllm_backend.params import vllm_sampling_fields
from live_server import MODEL
from live_server import profile as hand_written_profile
from test_architectures import TINY, TOKENIZER_FILES, randomize

VOCAB = TINY["vocab_size"]
MIN_MARGIN = 1e-2  # top-1 vs top-2 gap of the reference's processed logits at every step


# -- the parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(presence_penalty=2.5), dict(presence_penalty=-2.1), dict(frequency_penalty=3), dict(frequency_penalty=float("nan")),
    dict(repetition_penalty=0), dict(repetition_penalty=-1), dict(repetition_penalty=float("inf")),
    dict(min_p=-0.1), dict(min_p=1.5), dict(logit_bias={"x": 1.0}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={5: 101}), dict(logit_bias={5: float("nan")}), dict(logit_bias={5: "1"}),
])
def test_bad_values_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.logit_bias) == (0, 0, 1, 0, None)
    assert not p.penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(presence_penalty=-1).penalized
    assert SamplingParams(logit_bias={"12": 5, 7: -100}).logit_bias == {12: 5.0, 7: -100.0}  # JSON's string keys
    assert SamplingParams(logit_bias={}).logit_bias is None


# -- the sampler's steps against their references --------------------------------------------------------

def random_case(seed: int, rows: int = 3, vocab: int = 64):
    """Logits with both signs and a banned (-inf) entry, and histories with repeats, in prompt and output."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[0, 3] = float("-inf")
    histories = []
    for r in range(rows):
        n = 5 + 7 * r
        ids = torch.randint(0, vocab // 2, (n,), generator=gen).tolist()  # a narrow range: many repeats
        histories.append(TokenHistory(ids + [3], num_output=(n + 1) // 2 if r != 1 else 0))  # row 1: no output yet
    return logits, histories


def vllm_reference(logits: torch.Tensor, histories, params) -> torch.Tensor:
    """vLLM's `apply_penalties` (torch path), written out: bin counts of prompt and output tokens, the
    repetition penalty on tokens in either, then frequency x output count and presence x in output."""
    rows, vocab = logits.shape
    out = logits.clone()
    for r, (h, p) in enumerate(zip(histories, params)):
        prompt, output = h.token_ids[:len(h.token_ids) - h.num_output], h.token_ids[len(h.token_ids) - h.num_output:]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
        in_prompt = torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=vocab) > 0
        penalty = torch.where(in_prompt | (counts > 0), p.repetition_penalty, 1.0)
        row = torch.where(out[r] > 0, out[r] / penalty, out[r] * penalty)
        row = row - p.frequency_penalty * counts
        out[r] = row - p.presence_penalty * (counts > 0).float()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_is_transformers_over_prompt_and_output(seed):
    logits, histories = random_case(seed)
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0)]
    got = apply_penalties(logits.clone(), histories, params)
    for r, (h, p) in enumerate(zip(histories, params)):
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([list(h.token_ids)]), logits[r:r + 1].clone())
        assert torch.equal(got[r], ref[0])
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_presence_and_frequency_are_vllms_over_the_output_only(seed):
    logits, histories = random_case(seed)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=1.5),
              SamplingParams(presence_penalty=2, frequency_penalty=-2),
              SamplingParams(presence_penalty=-1.25, frequency_penalty=0.25, repetition_penalty=1.2)]
    got = apply_penalties(logits.clone(), histories, params)
    ref = vllm_reference(logits, histories, params)
    assert torch.equal(got.isinf(), ref.isinf())
    assert torch.allclose(got[~got.isinf()], ref[~ref.isinf()], rtol=0, atol=1e-6)
    # Prompt tokens count for neither: a row without output tokens is unchanged without repetition penalty.
    only_prompt = apply_penalties(logits[1:2].clone(), histories[1:2], [SamplingParams(presence_penalty=2, frequency_penalty=2)])
    assert torch.equal(only_prompt[0], logits[1])
    # By hand: token 4 is in the prompt once and the output twice, token 9 in the prompt only.
    h = TokenHistory([4, 9, 4, 4], num_output=2)
    row = torch.zeros(1, 16)
    row[0, 4], row[0, 9], row[0, 1] = 3.0, -3.0, 3.0
    one = apply_penalties(row.clone(), [h], [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                            repetition_penalty=2.0)])[0]
    assert one[4].item() == 3.0 / 2 - 0.25 * 2 - 0.5 and one[9].item() == -3.0 * 2
    assert one[1].item() == 3.0 and one[0].item() == 0.0


def test_logit_bias_is_transformers_sequence_bias():
    logits, _ = random_case(0)
    params = [SamplingParams(logit_bias={5: 3.5, 7: -100, 63: 100}), SamplingParams(), SamplingParams(logit_bias={0: -0.25})]
    got = logits.clone()
    apply_logit_bias(got, params)
    for r, p in enumerate(params):
        bias = [[[t], b] for t, b in (p.logit_bias or {}).items()]
        ref = SequenceBiasLogitsProcessor(sequence_bias=bias)(torch.tensor([[1]]), logits[r:r + 1].clone()) if bias \
            else logits[r:r + 1]
        assert torch.equal(got[r], ref[0])
    out_of_range = logits.clone()
    apply_logit_bias(out_of_range, [SamplingParams(logit_bias={10 ** 6: 5})] * 3)  # the server refuses these
    assert torch.equal(out_of_range, logits)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_is_transformers_min_p(min_p):
    logits, _ = random_case(0)
    got = apply_min_p(logits.clone() / 0.7, torch.full((3,), min_p))
    ref = MinPLogitsWarper(min_p)(None, logits.clone() / 0.7)
    assert torch.equal(got, ref)
    assert torch.equal(apply_min_p(logits.clone(), torch.zeros(3)), logits)  # 0: off


def test_sample_draws_only_what_min_p_keeps_and_greedy_ignores_it():
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.0, -1.0]] * 2)  # probs at T=1: .43 .39 .16 .06 .02
    params = [SamplingParams(temperature=1.0, min_p=0.3, seed=1), SamplingParams(temperature=0, min_p=0.9)]
    drawn = set()
    for seed in range(40):
        gens = [torch.Generator().manual_seed(seed), None]
        tokens = sample(logits.clone(), params, gens, [[], []])
        drawn.add(tokens[0].token_id)
        assert tokens[1].token_id == 0
    assert drawn == {0, 1, 2}  # .16 >= .3 x .43; .06 is not
    unfiltered = {sample(logits.clone(), [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(s)],
                         [[]])[0].token_id for s in range(200)}
    assert {3, 4} & unfiltered  # without min_p the tail is drawn too: the check above can fail


def test_order_is_vllms_bias_then_penalties_and_logprobs_are_before_both():
    """Repetition scales the biased logit (bias first, as vLLM); logprobs are the masked logits'."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    params = [SamplingParams(temperature=0, logit_bias={1: 0.25}, repetition_penalty=4.0, logprobs=2)]
    out = sample(logits.clone(), params, [None], [[]], histories=[TokenHistory([1, 0], 1)])[0]
    # biased: [1, .75, 0, -.5]; both seen: [.25, .1875, 0, -.5] -> token 0 (the penalty first: .125 + .25 -> 1)
    assert out.token_id == 0
    assert out.logprob == pytest.approx(float(logits.log_softmax(-1)[0, 0]))
    assert out.top_logprobs == pytest.approx(dict(zip([0, 1], logits.log_softmax(-1)[0, :2].tolist())))


def test_the_fast_path_does_no_extra_work(monkeypatch):
    """Parameters without penalties, bias or min_p never reach those steps (decided on the host: no
    token history needed, nothing uploaded); a penalized row without its history is an error."""
    def boom(*args, **kwargs):
        raise AssertionError("called on the fast path")

    for name in ("apply_penalties", "apply_logit_bias", "apply_min_p"):
        monkeypatch.setattr(sampler_module, name, boom)
    logits = torch.randn(3, 32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(logprobs=1)]
    out = sampler_module.sample(logits.clone(), params, [None, torch.Generator().manual_seed(3), None], [[], [], []])
    assert out[0].token_id == int(logits[0].argmax())
    monkeypatch.undo()
    with pytest.raises(ValueError, match="history"):
        sample(logits.clone(), [SamplingParams(presence_penalty=1)], [None], [[]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalties_bias_and_min_p_never_wait_on_the_device():
    device = torch.device("cuda")
    logits, histories = random_case(0, vocab=4096)
    logits = logits.to(device)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                             logit_bias={5: 1.0})] * 3
    apply_penalties(logits.clone(), histories, params)  # warm up (allocations, pinned pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_penalties(logits.clone(), histories, params)
        biased = logits.clone()
        apply_logit_bias(biased, params)
        apply_min_p(logits, torch.full((3,), 0.1, device=device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(got.cpu(), apply_penalties(logits.cpu(), histories, params), atol=1e-5)


# -- through the engine, on a tiny random model ----------------------------------------------------------

class PresenceFrequency(LogitsProcessor):
    """vLLM's presence and frequency penalties over the tokens generated after the first `prompt_len`."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def processors(prompt_len: int, p: SamplingParams) -> list:
    """transformers' equivalent of `p`, in vLLM's order: bias, repetition, frequency and presence."""
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in p.logit_bias.items()]))
    if p.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(PresenceFrequency(prompt_len, p.presence_penalty, p.frequency_penalty))
    return procs


def hf_reference(model, prompt: list[int], p: SamplingParams) -> tuple[list[int], float]:
    """transformers' greedy `generate` with `p`'s processors: its `max_tokens` new tokens (EOS neither
    stops nor is banned), and the smallest top-1 / top-2 gap of the processed logits."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(do_sample=False, max_new_tokens=p.max_tokens, pad_token_id=0, eos_token_id=None,
                              output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=LogitsProcessorList(processors(len(prompt), p)))
    top2 = torch.cat(out.scores).topk(2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """A tiny random Llama (tied embeddings) saved with the default model's tokenizer, its final norm
    halved (logits closer together: penalties of a unit or two change some greedy choices); and the
    engine on it (16-token steps: a 40-token prompt is prefilled in chunks)."""
    folder = tmp_path_factory.mktemp("tiny-penalties")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=True), dtype=torch.float32).eval()
    randomize(hf, 0)
    with torch.no_grad():
        hf.model.norm.weight.mul_(0.5)
    hf.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes(Path(default_model_dir, name).read_bytes())
    llm = LLM(str(folder), dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=16, host_kv_gb=0.01,
              profile=hand_written_profile(), progress=False)
    return SimpleNamespace(hf=hf, llm=llm, engine=llm.engine)


def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    short, mid, long = ([rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 21, 40))
    return {"short": short, "mid": mid, "long": long, "range": list(range(100, 110))}


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


# Each field changes the greedy output of at least one of these (checked), so equality with the
# reference is not equality with plain greedy decoding.
CASES = [
    ("short", dict(presence_penalty=2.0)),
    ("short", dict(frequency_penalty=1.0)),
    ("range", dict(presence_penalty=-2.0)),
    ("long", dict(presence_penalty=-2.0)),  # a 40-token prompt: chunked prefill next to the others' decodes
    ("range", dict(repetition_penalty=1.2)),
    ("long", dict(repetition_penalty=0.8)),
    ("mid", dict(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={1000: 4.0})),
    ("short", dict(logit_bias={20134: 6.0, 1463: -5.0})),
    ("short", dict()),
    ("long", dict()),
]


def test_greedy_with_each_field_equals_transformers_token_by_token(tiny):
    """One batch: every case next to the others (and next to requests that set nothing, which must stay
    plain greedy), each equal to transformers' generate with the same processors in float32."""
    ps = prompts()
    outs = tiny.llm.generate([ps[name] for name, _ in CASES], [greedy(**kw) for _, kw in CASES])
    tiny.engine.block_manager.check_integrity()
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.block_manager.device.num_blocks
    plain = {name: hf_reference(tiny.hf, ps[name], greedy())[0] for name in ps}
    changed = set()
    for (name, kw), out in zip(CASES, outs):
        ref, margin = hf_reference(tiny.hf, ps[name], greedy(**kw))
        assert margin > MIN_MARGIN, f"near-tie in the reference ({margin:.2e}) for {name} {kw}; pick another case"
        assert out.token_ids == ref, (name, kw)
        if ref != plain[name]:
            changed |= set(kw)
    assert changed == {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}


def test_a_huge_logit_bias_decides_greedy_output(tiny):
    """+100 on the 100th most likely token makes it the greedy choice; -100 on the most likely one
    rules it out; both as transformers decodes them. (The server's test does the same on SmolLM2.)"""
    prompt = prompts()["short"]
    with torch.inference_mode():
        ranked = tiny.hf(input_ids=torch.tensor([prompt])).logits[0, -1].argsort(descending=True).tolist()
    params = [greedy(6, logit_bias={ranked[100]: 100}), greedy(6, logit_bias={ranked[0]: -100})]
    outs = tiny.llm.generate([prompt, prompt], params)
    assert outs[0].token_ids[0] == ranked[100] and outs[1].token_ids[0] == ranked[1]
    for out, p in zip(outs, params):
        assert out.token_ids == hf_reference(tiny.hf, prompt, p)[0]


def test_min_p_keeps_only_tokens_near_the_most_likely(tiny):
    """Sampled at temperature 2 (a wide distribution), every token drawn under min_p has, under
    transformers' logits for the same context, a probability >= min_p x the most likely; without min_p
    the same draws take tokens well below that."""
    prompt, t, min_p = prompts()["mid"], 2.0, 0.3

    def worst_ratio(params: list[SamplingParams]) -> float:
        outs = tiny.llm.generate([prompt] * len(params), params)
        ratios = []
        for out in outs:
            with torch.inference_mode():
                logits = tiny.hf(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
            probs = (logits / t).softmax(-1)
            chosen = probs.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            ratios += (chosen / probs.max(-1).values).tolist()
        return min(ratios)

    assert worst_ratio([SamplingParams(temperature=t, min_p=min_p, seed=s, max_tokens=8, ignore_eos=True)
                        for s in range(6)]) >= min_p * (1 - 1e-3)
    assert worst_ratio([SamplingParams(temperature=t, seed=s, max_tokens=8, ignore_eos=True)
                        for s in range(6)]) < min_p * 0.75


def test_a_resumed_turn_penalizes_its_own_output_as_a_fresh_request_would(tiny):
    """After a pause, the turn's prompt is the whole paused context (as vLLM's resumed sessions count
    it): its presence and frequency penalties count only what it generates itself. Set up so that this
    decides its first token: a token `t` of the first turn is biased to one below the most likely token
    `a` (the first turn's token closest to it: the logits of this random model spread over ~100s), so
    presence -2 makes `t` win only if the first turn's tokens counted as this turn's output."""
    engine = tiny.engine
    prompt = prompts()["range"]
    rid = engine.add_request(prompt, greedy(8, frequency_penalty=1.0), intercept=InterceptParams(pause_on_stop=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].paused
    context = list(engine.scheduler.requests[rid].token_ids) + [25495, 36360]  # + the "tool result"
    first_turn = context[len(prompt):-2]
    with torch.inference_mode():
        logits = tiny.hf(input_ids=torch.tensor([context])).logits[0, -1]
    a = int(logits.argmax())
    t = min(set(first_turn) - {a}, key=lambda tok: float(logits[a] - logits[tok]))
    bias = float(logits[a] - logits[t]) - 1.0
    assert abs(bias) <= 100
    second = greedy(6, presence_penalty=-2.0, logit_bias={t: bias})
    engine.resume(rid, context[-2:], second)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    resumed = [o for o in outs if o.request_id == rid][-1]
    engine.abort(rid)
    (fresh,) = tiny.llm.generate([context], [second])
    ref, margin = hf_reference(tiny.hf, context, second)
    assert margin > MIN_MARGIN
    assert resumed.token_ids[0] == a
    assert resumed.token_ids == fresh.token_ids == ref
    assert engine.block_manager.num_free_blocks == engine.block_manager.device.num_blocks


# -- the vLLM backend's mapping ---------------------------------------------------------------------------

def test_vllm_fields_carry_every_sampling_field():
    params = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3,
                            min_p=0.05, logit_bias={"42": 7.5, 9: -100}, max_tokens=4)
    fields = vllm_sampling_fields(params, resumable=False)
    assert {k: fields[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")} \
        == {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.3, "min_p": 0.05,
            "logit_bias": {42: 7.5, 9: -100.0}}
    plain = vllm_sampling_fields(SamplingParams(), resumable=True)
    assert (plain["presence_penalty"], plain["frequency_penalty"], plain["repetition_penalty"], plain["min_p"],
            plain["logit_bias"]) == (0.0, 0.0, 1.0, 0.0, None)  # vLLM's own defaults


def vllm_python() -> str:
    from infercept.engine import default_vllm_python

    return default_vllm_python()


@pytest.mark.skipif(not os.path.isfile(vllm_python()), reason="no vLLM environment (`make vllm-env`)")
def test_vllms_sampling_params_take_the_fields_as_they_are_sent():
    """The worker's own conversion (worker.sampling_params) in vLLM's python, on the fields pickled as the
    connection sends them: vLLM validates and keeps each one (nothing starts)."""
    params = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3,
                            min_p=0.05, logit_bias={42: 7.5}, max_tokens=4)
    worker_dir = Path(__file__).resolve().parent.parent / "engine" / "vllm_backend"
    code = ("import json, pickle, sys; sys.path.insert(0, sys.argv[1]); from worker import sampling_params; "
            "p = sampling_params(pickle.load(sys.stdin.buffer)); print(json.dumps([p.presence_penalty, "
            "p.frequency_penalty, p.repetition_penalty, p.min_p, {str(k): v for k, v in p.logit_bias.items()}]))")
    run = subprocess.run([vllm_python(), "-c", code, str(worker_dir)], capture_output=True, timeout=300,
                         input=pickle.dumps(vllm_sampling_fields(params, resumable=False)))
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert json.loads(run.stdout.decode().strip().splitlines()[-1]) == [0.5, -1.0, 1.3, 0.05, {"42": 7.5}]


# -- chat_template_kwargs in the renderer -----------------------------------------------------------------

THINKING_SWITCH = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")


@pytest.fixture
def renderer(default_model_dir):
    from infercept.engine.backend import ToolFormat
    from infercept.server.chat import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)  # its own: the template is changed
    tokenizer.chat_template = THINKING_SWITCH  # Qwen3's switch in the generation prompt
    return ChatRenderer(tokenizer, frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")}), ToolFormat("hermes"))


def paused_call_turn(renderer, kwargs):
    """A conversation paused at a tool call generated after a prompt rendered with `kwargs`: (the paused
    context, its known turn, the conversation with the call's result)."""
    from infercept.server.chat import AssistantTurn, Call, Message

    question = (Message("user", "What is the weather in Paris?"),)
    call = Call.make("call_1", "get_weather", '{"city": "Paris"}')
    eos = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn_ids = tuple(renderer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')) + (eos,)
    turn = AssistantTurn(Message("assistant", "", None, (call,)), turn_ids, kwargs)
    context = renderer.render(question, None, template_kwargs=kwargs) + list(turn_ids)
    return context, turn, question + (turn.message, Message("tool", '{"temperature": 21}', tool_call_id="call_1"))


def test_chat_template_kwargs_reach_the_template_and_a_paused_turn_keeps_its_own(renderer):
    from infercept.server.chat import Message

    question = (Message("user", "Hi"),)
    off = renderer.tokenizer.decode(renderer.render(question, None, template_kwargs={"enable_thinking": False}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert renderer.tokenizer.decode(renderer.render(question, None)).endswith("<|im_start|>assistant\n")
    # A turn that paused with thinking off: the request that brings its result renders the paused prompt with
    # thinking off again (so the paused tokens are a prefix: the generation resumes), whatever it sends itself;
    # what it adds after them is rendered with its own kwargs.
    context, turn, conversation = paused_call_turn(renderer, {"enable_thinking": False})
    known = lambda m: turn if m == turn.message else None  # noqa: E731
    for kwargs, ending in (({"enable_thinking": False}, "<think>\n\n</think>\n\n"), (None, "assistant\n")):
        ids = renderer.render(conversation, None, known, template_kwargs=kwargs)
        assert ids[:len(context)] == context, kwargs
        assert renderer.tokenizer.decode(ids[len(context):]).endswith(ending)


def test_chat_template_kwargs_may_not_set_what_the_server_sets(renderer):
    from infercept.server.chat import Message
    from infercept.server.protocol import APIError

    for key in ("tools", "add_generation_prompt", "chat_template", "tokenize", "messages", "continue_final_message"):
        with pytest.raises(APIError) as e:
            renderer.render((Message("user", "Hi"),), None, template_kwargs={key: None})
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs" and key in e.value.message


def test_a_paused_turn_remembers_its_chat_template_kwargs(renderer):
    """Turns: the kwargs reach the rendering (`_prepare`), and a turn that pauses at calls keeps them with
    its `AssistantTurn` (`_end`), for the request that brings the results."""
    from infercept.engine.backend import RequestOutput
    from infercept.engine.tool_parsers import ToolCall
    from infercept.server.chat import Message
    from infercept.server.conversations import ConversationStore
    from infercept.server.settings import ConversationPolicy
    from infercept.server.tool_mode import tool_mode
    from infercept.server.chat import tool_specs
    from infercept.server.protocol import ToolParam
    from infercept.server.turns import Sampling, Turn, Turns, TurnSpec

    tools = tool_specs([ToolParam.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})])
    store = ConversationStore(ConversationPolicy(), lambda *args: None)
    metrics = SimpleNamespace(observe_request=lambda *args: None)
    turns = Turns(None, store, metrics, None, renderer, 2048, VOCAB)
    kwargs = {"enable_thinking": False}
    spec = TurnSpec("chat", Sampling(max_tokens=4), (Message("user", "Hi"),), mode=tool_mode(tools, "auto"),
                    template_kwargs=kwargs)
    prepared = turns._prepare(spec)
    assert renderer.tokenizer.decode(prepared.prompt_ids).endswith("<think>\n\n</think>\n\n")
    engine = SimpleNamespace(prompt_ids=prepared.prompt_ids, request_id="r1", resumed=False, cached_tokens=0)
    turn = Turn(turns, spec, "chatcmpl-1", engine, "", guided_calls=False)
    out = RequestOutput("r1", prepared.prompt_ids, [5, 6], "x", finished=False, paused=True,
                        tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', "x")], content="")
    result, handle = turn._end(out)
    assert result.finish_reason == "tool_calls" and handle.turn.template_kwargs == kwargs


# -- the server ---------------------------------------------------------------------------------------------

FIELDS = [{"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2}, {"min_p": 0.1},
          {"logit_bias": {"1000": 5, "17": -100}},
          {"presence_penalty": 1, "frequency_penalty": 1, "repetition_penalty": 1.1, "min_p": 0.05, "logit_bias": {"5": 1}}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_server_accepts_each_field(srv):
    """Each field where it used to be a 400, on both endpoints, greedy and sampled; chat_template_kwargs
    on chat completions; through the openai SDK as an agent framework sends them."""
    with httpx.Client(timeout=60) as http:
        for path, body in (("/chat/completions", {"messages": QUESTION}), ("/completions", {"prompt": "The capital of France is"})):
            for fields in FIELDS:
                for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 1}):
                    r = http.post(srv.url + path, json={"model": MODEL, "max_tokens": 3, **body, **fields, **sampling})
                    assert r.status_code == 200, (path, fields, r.text)
        r = http.post(srv.url + "/chat/completions", json={"model": MODEL, "max_tokens": 3, "messages": QUESTION,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
    client = srv.client()
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, presence_penalty=0.3,
                                         frequency_penalty=0.3, logit_bias={"1000": 100},
                                         extra_body={"repetition_penalty": 1.1, "min_p": 0.1, "return_token_ids": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].token_ids == [1000, 1000, 1000]  # the bias decides the greedy choice
    srv.assert_no_leak()


def test_the_server_refuses_bad_values_with_400(srv):
    bad = [({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
           ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 150}}, "logit_bias"),
           ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
           ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
           ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
           ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs")]
    with httpx.Client(timeout=60) as http:
        for fields, param in bad:
            r = http.post(srv.url + "/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": QUESTION, **fields})
            assert r.status_code == 400, (fields, r.text)
            error = r.json()["error"]
            assert param in (error["param"] or "") + error["message"], (fields, error)
    srv.assert_no_leak()
