"""`async_output`: a step's output stage runs while the next step's pass computes; `async_scheduling`: a
step is also planned and launched before the step before's samples are read (both on by default on a GPU).
Here, on a CPU, they are switched on to check that they change nothing a caller can see but when outputs
come out: the same tokens, text, stop reasons, logprobs, tool calls and resumes as the synchronous engine,
token by token, every output delivered (one step later), nothing leaked."""
from __future__ import annotations

import functools
import re

import pytest

from infercept.engine import LLM, Engine, SamplingParams
from infercept.engine.request import PLACEHOLDER, InterceptParams

from test_interception import FEW_SHOT, HERMES, OTHERS, TOOL_RESULT, assert_all_free, drain, greedy, last_output, \
    make_engine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 20, "1, 2, 3, 4,"]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=20, stop=["\n"]),  # a stop string: the output stage ends it
          SamplingParams(temperature=0, max_tokens=16, stop=["time"], logprobs=2),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7)]


# The two ways of running a step's host work beside the next pass.
MODES = {"async output": dict(async_output=True, async_scheduling=False),
         "async scheduling": dict(async_output=True, async_scheduling=True)}
modes = pytest.mark.parametrize("mode", list(MODES))


@pytest.fixture(scope="module", params=list(MODES))
def async_llm(request, default_model_dir):
    return LLM(default_model_dir, dtype="float32", kv_cache_gb=0.25, host_kv_gb=0.01, max_num_batched_tokens=32,
               progress=False, **MODES[request.param])


def test_async_output_and_scheduling_are_off_on_a_cpu_by_default(llm_fp32):
    assert llm_fp32.engine.async_output is False and llm_fp32.engine.async_scheduling is False


def test_generation_is_the_same_with_the_output_stage_a_step_behind(async_llm, llm_fp32):
    sync = llm_fp32.generate(PROMPTS, PARAMS)
    overlapped = async_llm.generate(PROMPTS, PARAMS)
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in overlapped] == \
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in sync]
    # Logprobs alike up to float noise (the shared reference engine may reuse cached prefixes).
    assert [s.token_id for s in overlapped[2].logprobs] == [s.token_id for s in sync[2].logprobs]
    assert [s.logprob for s in overlapped[2].logprobs] == pytest.approx([s.logprob for s in sync[2].logprobs],
                                                                        abs=1e-3)
    assert sync[1].finish_reason == "stop" and sync[2].stop_reason == "time"  # the stop strings did end them
    bm = async_llm.engine.block_manager
    assert bm.num_free_blocks == bm.device.num_blocks and not async_llm.engine.scheduler.requests


def test_outputs_come_one_step_later_and_the_last_ones_are_not_lost(async_llm):
    engine = async_llm.engine
    rid = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append([len(o.token_ids) for o in engine.step() if o.request_id == rid])
    # The prompt's step samples the first token; its output comes out of the next step, and the last
    # token's out of a step that has nothing left to run.
    assert per_step == [[], [1], [2], [3]]


def test_a_stop_string_ends_the_turn_and_its_extra_token_is_dropped(async_llm, llm_fp32):
    """The stop string is seen by the output stage a step late: the request ran one more token meanwhile,
    which neither the output nor the request keeps."""
    params = SamplingParams(temperature=0, max_tokens=30, stop=["magic"])
    prompt = "Once upon a time, " * 3
    expected = llm_fp32.generate([prompt], params)[0]
    engine = async_llm.engine
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    out = last_output(outs, rid)
    assert out.finished and out.finish_reason == "stop" and out.token_ids == expected.token_ids
    assert out.text == expected.text and len(out.token_ids) < 30


def pause_call_and_resume(engine: Engine) -> tuple:
    """A tool call's turn to its pause, other requests meanwhile, the resumed turn: what a caller sees."""
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=HERMES)
    paused = last_output(drain(engine), rid)
    context = list(engine.scheduler.requests[rid].token_ids)
    others = [engine.add_request(p, greedy(12)) for p in OTHERS]
    outs = drain(engine)
    location = engine.kv_location(rid)
    engine.resume(rid, engine.tokenizer.encode(TOOL_RESULT), greedy(10))
    for p in OTHERS[:2]:
        engine.add_request(p, greedy(6))
    resumed = last_output(drain(engine), rid)
    assert all(last_output(outs, o).finished for o in others) and resumed.finished
    assert_all_free(engine)
    calls = [(c.name, c.arguments) for c in paused.tool_calls]
    return paused.paused, paused.token_ids, calls, context, location["device"] + location["host"] > 0, \
        resumed.token_ids


