"""The policy parts beyond the paper, each without a model: `infercept-paper` pinned, the program-level queue
order (`Policy.priority`), expected waste over the remaining-time distribution, and their names."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from infercept.engine.policy import (DurationEstimator, IterationInfo, KVAction, PausedInfo, Profile,
                                     make_policy, min_waste_plan)
from infercept.engine.policy.expected_waste import best_ttl_waste, expected_swap_waste
from infercept.engine.policy.policies import InferCeptPaperPolicy
from infercept.engine.simulation import SimulatedEngine


def toy_profile(**overrides) -> Profile:
    """As in test_policy: T_fwd flat at 10 ms up to 100 tokens, then +0.1 ms per token (T_fwd(150) =
    15 ms); M = 10 B; 1 MB/s both ways; S = 150; blocks of 10 tokens."""
    fields = dict(model="toy", device="cpu", dtype="float32", bytes_per_token=10, block_size=10,
                  t_fwd_samples=((1, 0.01), (100, 0.01), (200, 0.02), (400, 0.04)),
                  d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6, saturation_point=150)
    fields.update(overrides)
    return Profile(**fields)


def paused(rid, C, remaining, elapsed=0.0, arrival=0.0) -> PausedInfo:
    remaining = tuple(remaining)
    return PausedInfo(rid, arrival, C, "device", C, elapsed, sum(remaining) / len(remaining), remaining)


BIMODAL = [0.01] * 9 + [6.0]  # nine calls in ten return in 10 ms, one waits 6 s: mean 0.609 s


# -- names ----------------------------------------------------------------------------------------

def test_paper_policy_is_selectable_and_parts_chain():
    assert make_policy("infercept-paper").label == "infercept-paper"
    assert type(make_policy("infercept-paper")) is InferCeptPaperPolicy
    p = make_policy("infercept-paper+las-priority+expected-waste")
    assert (p.priority, p.expected_waste, p.preemption) == ("las", True, "swap")
    assert p.label == "infercept-paper+las-priority+expected-waste"
    assert make_policy(p.label).label == p.label
    assert make_policy("prefix-cache+program-arrival-priority").priority == "program-arrival"
    assert make_policy("infercept+recompute-preemption").preemption == "recompute"
    with pytest.raises(ValueError, match="expected-waste"):
        make_policy("infercept-paper+fastest")
    # The paper's policy keeps the paper's order and mean-residual decisions.
    paper = make_policy("infercept-paper")
    assert (paper.priority, paper.expected_waste, paper.keeps_arrival_time, paper.chunked_recompute) == \
        ("arrival", False, True, True)


def test_default_infercept_is_a_measured_combination_of_parts():
    """`infercept` is `infercept-paper` with the parts benchmarks/README.md's table supports, so its row
    there (under the combination's name) is the default's."""
    default = make_policy("infercept")
    assert isinstance(default, InferCeptPaperPolicy)
    combination = make_policy("infercept-paper+expected-waste+prefetch+deferred-swap")
    assert (default.priority, default.expected_waste, default.prefetch, default.preemption, default.lazy_discard,
            default.context_cost, default.admission, default.deferred_swap) == \
        (combination.priority, combination.expected_waste, combination.prefetch, combination.preemption,
         combination.lazy_discard, combination.context_cost, combination.admission, combination.deferred_swap)
    assert make_policy("infercept+no-deferred-swap").label == "infercept+no-deferred-swap"
    # ... and +ample-preserve where copies stall the forward pass (a CPU profile), +ample-no-discard where
    # they overlap it (a GPU's).
    assert default.ample_preserve == "by-copy-overlap" and not combination.ample_preserve
    assert make_policy("infercept+no-ample-preserve").label == "infercept+no-ample-preserve"
    assert make_policy("infercept+ample-preserve").ample_preserve is True
    for name in ("infercept+ample-no-discard", "infercept-paper+ample-no-discard"):
        assert make_policy(name).ample_preserve == "no-discard" and make_policy(name).label == name


# -- ample memory ---------------------------------------------------------------------------------

def test_ample_memory_preserves_what_the_waste_rule_would_swap_or_discard():
    """A 10 s call with a swap budget: the waste rule swaps it out, and discards one that does not fit the
    budget. With room for all queued work (`spare_device_tokens` >= 0) the default keeps both; with
    less room, or none reported, it plans as the waste rule does. (Without deferred swaps, which would
    keep the second for the next budget: `test_deferred_swap_*`.)"""
    p = toy_profile()
    reqs = [paused("a", 200, [10.0]), paused("b", 200, [10.0], arrival=1.0)]
    rule = make_policy("infercept+no-ample-preserve+no-deferred-swap")
    default = make_policy("infercept+no-deferred-swap")

    def actions(policy, spare):
        plan = policy.plan(reqs, IterationInfo(300, 50, 200, spare_device_tokens=spare), p)
        return [plan.action(r.request_id) for r in reqs]

    assert actions(rule, 0) == [KVAction.SWAP_OUT, KVAction.DISCARD]
    assert actions(default, 0) == [KVAction.PRESERVE, KVAction.PRESERVE]
    assert actions(default, -1) == actions(rule, -1) == actions(default, None)
    # Where copies overlap the forward pass (a GPU profile) the default swaps within the budget anyway
    # and keeps only what the rule would discard; +ample-preserve keeps the KV on any device.
    p = toy_profile(device="NVIDIA H100 80GB HBM3")
    assert actions(default, 0) == [KVAction.SWAP_OUT, KVAction.PRESERVE]
    assert actions(default, -1) == actions(rule, -1)
    keeps_all = make_policy("infercept+ample-preserve+no-deferred-swap")
    assert actions(keeps_all, 0) == [KVAction.PRESERVE, KVAction.PRESERVE]


@pytest.mark.parametrize("base", ["infercept", "infercept-paper"])
def test_ample_no_discard_preserves_what_the_waste_rule_would_discard(base):
    """No swap budget: the waste rule discards a 10 s call (preserving 200 tokens for 10 s wastes more
    than recomputing them). +ample-no-discard keeps it while the pool has room for all queued work, on
    a GPU profile too, and discards it as the rule does once that room is gone or not reported. (Without
    deferred swaps, which would keep it for the next budget.)"""
    p = toy_profile(device="NVIDIA H100 80GB HBM3")
    reqs = [paused("a", 200, [10.0])]
    rule = make_policy(base + "+no-ample-preserve+no-deferred-swap")
    part = make_policy(base + "+ample-no-discard+no-deferred-swap")

    def action(policy, spare):
        return policy.plan(reqs, IterationInfo(300, 50, 0, spare_device_tokens=spare), p).action("a")

    assert action(rule, 0) is KVAction.DISCARD
    assert action(part, 0) is KVAction.PRESERVE
    assert action(part, -1) is action(part, None) is KVAction.DISCARD


@pytest.mark.parametrize("base", ["infercept", "infercept-paper"])
def test_ample_no_discard_still_swaps_within_the_budget(base):
    """A budget for both 10 s calls: the waste rule swaps both out, and so does +ample-no-discard with
    ample memory (a budgeted swap overlaps the forward pass on a GPU), where +ample-preserve keeps them."""
    p = toy_profile(device="NVIDIA H100 80GB HBM3")
    reqs = [paused("a", 200, [10.0]), paused("b", 200, [10.0], arrival=1.0)]

    def plan(policy):
        return policy.plan(reqs, IterationInfo(300, 50, 400, spare_device_tokens=0), p)

    swapped = plan(make_policy(base + "+no-ample-preserve"))
    assert [d.action for d in swapped] == [KVAction.SWAP_OUT, KVAction.SWAP_OUT]
    assert plan(make_policy(base + "+ample-no-discard")) == swapped
    assert [d.action for d in plan(make_policy(base + "+ample-preserve"))] == [KVAction.PRESERVE] * 2


def agents(n: int, tool_s: float = 0.1) -> list[dict]:
    """n agents at once, 40-token prompts, four turns with `tool_s` tools between them."""
    return [{"id": f"p{i}", "augment": "test", "arrival": 0.001 * i, "prompt_tokens": 40,
             "segments": [{"decode_tokens": 3, "interception": {"kind": "tool", "tool": "t", "duration_s": tool_s},
                           "returned_tokens": 4}] * 3 + [{"decode_tokens": 2, "interception": None,
                                                           "returned_tokens": 0}]}
            for i in range(n)]


def test_with_ample_memory_every_resume_finds_its_kv_on_the_device():
    """12 agents in a 200-block pool (they need 70). The waste rule alone swaps paused agents out
    and back in for nothing (on a CPU the copies stall the forward pass); the default keeps them all. In a
    pool they do not fit in, the default still moves paused KV off the device."""
    def run(policy, device_blocks):
        engine = SimulatedEngine(policy, toy_profile(), device_blocks, 200)
        summary = engine.run_trace(agents(12)).summary()
        engine.block_manager.check_integrity()
        return engine, summary

    rule, _ = run("infercept+no-ample-preserve", 200)
    assert rule.stats.num_swapped_out_blocks > 0
    default, summary = run("infercept", 200)
    assert summary["finished"] == 12
    assert default.stats.num_swapped_out_blocks == 0 and default.stats.num_discarded_tokens == 0
    assert default.stats.resumes_by_kv == {"device": 36, "host": 0, "recompute": 0}
    tight, summary = run("infercept", 40)
    assert summary["finished"] == 12
    assert tight.stats.num_swapped_out_blocks + tight.stats.num_discarded_tokens > 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.floats(0, 60), st.sampled_from(["device", "partial"])),
                max_size=8),
       st.integers(0, 5000), st.integers(0, 20_000), st.integers(0, 512))
def test_paper_policy_plans_the_paper_min_waste(items, budget, running, batched):
    reqs = [PausedInfo(f"r{i}", float(i), C, state, C if state == "device" else max(C // 2, 1), 0.0, e)
            for i, (C, e, state) in enumerate(items) if state == "device" or C > 1]
    it = IterationInfo(running, batched, budget)
    assert make_policy("infercept-paper").plan(reqs, it, toy_profile()) == min_waste_plan(reqs, it, toy_profile())


# -- durations as distributions -------------------------------------------------------------------

def test_best_ttl_waste_by_hand():
    # C·M = 2000 B. τ = 0.01: E[min(R, τ)] = 0.01 -> 20, plus P(R > τ) = 0.1 of 110 -> 31.
    # τ = 6: E[R] = 0.609 -> 1218 (Eq. 2 at the mean). The best is 31.
    assert best_ttl_waste(BIMODAL, 200, 10, 110.0) == pytest.approx(31.0)
    assert best_ttl_waste([0.5], 200, 10, 1.0) == pytest.approx(1000.0)  # one point: Eq. 2
    # Ties count together: two samples at 1 s, P(R > 1) = 0.
    assert best_ttl_waste([1.0, 1.0], 10, 1, 5.0) == pytest.approx(10.0)


def test_context_cost_counts_the_attention_a_recompute_spends():
    """C = 200 in chunks of 100 (S 150 - 50 batched), 300 running tokens, 1 us per (query, context) token
    pair: the recompute's attention is 100·100 + 100·200 pairs = 30 ms. Eq. 4 as the paper writes it:
    0.02·2000/2 + 2·0.01·3000 = 80 B·s; with the attention, (0.02 + 0.03)·1000 + (0.02 + 0.03)·3000 =
    200. A 60 ms call: preserving wastes 120, so the paper discards and +context-cost preserves. A
    profile without attention terms decides alike under both."""
    it, call = IterationInfo(300, 50, swap_out_budget=0), paused("a", 200, [0.06])
    with_attention = toy_profile(attention_pair_s=1e-6)
    paper = make_policy("infercept-paper").plan([call], it, with_attention).get("a")
    aware = make_policy("infercept-paper+context-cost").plan([call], it, with_attention).get("a")
    assert paper.action is KVAction.DISCARD and paper.waste_discard == pytest.approx(80.0)
    assert aware.action is KVAction.PRESERVE and aware.waste_discard == pytest.approx(200.0)
    assert aware.waste_preserve == pytest.approx(120.0)
    assert make_policy("infercept-paper+context-cost").plan([call], it, toy_profile()).action("a") is KVAction.DISCARD


def test_expected_waste_preserves_a_usually_short_call_the_mean_would_discard():
    """C = 200 with 300 running tokens, chunks of 150 - 50 = 100: Eq. 4 = 20 + 60 = 80 B·s; the
    discarded context resumes one chunk (T_fwd(150) = 15 ms) late: + 0.015·2000 = 30, so 110. The
    paper's rule: 0.609 s of 2000 B = 1218 > 80: discard. Expected waste: preserve for 10 ms (31), and
    once the 10 ms have passed only the 6 s call is left (5.99 s of 2000 B): discard."""
    p, it = toy_profile(), IterationInfo(300, 50, swap_out_budget=0)
    fresh = paused("a", 200, BIMODAL)
    assert min_waste_plan([fresh], it, p).action("a") is KVAction.DISCARD
    plan = make_policy("infercept-paper+expected-waste").plan([fresh], it, p)
    d = plan.get("a")
    assert d.action is KVAction.PRESERVE
    assert (d.waste_preserve, d.waste_discard) == (pytest.approx(31.0), pytest.approx(110.0))
    later = paused("a", 200, [6.0 - 0.011], elapsed=0.011)
    assert make_policy("infercept-paper+expected-waste").plan([later], it, p).action("a") is KVAction.DISCARD


def test_expected_waste_counts_the_swap_a_short_call_outruns():
    """Copies at 10 kB/s: T_swap(200) = 0.2 s each way, a 0.4 s round trip. Nine calls in ten are back
    after 0.1 s and wait out 0.3 s of it, and the swap-in outlasts its 10 ms iteration by 0.19 s:
    (0.27 + 0.19)·2000 = 920 B·s, more than discarding (110). The paper's rule swaps (E[R] = 1.09 s
    exceeds the round trip, and a budgeted swap costs nothing). Copies that stall the batch (no
    overlap) add Eq. 3: 2 x 0.2 s x (300 running + 200) tokens x 10 B = 2000 B·s."""
    slow = toy_profile(d2h_bytes_per_s=1e4, h2d_bytes_per_s=1e4, copy_overlap=1.0)
    it = IterationInfo(300, 50, swap_out_budget=1000)
    info = paused("a", 200, [0.1] * 9 + [10.0])
    assert expected_swap_waste(info, slow, slow.t_fwd(50), 300) == pytest.approx(920.0)
    stalled = toy_profile(d2h_bytes_per_s=1e4, h2d_bytes_per_s=1e4, copy_overlap=0.0)
    assert expected_swap_waste(info, stalled, stalled.t_fwd(50), 300) == pytest.approx(2920.0)
    assert min_waste_plan([info], it, slow).action("a") is KVAction.SWAP_OUT
    assert make_policy("infercept-paper+expected-waste").plan([info], it, slow).action("a") is KVAction.DISCARD
    # Even a call that surely outlasts the round trip is not swapped at these speeds: its swap-in alone
    # delays the resume by 0.19 s (380 B·s) where a recompute takes one more 15 ms iteration (30).
    long = paused("b", 200, [10.0, 12.0])
    assert make_policy("infercept-paper+expected-waste").plan([long], it, slow).action("b") is KVAction.DISCARD
    # At 1 MB/s the copies hide behind the iteration: swapped, as the paper's rule does; where they stall
    # the batch too (2 x 2 ms x 500 tokens x 10 B = 20 B·s, less than the 110 of a discard).
    for overlap in (1.0, 0.0):
        fast = toy_profile(copy_overlap=overlap)
        assert make_policy("infercept-paper+expected-waste").plan([long], it, fast).action("b") is KVAction.SWAP_OUT


def test_estimator_remaining_is_the_conditioned_history():
    est = DurationEstimator(min_history=3)
    assert est.remaining(5.0, 4.0, "t") == (1.0,)  # no history: the elapsed time (paper §4.4)
    for d in (0.1, 0.2, 3.0):
        est.observe("t", d)
    assert est.remaining(0.15, 0.0, "t") == pytest.approx((0.05, 2.85))
    assert sum(est.remaining(0.15, 0.0, "t")) / 2 == pytest.approx(est.estimate(0.15, 0.0, "t"))
    assert est.remaining(1.0, 0.0, "t", hint_seconds=4.0) == (2.0,)  # the history wins over a hint
    assert est.remaining(3.5, 0.0, "t", hint_seconds=4.0) == (0.5,)  # past the history: the hint
    assert est.remaining(4.0, 0.0, "t") == (4.0,)  # outlived the history: back to the elapsed time


@st.composite
def guarded_cases(draw):
    C = draw(st.integers(10, 3000))
    samples = draw(st.lists(st.floats(0.001, 30.0), min_size=1, max_size=8))
    running = draw(st.integers(0, 40_000))
    batched = draw(st.integers(1, 600))
    return C, samples, running, batched


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=guarded_cases(), shrink=st.floats(0, 0.999), later_running=st.integers(0, 40_000),
       later_batched=st.integers(1, 600), room=st.booleans())
def test_expected_waste_guard_is_sound(case, shrink, later_running, later_batched, room):
    """A preserve under `expected_waste_guard` stands at every later plan until the estimate jumps:
    several samples all shrink by the same Δ (less than the shortest), one point may go anywhere below
    the guard's bound; the running KV stays at least the guard's floor; any batch; with swap room only
    while the iteration and the expected time stay below the swap bounds."""
    C, samples, running, batched = case
    p = toy_profile()
    policy = make_policy("infercept-paper+expected-waste")
    info = paused("a", C, samples)
    it = IterationInfo(running, batched, swap_out_budget=0)
    assume(policy.plan([info], it, p).action("a") is KVAction.PRESERVE)
    guard = policy.preserve_guard(info, it, p)
    assume(guard is not None and info.expected_s < guard.expected_s)
    if len(samples) == 1:
        later_samples = [shrink * guard.expected_s]
    else:
        later_samples = [s - shrink * min(samples) for s in samples]
    later = paused("a", C, later_samples, elapsed=shrink)
    assume(later_running >= guard.min_running_tokens)
    swap_ok = room and p.t_fwd(later_batched) < guard.swap_iteration_s and later.expected_s < guard.swap_expected_s
    budget = 10_000 if swap_ok else 0
    later_it = IterationInfo(later_running, later_batched, swap_out_budget=budget)
    assert policy.plan([later], later_it, p).action("a") is KVAction.PRESERVE


def test_a_long_context_with_a_spread_history_is_guarded_by_its_least_recompute_delay():
    """A 2,048-token context on the H100 profile, six past calls of 0.1-1.1 s, 40,000 tokens running:
    preserved, and guarded (no plan until the estimate jumps or the running KV halves). Discard's waste
    floor in the guard counts the resume's wait for the recompute's chunks before the last (at least
    ceil(2048 / 256) - 1 = 7 iterations at the saturation point, 59 ms); without it the floor was below
    the best TTL's waste and the context was planned every step, as were most long contexts paused
    beside a busy batch (the GPU check's trace)."""
    from infercept.engine.policy.expected_waste import least_resume_delay_discard
    from infercept.engine.policy.profile import h100_llama3_8b

    p = h100_llama3_8b()
    info = paused("a", 2048, [0.1 + 0.2 * i for i in range(6)])
    it = IterationInfo(40_000, 256, swap_out_budget=0)
    policy = make_policy("infercept")
    assert policy.plan([info], it, p).action("a") is KVAction.PRESERVE
    assert least_resume_delay_discard(2048, p) == pytest.approx(7 * p.t_fwd(256))
    guard = policy.preserve_guard(info, it, p)
    assert guard is not None and guard.min_running_tokens == 20_000


def test_while_memory_is_ample_a_preserve_that_only_a_swap_could_replace_is_guarded():
    """The default on a GPU profile keeps what it would discard while the device pool holds all queued
    work (`ample_preserve`). A 2,048-token context whose tool takes 30 s would be discarded under
    pressure (the host pool full); while memory is ample it is preserved, and guarded until memory stops being ample, or, in
    an iteration with swap room, its swap may pay (expected time or iteration past the round trip):
    planned again at once here, where 30 s is past it."""
    from infercept.engine.policy.budget import swap_round_trip
    from infercept.engine.policy.profile import h100_llama3_8b

    p = h100_llama3_8b()
    info = paused("a", 2048, [30.0])
    policy = make_policy("infercept")
    tight = IterationInfo(40_000, 256, swap_out_budget=0, free_host_tokens=0, spare_device_tokens=-1)  # no swap
    assert policy.plan([info], tight, p).action("a") is KVAction.DISCARD
    ample = dataclasses.replace(tight, spare_device_tokens=100_000)
    assert policy.plan([info], ample, p).action("a") is KVAction.PRESERVE
    guard = policy.preserve_guard(info, ample, p)
    assert guard.while_ample and guard.expected_s == math.inf and guard.min_running_tokens == 0
    assert guard.swap_expected_s == guard.swap_iteration_s == swap_round_trip(info, p) < info.expected_s


# -- program-level priority -----------------------------------------------------------------------

def _sim_profile() -> Profile:
    """Iterations of 10 ms up to 64 tokens, the budget S = 64; copies fast."""
    return Profile(model="toy", device="sim", dtype="float16", bytes_per_token=100, block_size=16,
                   t_fwd_samples=((1, 0.010), (64, 0.012), (128, 0.020)), d2h_bytes_per_s=1e12,
                   h2d_bytes_per_s=1e12, saturation_point=64)


def _agent(rid, arrival, prompt, steps, returned=192, tool_s=0.05):
    return {"id": rid, "augment": "t", "arrival": arrival, "prompt_tokens": prompt,
            "segments": [{"decode_tokens": 2,
                          "interception": {"kind": "tool", "tool": "t", "duration_s": tool_s} if j < steps - 1 else None,
                          "returned_tokens": returned if j < steps - 1 else 0} for j in range(steps)]}


@pytest.mark.parametrize("policy", ["infercept-paper", "infercept-paper+las-priority",
                                    "infercept-paper+program-arrival-priority"])
def test_program_priority_orders_a_resumed_turn_against_a_new_program(policy):
    """Agent A pauses after its first turn; its tool returns 192 tokens (three iterations of the 64-token
    budget) just as program B arrives with a 192-token prompt. The paper's order (A arrived first, and
    running requests go first) and program arrival finish A's turn before B's first token; least
    attained service (B has had nothing, A its first turn) serves B first."""
    probe = SimulatedEngine("infercept-paper", _sim_profile(), num_device_blocks=200, num_host_blocks=200)
    resume_at = probe.run_trace([_agent("A", 0.0, 32, 2)]).records[0].turn_starts[1]  # A's tool result
    engine = SimulatedEngine(policy, _sim_profile(), num_device_blocks=200, num_host_blocks=200)
    result = engine.run_trace([_agent("A", 0.0, 32, 2), _agent("B", resume_at, 192, 1)])
    a, b = sorted(result.records, key=lambda r: r.request_id)
    assert a.turn_starts[1] == resume_at and a.finish is not None and b.finish is not None
    a_resumed_first_token = a.turn_starts[1] + a.turn_ttfts[1]
    if policy.endswith("las-priority"):
        assert b.first_token < a_resumed_first_token
    else:
        assert a_resumed_first_token < b.first_token


def test_las_key_counts_service_and_program_arrival_survives_a_requeue():
    """The queue key: (service tokens, program arrival) under las; program arrival under
    program-arrival even when the policy requeues a resumed turn at the tail (prefix-cache)."""
    from infercept.engine.block_manager import BlockManager
    from infercept.engine.config import SchedulerConfig
    from infercept.engine.request import Request
    from infercept.engine.sampling_params import SamplingParams
    from infercept.engine.scheduler import Scheduler

    def sched(name):
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), BlockManager(64, 64, 16),
                         make_policy(name), _sim_profile(), clock=lambda: 100.0)

    old = Request("old", [1] * 40, SamplingParams(max_tokens=4), arrival_time=1.0)
    old.num_service_tokens = 500
    new = Request("new", [2] * 40, SamplingParams(max_tokens=4), arrival_time=50.0)
    s = sched("infercept-paper+las-priority")
    s.add(old)
    s.add(new)
    assert [r.request_id for r in s.waiting] == ["new", "old"]
    assert old.priority == (0, 500, 1.0)  # (the request's own priority first)
    s = sched("infercept-paper")
    old2 = Request("old", [1] * 40, SamplingParams(max_tokens=4), arrival_time=1.0)
    old2.num_service_tokens = 500
    s.add(Request("new", [2] * 40, SamplingParams(max_tokens=4), arrival_time=50.0))
    s.add(old2)
    assert [r.request_id for r in s.waiting] == ["old", "new"]
    requeued = Request("r", [3] * 40, SamplingParams(max_tokens=4), arrival_time=1.0)
    requeued.arrival_time = 99.0  # prefix-cache's resume: a new request at the tail
    assert sched("prefix-cache+program-arrival-priority")._priority(requeued) == (0, 1.0)
    assert sched("prefix-cache")._priority(requeued) == (0, 99.0)


