"""The scheduler's KV policies with numbers, on the modeled runner (no model, virtual clock).

Everything except the last test runs in well under a second each: the real `Scheduler` and
`BlockManager` drive a `ModeledRunner` that advances a `VirtualClock` by the profile's T_fwd, so
interceptions of 30 s cost nothing to wait for. Assertions are about decisions and accounting, never
about wall-clock time.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from bench_modules import load_bench
from infercept.engine.modeled_runner import ModeledRunner, VirtualClock
from infercept.engine.outputs import ScheduledChunk, SchedulerOutput
from infercept.engine.policy import POLICIES, Profile, a100_gptj_6b
from infercept.engine.policy.profile import h100_llama3_8b
from infercept.engine.sampling_params import SamplingParams
from infercept.engine.simulation import SimulatedEngine, coarsen_profile

M = 1000  # bytes per token of the toy profile
BS = 16

workload = load_bench("workload")


def toy_profile(swap_blocks_per_step: float = 2.0) -> Profile:
    """10 ms iterations up to a few tokens, S = 64; copy bandwidth set so that the swap budget of a
    10 ms iteration is `swap_blocks_per_step` blocks."""
    bw = swap_blocks_per_step * BS * M / 0.01
    return Profile(model="toy", device="sim", dtype="float16", bytes_per_token=M, block_size=BS,
                   t_fwd_samples=((1, 0.010), (64, 0.012), (128, 0.020)), d2h_bytes_per_s=bw,
                   h2d_bytes_per_s=bw, saturation_point=64)


def unique_policies() -> list[str]:
    seen, out = set(), []
    for name, cls in POLICIES.items():
        if cls not in seen:
            seen.add(cls)
            out.append(name)
    return out


def request(rid: str, arrival: float, prompt: int, segments: list[tuple[int, str | None, float, int]]) -> dict:
    """A trace line; segments are (decode_tokens, tool or None, duration_s, returned_tokens)."""
    return {"id": rid, "augment": "test", "arrival": arrival, "prompt_tokens": prompt,
            "segments": [{"decode_tokens": d, "interception": ({"kind": "tool", "tool": tool, "duration_s": s}
                                                              if tool else None), "returned_tokens": r}
                         for d, tool, s, r in segments]}


def assert_pools_empty(engine: SimulatedEngine) -> None:
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.device.num_blocks
    assert bm.num_free_host_blocks == bm.host.num_blocks
    assert not engine.scheduler.requests and not engine.scheduler.paused


def integrity_hook(engine: SimulatedEngine, result) -> None:
    engine.block_manager.check_integrity()


# -- the modeled runner --------------------------------------------------------------------------------

def test_modeled_runner_cost_and_sampling():
    """The modeled copy stream charges what the engine's copy ordering makes a pass wait: nothing for a
    swap-out (gathered before the pass, sent to the host beside it), nothing for a swap-in into blocks
    the pass does not read, the rest of the queued copies for one that does; the synchronous `swap`
    baseline and a CPU (copies before the pass) pay every copy in full."""
    profile = toy_profile(swap_blocks_per_step=2)
    clock = VirtualClock()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunks = [ScheduledChunk("a", [1] * 20, 0, [0, 1], True, params, 0),
              ScheduledChunk("b", [1] * 30, 0, [2, 3], False, params, 0)]
    out = SchedulerOutput(chunks=chunks, swap_out=[(5, 0)] * 3)
    pipelined = ModeledRunner(profile, clock)
    result = pipelined.run(out)
    assert set(result.sampled) == {"a"} and result.sampled["a"].token_id == 100
    t_fwd, t_copy = profile.t_fwd(50), profile.t_swap(3 * BS)
    assert t_copy > t_fwd  # 3 blocks against a 2-block budget: the copies outlast the pass
    assert pipelined.last.t_fwd == pytest.approx(t_fwd) and pipelined.last.t_copy == pytest.approx(t_copy)
    assert pipelined.last.t_stall == 0 and clock.now() == pytest.approx(t_fwd)
    # The next pass reads block 4, which a swap-in queued behind the swap-outs still running writes:
    # it waits for both to end (one event covers the stream, as in the engine).
    t_in = profile.t_swap(BS, "in")
    reads_it = SchedulerOutput(chunks=[ScheduledChunk("c", [1], 16, [4], True, params, 0)], swap_in=[(0, 4)])
    pipelined.run(reads_it)
    assert pipelined.last.t_stall == pytest.approx(t_copy + t_in - t_fwd)
    assert clock.now() == pytest.approx(t_copy + t_in + profile.t_fwd(1))
    # Copies done by now: a pass reading those blocks goes on; one beside a new swap-in elsewhere too.
    pipelined.run(SchedulerOutput(chunks=[ScheduledChunk("c", [1], 17, [4], True, params, 0)], swap_in=[(1, 6)]))
    assert pipelined.last.t_stall == 0
    for stalls in (ModeledRunner(profile, VirtualClock(), swap_synchronous=True),
                   ModeledRunner(replace(profile, device="cpu"), VirtualClock())):
        stalls.run(out)
        assert stalls.clock.now() == pytest.approx(t_fwd + t_copy)
    with pytest.raises(ValueError):
        VirtualClock().advance(-1)


def test_a_modeled_pass_waits_for_the_copies_that_write_its_blocks_not_for_later_ones():
    """A pass that reads a block an earlier step's swap-in still writes waits until those copies end,
    not until the end of the copies its own step queued behind them (the engine's `CopyStream` keeps
    an event per step's copies for that)."""
    profile = toy_profile(swap_blocks_per_step=2)
    clock = VirtualClock()
    runner = ModeledRunner(profile, clock)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runner.run(SchedulerOutput(chunks=[ScheduledChunk("a", [1], 16, [0, 1], True, params, 0)],
                               swap_in=[(h, 4 + h) for h in range(4)]))
    swapped_in_by = profile.t_swap(4 * BS, "in")
    now = clock.now()
    assert swapped_in_by > now  # 4 blocks against a 2-block budget: still copying after the pass
    runner.run(SchedulerOutput(chunks=[ScheduledChunk("b", [1], 16, [4, 5], True, params, 0)],
                               swap_out=[(10 + i, 10 + i) for i in range(8)], swap_in=[(20, 12)]))
    assert runner.last.t_stall == pytest.approx(swapped_in_by - now)
    assert clock.now() == pytest.approx(swapped_in_by + profile.t_fwd(1))
    # The second step's swap-in is still under way behind its swap-outs: a pass reading its block waits.
    runner.run(SchedulerOutput(chunks=[ScheduledChunk("c", [1], 16, [12], True, params, 0)]))
    assert runner.last.t_stall > 0


def test_a_modeled_step_charges_the_hosts_unhidden_time():
    """`HostCost`: a step with work costs the host's fixed time, its time a sequence, and more if it
    queues copies, on top of the device's; a step with nothing to do costs nothing. A simulated trace
    that charges it runs fewer steps in the same virtual time."""
    from infercept.engine.modeled_runner import HostCost

    profile = toy_profile(swap_blocks_per_step=2)
    host = HostCost(fixed_s=0.001, per_sequence_s=0.0002, swap_step_s=0.003)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunks = [ScheduledChunk(r, [1], 16, [i], True, params, 0) for i, r in enumerate("ab")]
    runner = ModeledRunner(profile, VirtualClock(), host_cost=host)
    runner.run(SchedulerOutput(chunks=chunks))
    assert runner.last.t_host == pytest.approx(0.0014)
    assert runner.last.seconds == pytest.approx(profile.t_fwd(2) + 0.0014)
    runner.run(SchedulerOutput(chunks=chunks, swap_out=[(5, 0)]))
    assert runner.last.t_host == pytest.approx(0.0044) and runner.last.t_stall == 0
    runner.run(SchedulerOutput(chunks=[]))
    assert runner.last.seconds == 0.0
    steps = []
    for cost in (None, HostCost(fixed_s=0.01)):
        engine = SimulatedEngine("infercept", profile, 64, 64, host_cost=cost)
        trace = [{"id": "p", "arrival": 0.0, "prompt_tokens": 40,
                  "segments": [{"decode_tokens": 200, "interception": None, "returned_tokens": 0}]}]
        steps.append(engine.run_trace(trace, until=1.0).summary()["steps"])
    assert steps[1] < steps[0]


def test_coarsened_profile_keeps_swap_budget_and_time_per_real_token():
    base = a100_gptj_6b()
    coarse = coarsen_profile(base, 8)
    assert coarse.S == base.S and coarse.block_size == base.block_size // 8
    assert coarse.t_fwd(100) == pytest.approx(8 * base.t_fwd(100))
    # The budget in bytes of one coarse iteration = the budget of the 8 real iterations it stands for.
    assert coarse.swap_budget_tokens(coarse.t_fwd(100)) * coarse.M == pytest.approx(
        8 * base.swap_budget_tokens(base.t_fwd(100)) * base.M, rel=1e-3)
    assert coarse.t_swap(10) == pytest.approx(base.t_swap(80))
    # A measured overlap says how the engine's copies ran: a coarse simulation prices them the same way.
    assert not coarsen_profile(replace(base, copy_overlap=0.02), 8).copies_overlap


def test_attention_cost_by_hand_and_in_the_runner():
    """Decode reads its context's KV (memory-bound); a prefill chunk computes q x ctx pairs; the runner
    adds both to T_fwd; a coarse simulation scales them by k^2 (k iterations over k-times-longer
    contexts); a profile saved and loaded keeps them."""
    profile, plain_profile = h100_llama3_8b(attention=True), h100_llama3_8b()
    read_s, pair_s = profile.attention_read_s_per_token, profile.attention_pair_s
    # 128 KiB per token at 80% of 3.35 TB/s; 2 x 2 x 4,096 x 32 FLOPs per pair at 60% of 989 TFLOP/s.
    assert read_s == pytest.approx(131072 / 2.68e12) and pair_s == pytest.approx(524288 / 593.4e12)
    assert not plain_profile.has_attention and plain_profile.t_attention(256, 50_000) == 0
    assert profile.t_attention(1, 50_000) == pytest.approx(50_000 * read_s)  # one decode token: the read
    assert profile.t_attention(256, 50_000) == pytest.approx(50_000 * 256 * pair_s)  # a chunk: the compute
    assert profile.t_recompute_attention(300, 3) == pytest.approx(sum(profile.t_attention(100, c) for c in (100, 200, 300)))
    assert coarsen_profile(profile, 16).t_attention(1, 100) == pytest.approx(256 * profile.t_attention(1, 100))
    assert Profile.from_json(profile.to_json()) == profile and profile.without_attention == plain_profile
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = SchedulerOutput(chunks=[ScheduledChunk("a", [1], 49_999, [0], True, params, 0),
                                  ScheduledChunk("b", [1] * 256, 20_000, [1], False, params, 0)])
    plain, with_attention = ModeledRunner(plain_profile, VirtualClock()), ModeledRunner(profile, VirtualClock())
    plain.run(out)
    with_attention.run(out)
    assert plain.last.t_fwd == pytest.approx(profile.t_fwd(257))
    assert with_attention.last.t_fwd == pytest.approx(profile.t_fwd(257) + profile.t_attention(1, 50_000)
                                                      + profile.t_attention(256, 20_256))
    assert with_attention.clock.now() == pytest.approx(with_attention.last.t_fwd)


def test_simulated_durations_are_kept_per_tool_of_each_step():
    """A program calling two tools: each pause's duration joins the history of the tool that step called."""
    trace = [{"id": "p", "arrival": 0.0, "prompt_tokens": 40, "segments": [
        {"decode_tokens": 4, "interception": {"kind": "tool", "tool": "fast", "duration_s": 0.5}, "returned_tokens": 4},
        {"decode_tokens": 4, "interception": {"kind": "tool", "tool": "slow", "duration_s": 7.0}, "returned_tokens": 4},
        {"decode_tokens": 4, "interception": {"kind": "tool", "tool": "fast", "duration_s": 0.25}, "returned_tokens": 4},
        {"decode_tokens": 4, "interception": None, "returned_tokens": 0}]}]
    engine = SimulatedEngine("infercept", a100_gptj_6b(), 64, 64)
    engine.run_trace(trace)
    estimator = engine.scheduler.estimator
    assert estimator.history("fast") == pytest.approx([0.5, 0.25], abs=0.05)
    assert estimator.history("slow") == pytest.approx([7.0], abs=0.05)


# -- decisions with numbers ----------------------------------------------------------------------------

def test_one_ms_calculator_call_is_preserved():
    """A calculator call returns after 1 ms: its KV never leaves the device, nothing is recomputed."""
    engine = SimulatedEngine("infercept", toy_profile(), num_device_blocks=64, num_host_blocks=64)
    trace = [request("calc", 0.0, 200, [(6, "calculator", 0.001, 3)] * 4 + [(6, None, 0, 0)])]
    trace += [request(f"bg{i}", 0.001 * i, 100, [(60, None, 0, 0)]) for i in range(3)]
    locations = []

    def hook(eng, result):
        eng.block_manager.check_integrity()
        if "calc" in eng.scheduler.paused:
            locations.append(eng.kv_location("calc"))

    result = engine.run_trace(trace, on_step=hook)
    assert result.num_finished == 4
    assert locations, "the calculator call never paused the request"
    # The last sampled token has no KV until the next turn computes it: at most 1 "not computed".
    assert all(loc["host"] == 0 and loc["discarded"] <= 1 for loc in locations), locations
    assert engine.stats.num_swapped_out_blocks == 0 and engine.stats.num_discarded_tokens == 0
    assert engine.stats.num_recomputed_tokens == 0
    assert_pools_empty(engine)


@pytest.mark.parametrize("hint", [None, 30.0])
def test_thirty_second_human_turn_under_pressure_leaves_the_device(hint):
    """A 30 s human turn while other requests need the pool: its KV is swapped out or discarded (by
    the policy or by reclaim) long before the human answers, and the request still finishes."""
    engine = SimulatedEngine("infercept", toy_profile(), num_device_blocks=48, num_host_blocks=32)
    engine.add_request(400, 4, request_id="human", kind="human", expected_s=hint)
    while "human" not in engine.scheduler.paused:
        engine.step()
    paused_at = engine.clock.now()
    for i in range(6):  # together they need more than the 48 - 26 free blocks
        engine.add_request(150, 40, request_id=f"o{i}", last_turn=True)
    moved_at = None
    while engine.clock.now() < paused_at + 30.0 and engine.has_work():
        engine.step()
        engine.block_manager.check_integrity()
        loc = engine.kv_location("human")
        if moved_at is None and loc["device"] == 0:
            moved_at = engine.clock.now()
    assert moved_at is not None and moved_at - paused_at < 5.0
    engine.idle_until(paused_at + 30.0)
    engine.resume("human", 20, 5, last_turn=True)
    while engine.has_work():
        engine.step()
        engine.block_manager.check_integrity()
    assert not engine.scheduler.requests  # everybody finished
    # Swapped (blocks went out) or discarded (its context was recomputed on resume). Not asserted on
    # `num_discarded_tokens`: discards made by the scheduler's reclaim path are not counted there.
    assert engine.stats.num_swapped_out_blocks > 0 or engine.stats.num_recomputed_tokens >= 400
    assert_pools_empty(engine)


@pytest.mark.parametrize("policy", ["infercept", "budgeted-swap", "heuristic-preserve"])
def test_swap_budget_is_never_exceeded(policy):
    """Every iteration's swap-out + swap-in blocks fit the budget N_i = T_swap^-1(T_fwd(B_{i-1})),
    rounded up to whole blocks (but for steps of an idle engine, which plan fresh pauses or bring a
    paused request's KV back before its resume with no forward pass to stall, and for whole contexts
    swapped out to make room under pressure: `Policy.reclaim`'s synchronous copies)."""
    profile = toy_profile(swap_blocks_per_step=2)
    engine = SimulatedEngine(policy, profile, num_device_blocks=60, num_host_blocks=40)
    trace = workload.generate_trace(2.0, num_requests=20, seed=3, context_scale=0.15, decode_scale=0.3,
                                    interception_scale=0.2, max_interceptions=3)
    prev = [1]
    violations, swapped = [], [0]

    def hook(eng, result):
        eng.block_manager.check_integrity()
        out = result.output
        sched = eng.scheduler
        if not out.chunks and not (sched.running or sched.swapped or sched.waiting):
            return  # a step with nothing to run (fresh pauses, prefetch) copies without a budget
        budget = profile.swap_budget_tokens(profile.t_fwd(prev[0]))
        blocks = len(out.swap_out) - out.num_reclaim_swap_out_blocks + len(out.swap_in)
        swapped[0] += blocks
        if blocks > math.ceil(budget / BS):
            violations.append((eng.stats.num_steps, len(out.swap_out), len(out.swap_in), budget))
        prev[0] = max(out.num_batched_tokens, 1)

    result = engine.run_trace(trace, on_step=hook)
    assert result.num_finished == len(trace)
    assert swapped[0] > 0, "the test never swapped: tighten the pool"
    assert not violations, violations[:5]
    assert_pools_empty(engine)


@pytest.mark.parametrize("policy", unique_policies())
def test_every_request_finishes_and_blocks_are_conserved(policy):
    profile = toy_profile()
    engine = SimulatedEngine(policy, profile, num_device_blocks=80, num_host_blocks=40, max_num_seqs=16)
    trace = workload.generate_trace(3.0, num_requests=25, seed=7, context_scale=0.1, decode_scale=0.2,
                                    interception_scale=0.1, max_interceptions=3)
    result = engine.run_trace(trace, on_step=integrity_hook)
    assert result.num_finished == len(trace)
    expected_tokens = sum(s["decode_tokens"] for r in trace for s in r["segments"])
    assert sum(r.output_tokens for r in result.records) == expected_tokens
    assert engine.stats.num_computed_tokens >= sum(
        r["prompt_tokens"] + sum(s["decode_tokens"] + s["returned_tokens"] for s in r["segments"]) - 1
        for r in trace)
    assert all(math.isfinite(r.normalized_latency(result.duration)) for r in result.records)
    assert_pools_empty(engine)


def _first_service_after_resume(policy: str) -> tuple[int, list[int]]:
    """A old request resumes while newer ones wait: the step at which each is first scheduled after."""
    engine = SimulatedEngine(policy, toy_profile(), num_device_blocks=40, num_host_blocks=64)
    engine.add_request(200, 4, request_id="old", kind="human")
    while "old" not in engine.scheduler.paused:
        engine.step()
    for i in range(8):  # 300-token prompts: one fits next to the old request's 13 blocks
        engine.add_request(300, 30, request_id=f"new{i}", last_turn=True)
    for _ in range(10):
        engine.step()
    engine.resume("old", 3, 4, last_turn=True)
    waiting = [r.request_id for r in engine.scheduler.waiting if r.num_computed_high == 0]
    assert waiting, "no later request is waiting: the test needs a fuller pool"
    first: dict[str, int] = {}
    step = 0
    while engine.has_work():
        out = engine.step().output
        engine.block_manager.check_integrity()
        step += 1
        for chunk in out.chunks:
            first.setdefault(chunk.request_id, step)
    assert_pools_empty(engine)
    return first["old"], [first[w] for w in waiting]


def test_resumed_request_is_served_before_later_arrivals():
    old, later = _first_service_after_resume("infercept")
    assert old <= min(later)
    # The vLLM baseline requeues it at the tail: the later arrivals go first (the paper's starvation).
    old, later = _first_service_after_resume("vllm")
    assert old > min(later)


# -- benchmarks ---------------------------------------------------------------------------------------

def test_workload_generation_is_seeded_and_consistent(tmp_path):
    a = workload.generate_trace(1.5, duration=60, seed=11)
    b = workload.generate_trace(1.5, duration=60, seed=11)
    assert a == b and a != workload.generate_trace(1.5, duration=60, seed=12)
    assert all(0 < r["arrival"] < 60 for r in a) and [r["arrival"] for r in a] == sorted(r["arrival"] for r in a)
    for r in a:
        segs = r["segments"]
        assert r["augment"] in workload.AUGMENTS and r["prompt_tokens"] >= workload.MIN_PROMPT_TOKENS
        assert len(segs) >= 2 and segs[-1]["interception"] is None
        assert all(s["interception"]["duration_s"] > 0 and s["returned_tokens"] >= 1 for s in segs[:-1])
        assert all(s["decode_tokens"] >= 1 for s in segs)
    chat = workload.generate_trace(1.0, num_requests=20, augment="chatbot", seed=1, max_context=600,
                                   max_interceptions=2, interception_scale=0.5)
    assert {r["augment"] for r in chat} == {"chatbot"}
    for r in chat:
        assert len(r["segments"]) <= 3
        total = r["prompt_tokens"] + sum(s["decode_tokens"] + s["returned_tokens"] for s in r["segments"])
        assert total <= 600
    path = tmp_path / "t.jsonl"
    workload.write_jsonl(a, path)
    assert workload.read_jsonl(path) == a
    assert "| math |" in workload.describe(workload.generate_trace(5, num_requests=60, seed=2))


def test_policy_sim_smoke_accounting():
    policy_sim = load_bench("policy_sim")
    opts = dict(setup="a100_gptj_6b", window=20.0, drain=400.0, seed=0, token_scale=8, oracle=False, saturated_s=None)
    results = {p: {r: policy_sim.run_one(p, r, opts) for r in (0.5, 1.0)} for p in ("infercept", "discard")}
    for by_rate in results.values():
        for s in by_rate.values():
            assert s["finished"] == s["requests"] > 0
            assert 0 <= s["recompute_token_share"] < 1 and 0 <= s["held_waste_pct"] <= 100
            assert s["total_waste_pct"] >= s["held_waste_pct"]
    assert results["discard"][1.0]["recompute_token_share"] > results["infercept"][1.0]["recompute_token_share"]
    text = policy_sim.report(results, ["infercept", "discard"], [0.5, 1.0],
                             dict(opts, slo=None, saturated_s=1.0, ablation_rate=1.0), 0.0)
    assert "## Sustainable load" in text and "| infercept |" in text
    assert policy_sim.unique_policies().count("discard") == 1 and "vllm" not in policy_sim.unique_policies()


def test_engine_trace_smoke_with_the_real_model():
    """A handful of agent requests through the real Engine (embedded model), each policy side by side."""
    if not os.environ.get("INFERCEPT_CACHE") and not Path.home().joinpath(".cache", "infercept").exists():
        pytest.skip("no model cache")
    engine_trace = load_bench("engine_trace")
    rows = engine_trace.smoke(policies=("infercept", "discard"))
    for row in rows:
        assert row["finished"] == row["requests"] > 0
        assert row["output_tokens"] == row["expected_output_tokens"]
        assert row["leaked_blocks"] == 0
    assert rows[1]["recompute_token_share"] > 0  # discard recomputes every resumed context