@functools.cache
def synchronous_pause_call_and_resume(model_dir: str, policy: str) -> tuple:
    return pause_call_and_resume(make_engine(model_dir, policy, async_output=False))


@modes
@pytest.mark.parametrize("policy", ["infercept", "discard", "swap"])
def test_a_tool_call_pauses_and_resumes_as_on_the_synchronous_engine(default_model_dir, policy, mode):
    """The call is judged complete by the output stage, a step after its last token was sampled: the paused
    context, the parsed call, the KV left after other requests ran and the resumed turn's tokens are the
    synchronous engine's."""
    overlapped = pause_call_and_resume(make_engine(default_model_dir, policy, **MODES[mode]))
    assert overlapped == synchronous_pause_call_and_resume(default_model_dir, policy)
    assert overlapped[0] and overlapped[2] == [("get_weather", '{"city": "Paris"}')]


@modes
def test_pause_on_stop_is_not_planned_on_and_abort_drops_a_pending_output(default_model_dir, mode):
    """A turn the scheduler ends (its length limit, under pause_on_stop) waits out of the next plan for the
    output stage's verdict; a request aborted while its output is pending gives no output after."""
    engine = make_engine(default_model_dir, "infercept", **MODES[mode])
    rid = engine.add_request("The three primary colors are", greedy(4), intercept=InterceptParams(pause_on_stop=True))
    planned, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: planned.append(schedule()) or planned[-1]
    out = last_output(drain(engine), rid)
    assert out.paused and len(out.token_ids) == 4
    assert sum(rid in {c.request_id for c in p.chunks} for p in planned) == 4  # the prompt, then 3 decodes
    engine.resume(rid, engine.tokenizer.encode(" Also,"), greedy(4))
    engine.step()  # samples the resumed turn's first token; its output is pending
    assert engine.has_unfinished_requests()
    engine.abort(rid)
    assert all(o.request_id != rid for o in drain(engine))
    assert_all_free(engine)


def run_to_end(engine: Engine, prompts, params) -> list[tuple]:
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outs = drain(engine)
    assert_all_free(engine)
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in (last_output(outs, r) for r in rids)]


def test_a_step_is_planned_on_placeholders_while_the_samples_before_are_on_their_way(default_model_dir):
    """Each decode is planned before the token it computes on is read: the plan holds a placeholder, the pass
    reads the token from the device, and the tokens come out the synchronous engine's."""
    engine = make_engine(default_model_dir, "infercept", **MODES["async scheduling"])
    planned, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: planned.append(schedule()) or planned[-1]
    prompts, params = PROMPTS[:2], [greedy(8), greedy(5)]
    assert run_to_end(engine, prompts, params) == \
        run_to_end(make_engine(default_model_dir, "infercept", async_output=False), prompts, params)
    decodes = [c for step in planned for c in step.chunks if c.start_pos > 0 and len(c.token_ids) == 1]
    assert len(decodes) == 7 + 4 and all(c.token_ids == [PLACEHOLDER] for c in decodes)


@pytest.mark.parametrize("policy", ["infercept+swap-preemption", "infercept+recompute-preemption"])
def test_preemption_with_samples_in_flight_gives_the_synchronous_engines_tokens(default_model_dir, policy):
    """A small pool: requests whose samples are still on their way are preempted (swapped out, or freed to
    recompute); their tokens still count, and every request's tokens are the synchronous engine's."""
    prompts = [p[:60 + 20 * i] for i, p in enumerate(OTHERS)] + [PROMPTS[2][:60]]
    params = [greedy(40), greedy(36), SamplingParams(temperature=0.8, max_tokens=30, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[28])]  # ","
    runs, in_flight = {}, []
    for name, kw in (("sync", dict(async_output=False)), ("async", MODES["async scheduling"])):
        engine = make_engine(default_model_dir, policy, kv_cache_gb=0.006, **kw)  # 8 blocks of 16 tokens
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda out, r: in_flight.append(r.awaiting_sample) or preempt(out, r)
        runs[name] = run_to_end(engine, prompts, params)
        assert engine.stats.num_preemptions > 0
    assert runs["async"] == runs["sync"] and runs["sync"][3][1:] == ("stop", 28)
    assert any(in_flight)  # some were preempted with their sample on its way
    assert runs["async"] == runs["sync"]


CITY = r"(Paris|Lyon|Nice) is (big|small|old), [0-9]{2}\."