def test_a_requests_own_priority_goes_before_the_policys_order():
    """vLLM's `priority` (lower first) orders every queue ahead of the policy's rule: a later request of
    priority -1 is admitted before an earlier one of 0, under arrival order and under las alike; when the
    pool runs out, the running request of the highest priority value gives way, though it is older."""
    from infercept.engine.block_manager import BlockManager
    from infercept.engine.config import SchedulerConfig
    from infercept.engine.request import Request, RequestStatus
    from infercept.engine.sampling_params import SamplingParams
    from infercept.engine.scheduler import Scheduler

    def sched(name, device_blocks=64, max_seqs=1):
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs),
                         BlockManager(device_blocks, 64, 16), make_policy(name), _sim_profile(), clock=lambda: 100.0)

    for name in ("infercept-paper", "infercept-paper+las-priority"):
        s = sched(name)
        s.add(Request("early", [1] * 40, SamplingParams(max_tokens=4), arrival_time=1.0))
        s.add(Request("urgent", [2] * 40, SamplingParams(max_tokens=4, priority=-1), arrival_time=50.0))
        assert [r.request_id for r in s.waiting] == ["urgent", "early"], name
        out = s.schedule()
        assert [r.request_id for r in s.running] == ["urgent"], name
        assert out.num_preempted == 0
    # Four blocks: both requests' prompts fit (two blocks each), their decodes do not.
    s = sched("infercept-paper", device_blocks=4, max_seqs=2)
    old = Request("old", [1] * 32, SamplingParams(max_tokens=40, priority=1), arrival_time=1.0)
    new = Request("new", [2] * 32, SamplingParams(max_tokens=40), arrival_time=2.0)
    s.add(old)
    s.add(new)
    s.schedule()
    assert {r.request_id for r in s.running} == {"old", "new"}
    for r in (old, new):  # each computed its prompt and sampled a token: its next one needs a third block
        r.num_computed_tokens = 32
        r.token_ids.append(7)
    s.schedule()
    assert old.status is not RequestStatus.RUNNING and new.status is RequestStatus.RUNNING  # (old: swapped out)