def test_grammar_and_penalty_requests_are_planned_on_placeholders_and_sampled_after_them(default_model_dir):
    """Their next tokens depend on the last ones on the host (the grammar's mask, the penalties' counts):
    planned on a placeholder like the rest, they are sampled once the step before's samples are read, and
    their tokens are the synchronous engine's. A grammar over several tokens would leave its path, and the
    counts would miss a token, were they sampled first."""
    from infercept.engine.sampling_params import GuidedDecodingParams

    engine = make_engine(default_model_dir, "infercept", **MODES["async scheduling"])
    seen, schedule = [], engine.scheduler.schedule

    def plan():
        out = schedule()
        seen.extend(c.token_ids[-1] for c in out.chunks if c.sampling_params.needs_history and c.start_pos > 0)
        return out
    engine.scheduler.schedule = plan
    prompts = PROMPTS[:3] + [PROMPTS[0]]
    params = [SamplingParams(temperature=0, max_tokens=20, guided=GuidedDecodingParams(regex=CITY)),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5),
              greedy(10),
              SamplingParams(temperature=0.8, max_tokens=10, seed=11, presence_penalty=1.5, ignore_eos=True)]
    ends = run_to_end(engine, prompts, params)
    assert ends == run_to_end(make_engine(default_model_dir, "infercept", async_output=False), prompts, params)
    assert seen.count(PLACEHOLDER) >= 9 + 9  # (the grammar's turn and the penalized ones', decodes)
    text = engine.tokenizer.decode(ends[0][0], skip_special_tokens=True)
    assert ends[0][1] == "stop" and re.fullmatch(CITY, text), text


def test_only_a_step_with_a_grammar_on_a_placeholder_samples_after_the_step_befores_samples_are_read(
        default_model_dir):
    """The order the host queues a step's work in: free requests' sampling right behind the pass (the host's
    work then overlaps both); a grammar's request planned on a placeholder, its sampling once the step
    before's output stage has read that step's samples."""
    from infercept.engine.sampling_params import GuidedDecodingParams

    engine = make_engine(default_model_dir, "infercept", **MODES["async scheduling"])
    runner, order = engine.runner, []
    sample, output_stage = runner._sample, engine._output_stage_of_last_step

    def traced_sample(out, *args):
        late = any(c.sampling_params.needs_history and c.token_ids[-1] == PLACEHOLDER for c in out.chunks)
        order.append("late sample" if late else "sample")
        return sample(out, *args)
    runner._sample = traced_sample
    engine._output_stage_of_last_step = lambda: order.append("read") or output_stage()
    engine.add_request(PROMPTS[0], greedy(4))
    drain(engine)
    # Each of the 4 steps samples, then reads the step before's; a last step without a pass reads the 4th's.
    assert order == ["sample", "read"] * 4 + ["read"]
    order.clear()
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, guided=GuidedDecodingParams(regex=CITY)))
    drain(engine)
    assert order == ["sample", "read"] + ["read", "late sample"] * 3 + ["read"]


def test_prompt_logprobs_are_the_synchronous_engines(async_llm, llm_fp32):
    """A step that scores a prompt reads its logprobs before the next is planned: the same positions,
    ranks and values as the synchronous engine, the prompt computed over several chunks."""
    prompt = "Once upon a time, " * 8
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    (sync,), (overlapped,) = llm_fp32.generate([prompt], [params]), async_llm.generate([prompt], [params])
    assert overlapped.token_ids == sync.token_ids and len(sync.prompt_logprobs) > 32
    assert overlapped.prompt_logprobs[0] is None is sync.prompt_logprobs[0]
    assert [(s.token_id, s.rank, list(s.top_logprobs)) for s in overlapped.prompt_logprobs[1:]] == \
        [(s.token_id, s.rank, list(s.top_logprobs)) for s in sync.prompt_logprobs[1:]]
    assert [s.logprob for s in overlapped.prompt_logprobs[1:]] == \
        pytest.approx([s.logprob for s in sync.prompt_logprobs[1:]], abs=1e-4)


def test_bad_words_and_allowed_token_ids_are_the_synchronous_engines(async_llm, llm_fp32):
    """A bad word's prefix is read from the step before's sample (late sampling under asynchronous
    scheduling, as penalties are): the same tokens as the synchronous engine."""
    prompt = "The capital of France is"
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["answer is", "Paris"]),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[30, 198, 504, 7042])]
    sync, overlapped = llm_fp32.generate([prompt] * 2, params), async_llm.generate([prompt] * 2, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert set(sync[1].token_ids) <= {30, 198, 504, 7042} and "Paris" not in sync[0].text