# -- proactive swap-in ------------------------------------------------------------------------------

def test_prefetched_kv_stays_while_its_resume_looks_imminent():
    """At 1 MB/s T_swap(200) = 2 ms: a resume expected in 5 ms (< 2 ms + the 10 ms iteration) is
    imminent. The paper's plan swaps such a request out (its 10 ms iteration exceeds the 4 ms round
    trip); with prefetch, KV brought back for it stays, and a request that was not prefetched is
    planned as before."""
    from infercept.engine.policy.budget import resume_imminent
    p, it = toy_profile(), IterationInfo(300, 50, swap_out_budget=1000)
    back = PausedInfo("a", 0.0, 200, "device", 200, 0.5, 0.005, prefetched=True)
    assert resume_imminent(back.expected_s, p, p.t_fwd(50), 200)
    assert not resume_imminent(0.02, p, p.t_fwd(50), 200)
    assert make_policy("infercept-paper").plan([back], it, p).action("a") is KVAction.SWAP_OUT
    prefetching = make_policy("infercept-paper+prefetch")
    assert prefetching.plan([back], it, p).action("a") is KVAction.PRESERVE
    assert prefetching.preserve_guard(back, it, p) is None  # planned every step while it is kept
    not_back = PausedInfo("c", 0.0, 200, "device", 200, 0.5, 0.005)
    assert prefetching.plan([back, not_back], it, p).ids(KVAction.SWAP_OUT) == ["c"]


def _fixed_tool_agents(n, gap, tool_s=0.5):
    return [{"id": f"a{i}", "augment": "t", "arrival": gap * i, "prompt_tokens": 1000,
             "segments": [{"decode_tokens": 32,
                           "interception": {"kind": "tool", "tool": "t", "duration_s": tool_s} if j < 4 else None,
                           "returned_tokens": 32 if j < 4 else 0} for j in range(5)]} for i in range(n)]


def test_prefetch_brings_predictable_resumes_back_before_they_arrive():
    """Eight agents on the H100 profile, a tool that always takes 0.5 s: min-waste swaps every paused
    context out (the copies hide behind the iterations), so no resume finds its KV on the device; with
    proactive swap-in every resume after the tool's first three calls (the history it needs) does."""
    from infercept.engine.policy.profile import h100_llama3_8b
    shares = {}
    for name in ("infercept-paper", "infercept-paper+prefetch"):
        engine = SimulatedEngine(name, h100_llama3_8b(), num_device_blocks=4000, num_host_blocks=4000)
        result = engine.run_trace(_fixed_tool_agents(8, 0.3))
        assert result.num_finished == 8
        engine.block_manager.check_integrity()
        assert sum(engine.stats.resumes_by_kv.values()) == 32
        shares[name] = engine.stats.resumes_on_device_share
    assert shares["infercept-paper"] == 0.0
    assert shares["infercept-paper+prefetch"] >= 27 / 32


def test_prefetch_on_a_cpu_acts_a_full_step_ahead():
    """Steps of 50-800 ms as on this machine's CPU, a 4 s tool, twelve agents in a pool that holds about
    seven contexts: the paused ones are swapped out. Proactive swap-in must start a full step (the step
    budget's forward time) before the expected resume: with the last batch's forward time as the lead
    (the first rule) 13 of 48 resumes found their KV back in time here, with a full step 31, and 44 once
    an idle engine also woke for it and the budget counted whole blocks (the first three pauses have no
    history to predict from). Nothing is recomputed either way."""
    from test_event_driven_plan import cpu_like_profile

    results = {}
    for name in ("infercept+no-prefetch", "infercept"):
        engine = SimulatedEngine(name, cpu_like_profile(), num_device_blocks=600, num_host_blocks=4000)
        assert engine.run_trace(_fixed_tool_agents(12, 1.0, tool_s=4.0)).num_finished == 12
        engine.block_manager.check_integrity()
        assert engine.stats.num_swapped_out_blocks > 0 and engine.stats.num_recomputed_tokens == 0
        results[name] = engine.stats.resumes_by_kv
    assert results["infercept+no-prefetch"]["device"] <= 8
    assert results["infercept"]["device"] >= 40 and results["infercept"]["recompute"] == 0


def test_prefetch_lead_covers_steps_longer_than_the_profile_says():
    """A measured profile times the forward pass without attention; real decode steps over long contexts
    run longer. The lead is the longest recent measured step (`Scheduler.step_lead_s`), at least the
    profile's full-budget forward: here, with attention in the runner but not in the scheduler's
    profile, a profile-only lead gained about nothing over no prefetch (21 and 20 of 48 resumes on the
    device), the measured lead 33."""
    from test_event_driven_plan import cpu_like_profile
    planned = cpu_like_profile()
    runs = dataclasses.replace(planned, attention_read_s_per_token=2e-4)
    results = {}
    for name in ("infercept+no-prefetch", "infercept"):
        engine = SimulatedEngine(name, runs, num_device_blocks=600, num_host_blocks=4000)
        engine.scheduler.profile = planned  # what the policy believes; the runner takes `runs`' time
        assert engine.run_trace(_fixed_tool_agents(12, 1.0, tool_s=4.0)).num_finished == 12
        engine.block_manager.check_integrity()
        assert engine.stats.num_recomputed_tokens == 0
        results[name] = engine.stats.resumes_by_kv["device"]
    assert results["infercept"] >= results["infercept+no-prefetch"] + 8


def _paused_on_host(engine, request_ids):
    """Step until every request paused and the policy planned the pauses, then move each one's KV to
    the host (as a swap-out would)."""
    while engine.has_work() or not all(rid in engine.scheduler.paused for rid in request_ids):
        engine.step()
    for rid in request_ids:
        engine.block_manager.swap_out(rid, len(engine.block_manager.block_table(rid)))
        engine.scheduler._kv_moved(engine.scheduler.paused[rid])
    engine.block_manager.copies_done()


def test_prefetch_on_an_idle_engine_wakes_for_it():
    """Nothing runs while two agents wait for their tools: the engine still steps when their predicted
    resumes come near (`Scheduler.idle_wake_s`: on the real server 8 of 96 resumes found their KV on
    the host because the idle engine never stepped), and brings both contexts back."""
    from test_event_driven_plan import cpu_like_profile
    engine = SimulatedEngine("infercept", cpu_like_profile(), num_device_blocks=100, num_host_blocks=100)
    ids = [engine.add_request(17, 1, request_id=f"a{i}", expected_s=5.0) for i in range(2)]
    _paused_on_host(engine, ids)
    assert not engine.has_work()
    wake = engine.scheduler.idle_wake_s()
    assert wake is not None and 3.0 < wake < 5.0
    engine.idle_until(engine.clock.now() + wake)
    assert engine.has_work()
    engine.step()
    assert [engine.scheduler.kv_tokens(engine.scheduler.paused[rid]) for rid in ids] == [(17, 0), (17, 0)]
    engine.block_manager.check_integrity()


def test_prefetch_brings_whole_contexts_back_within_the_budget():
    """Two paused contexts of 17 tokens (a full block and one token) come back while another request
    decodes, so the step's swap budget is the swap-in demand: summed in tokens (34: 3 blocks) it left the
    second context a block short on the host (5 of 96 resumes on the real server)."""
    from test_event_driven_plan import cpu_like_profile
    engine = SimulatedEngine("infercept", cpu_like_profile(), num_device_blocks=100, num_host_blocks=100)
    ids = [engine.add_request(17, 1, request_id=f"a{i}", expected_s=5.0) for i in range(2)]
    _paused_on_host(engine, ids)
    engine.add_request(17, 400, request_id="busy")
    while any(engine.scheduler.kv_tokens(engine.scheduler.paused[rid])[1] for rid in ids):
        assert engine.clock.now() < 6.0, "never prefetched"
        out = engine.step().output
        assert out.chunks, "the engine is busy: every prefetch step runs the decode"
    assert [engine.scheduler.kv_tokens(engine.scheduler.paused[rid]) for rid in ids] == [(17, 0), (17, 0)]
    assert len(out.swap_in) == 4  # both in one step
    engine.block_manager.check_integrity()


def test_prefetch_waits_for_the_expected_resume_not_the_soonest_possible_one():
    """A heavy-tailed tool: one past call that outlasted this pause ends in 0.1 s, another in 10 s. The
    expected resume (5 s away) is not imminent; acting on the soonest one would hold every such pause's
    KV on the device (simulated six-augment mix: 23% of forward time recomputed, against 0.6%)."""
    from infercept.engine.policy.budget import resume_imminent
    p = toy_profile()
    heavy = PausedInfo("a", 0.0, 200, "host", 0, 1.0, 5.05, remaining_s=(0.1, 10.0))
    assert not resume_imminent(heavy.expected_s, p, 0.2, 200)
    assert resume_imminent(0.1, p, 0.2, 200)


def test_tool_history_records_the_pause_until_the_result_arrived_not_until_the_engine_got_to_it():
    """A resume reaches the scheduler after the step in flight; the tool's history must hold how long
    the tool took (pause to the result's arrival), or proactive swap-in, timed by it, starts late."""
    engine = SimulatedEngine("infercept", toy_profile(), num_device_blocks=100, num_host_blocks=100)
    rid = engine.add_request(40, 2, request_id="a", kind="t")
    while rid not in engine.scheduler.paused:
        engine.step()
    paused_at = engine.scheduler.paused[rid].paused_at
    engine.idle_until(paused_at + 1.5)
    engine.scheduler.resume(rid, [1], result_at=paused_at + 1.0)
    assert engine.scheduler.estimator.history("t") == [pytest.approx(1.0)]


# -- deferred swap --------------------------------------------------------------------------------

def test_deferred_swap_keeps_a_context_for_the_budget_a_step_later():
    """C = 200 with 300 running tokens: Eq. 4 = 80 B·s; a 5 s pause held on the device is 10,000.
    With this iteration's budget spent (swap-ins took it), the paper's rule discards. A full budget
    moves T_fwd(50) = 10 ms of copy at 1 MB/s = 1,000 tokens, so the swap waits one iteration: held
    for 10 ms (20 B·s) < 80, deferred (preserved now, swapped when the budget comes). Not once the time
    already held since the pause tips it over the discard (50 ms: 120 B·s), nor without host room."""
    p = toy_profile()
    spent = IterationInfo(300, 50, swap_out_budget=0, free_host_tokens=10_000)
    fresh = paused("a", 200, [5.0])
    assert min_waste_plan([fresh], spent, p).action("a") is KVAction.DISCARD
    deferring = make_policy("infercept-paper+deferred-swap")
    assert deferring.plan([fresh], spent, p).action("a") is KVAction.PRESERVE
    assert deferring.plan([paused("a", 200, [5.0], elapsed=0.05)], spent, p).action("a") is KVAction.DISCARD
    no_room = dataclasses.replace(spent, free_host_tokens=100)
    assert deferring.plan([fresh], no_room, p).action("a") is KVAction.DISCARD
    # The next iteration has budget: the kept context is swapped out, as the paper's rule would.
    budget = dataclasses.replace(spent, swap_out_budget=1000)
    assert deferring.plan([paused("a", 200, [5.0 - 0.01], elapsed=0.01)], budget, p).action("a") is KVAction.SWAP_OUT
    # The expected-waste rule defers the same way.
    assert make_policy("infercept-paper+expected-waste+deferred-swap").plan([fresh], spent, p).action("a") \
        is KVAction.PRESERVE


def test_deferred_swaps_queue_behind_each_other():
    """Six contexts of 200 tokens, deferred most wasteful first (ties: oldest first). A full budget
    moves 1,000 tokens an iteration: the first five wait one iteration, the sixth, with 1,000 tokens
    ahead of it, two (20 ms: 40 B·s held < 80): all six kept. At a tenth of the copy speed a budget is
    100 tokens: the first waits two iterations (40 B·s), the second, behind it, four (40 ms: 80 B·s, no
    less than the discard), and so does every later one: only the first is kept."""
    p, spent = toy_profile(), IterationInfo(300, 50, swap_out_budget=0, free_host_tokens=10_000)
    many = [paused(f"r{i}", 200, [5.0], arrival=i) for i in range(6)]
    deferring = make_policy("infercept-paper+deferred-swap")
    assert deferring.plan(many, spent, p).ids(KVAction.PRESERVE) == [f"r{i}" for i in range(6)]
    slow = toy_profile(d2h_bytes_per_s=1e5, h2d_bytes_per_s=1e5)
    plan = deferring.plan(many, spent, slow)
    assert plan.ids(KVAction.PRESERVE) == ["r0"]
    assert plan.ids(KVAction.DISCARD) == [f"r{i}" for i in range(1, 6)]
