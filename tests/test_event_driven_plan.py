"""Event-driven planning (`paused_kv.py`) decides exactly what planning every paused request every step
decides, and costs nothing per step for paused requests whose decision cannot change.

The reference is the same scheduler with `event_driven=False` (every holder of device KV planned every
step, as before). Random agent traces run through both on the virtual clock, and every step's work
(chunks, copies, discards, preemptions) and every paused request's KV location must be equal.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench_modules import load_bench
from infercept.engine.paused_kv import PausedKV, kv_state
from infercept.engine.policy import DurationEstimator, Profile
from infercept.engine.policy.profile import h100_llama3_8b
from infercept.engine.request import InterceptParams, Request
from infercept.engine.sampling_params import SamplingParams
from infercept.engine.simulation import SimulatedEngine, coarsen_profile

workload = load_bench("workload")
long_context = load_bench("long_context")
BS = 16


def toy_profile() -> Profile:
    """10 ms iterations, swap budget of two blocks per iteration: short calls stay preserved."""
    bw = 2 * BS * 1000 / 0.01
    return Profile(model="toy", device="sim", dtype="float16", bytes_per_token=1000, block_size=BS,
                   t_fwd_samples=((1, 0.010), (64, 0.012), (128, 0.020)), d2h_bytes_per_s=bw,
                   h2d_bytes_per_s=bw, saturation_point=64)


def cpu_like_profile() -> Profile:
    """Iterations far longer than copies, as on a CPU: every paused context is worth swapping."""
    return Profile(model="toy-cpu", device="cpu", dtype="bfloat16", bytes_per_token=1000, block_size=BS,
                   t_fwd_samples=((1, 0.05), (64, 0.2), (256, 0.8)), d2h_bytes_per_s=1e10,
                   h2d_bytes_per_s=1e10, saturation_point=64)


PROFILES = {"toy": toy_profile, "cpu": cpu_like_profile, "h100": h100_llama3_8b}
POLICIES = ("infercept", "infercept-paper", "infercept-paper+expected-waste", "infercept-paper+las-priority",
            "infercept-paper+prefetch",
            "heuristic-preserve", "preserve", "budgeted-swap", "swap", "prefix-cache", "discard",
            "infercept+recompute-preemption", "infercept+ample-no-discard", "infercept-paper+deferred-swap",
            "infercept+deferred-swap")


def assert_totals_match(sched) -> None:
    """The index's incremental totals equal a walk over every paused request."""
    kv = [sched.kv_tokens(r) for r in sched.paused.values()]
    index = sched.paused_kv
    assert index.device_tokens == sum(d for d, _ in kv) == sched.paused_device_tokens()
    assert index.host_tokens == sum(h for _, h in kv)
    assert index.discarded_tokens == sum(r.num_tokens for r in sched.paused.values()) - sum(d + h for d, h in kv)
    states = [kv_state(d, h) for d, h in kv]
    assert index.count_by_state == {s: states.count(s) for s in index.count_by_state}


def step_log(engine: SimulatedEngine, log: list, planned: list) -> callable:
    def on_step(eng, result) -> None:
        out = result.output
        sched = eng.scheduler
        log.append((
            round(eng.clock.now(), 12),
            tuple((c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks),
            tuple(out.swap_out), tuple(out.swap_in), out.num_discarded_tokens, out.num_preempted,
            out.num_preempted_by_swap,
            tuple(sorted((rid, sched.kv_tokens(r)) for rid, r in sched.paused.items())),
            sched.paused_device_tokens(),
        ))
        assert_totals_match(sched)
    return on_step


def run(policy: str, profile_name: str, trace: list[dict], device_blocks: int, host_blocks: int,
        event_driven: bool, oracle_hints: bool) -> tuple[list, int, object]:
    profile = PROFILES[profile_name]()
    engine = SimulatedEngine(policy, profile, num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                             max_num_seqs=16, event_driven=event_driven)
    planned = [0]
    plan = engine.policy.plan

    def counting_plan(paused, iteration, prof):
        planned[0] += len(paused)
        return plan(paused, iteration, prof)

    engine.policy.plan = counting_plan
    log: list = []
    result = engine.run_trace(trace, oracle_hints=oracle_hints, on_step=step_log(engine, log, planned))
    return log, planned[0], result


def trace_for(seed: int, profile_name: str, rate: float, n: int) -> list[dict]:
    if profile_name == "h100":  # full-size contexts, short tools and long human turns
        return workload.generate_trace(rate, num_requests=n, seed=seed, context_scale=0.3, decode_scale=0.2,
                                       interception_scale=0.05, max_interceptions=3)
    return workload.generate_trace(rate, num_requests=n, seed=seed, context_scale=0.05, decode_scale=0.1,
                                   interception_scale=0.02, max_interceptions=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(POLICIES), profile_name=st.sampled_from(sorted(PROFILES)),
       rate=st.sampled_from([1.0, 4.0, 12.0]), device_blocks=st.integers(40, 160), host_blocks=st.integers(0, 120),
       oracle_hints=st.booleans())
def test_event_driven_plan_makes_every_decision_the_per_step_plan_makes(seed, policy, profile_name, rate,
                                                                         device_blocks, host_blocks, oracle_hints):
    trace = trace_for(seed, profile_name, rate, 14)
    if profile_name == "h100":
        device_blocks *= 8
    reference, _, ref_result = run(policy, profile_name, trace, device_blocks, host_blocks, False, oracle_hints)
    events, _, ev_result = run(policy, profile_name, trace, device_blocks, host_blocks, True, oracle_hints)
    assert len(events) == len(reference)
    for i, (a, b) in enumerate(zip(reference, events)):
        assert a == b, f"step {i} differs"
    assert_same_summary(ev_result.summary(), ref_result.summary())


def assert_same_summary(got: dict, expected: dict) -> None:
    """Equal decisions give equal totals up to the order of float additions, which the two modes need not
    share (seed 2984, infercept, the toy profile: total waste 5.861450018195471 vs ...473): floats within
    1e-12 of each other, everything else exactly."""
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, float) and isinstance(have, float):
            both_nan = math.isnan(have) and math.isnan(want)
            assert have == want or math.isclose(have, want, rel_tol=1e-12) or both_nan, key
        else:
            assert have == want, key


def test_deferred_swaps_make_every_decision_the_per_step_plan_makes(monkeypatch):
    """`+deferred-swap` keeps contexts the waste rule would discard, and the guards must not put them to
    sleep: the first 400 s of `parts_sim.py`'s long@0.15 (coding agents, 8k-100k-token contexts, token
    scale 16, the H100 model's pools), where the pool comes under pressure and swap-ins take the budget,
    decided the same with and without event-driven planning, with deferrals happening."""
    from infercept.engine.policy import min_waste
    deferred, defer_swap = [], min_waste.defer_swap

    def counting(*args):
        deferred.append(defer_swap(*args))
        return deferred[-1]

    monkeypatch.setattr(min_waste, "defer_swap", counting)
    trace = long_context.long_context_trace(0.15, 400.0, 0)
    profile = h100_llama3_8b(attention=True)
    logs = []
    for event_driven in (False, True):
        engine = SimulatedEngine("infercept+deferred-swap", coarsen_profile(profile, 16), 28181, 65536,
                                 event_driven=event_driven, token_scale=16)
        log: list = []
        engine.run_trace(trace, until=400.0, on_step=step_log(engine, log, [0]))
        logs.append(log)
    assert logs[0] == logs[1]
    assert sum(deferred) > 20, "the scenario never deferred a swap"


def paused_beside_decoders(n: int, spacing: float, prompt: int, tool: str, duration_s: float,
                           decoders_at: float) -> list[dict]:
    """`n` agents `spacing` s apart, each decoding 2 tokens, calling `tool` for `duration_s`, then 2 more;
    and four requests of 2,000-token prompts decoding 300 tokens from `decoders_at`."""
    trace = [{"id": f"p{i}", "augment": "test", "arrival": spacing * i, "prompt_tokens": prompt,
              "segments": [{"decode_tokens": 2, "interception": {"kind": "tool", "tool": tool, "duration_s": duration_s},
                            "returned_tokens": 4}, {"decode_tokens": 2, "interception": None, "returned_tokens": 0}]}
             for i in range(n)]
    return trace + [{"id": f"d{i}", "augment": "test", "arrival": decoders_at, "prompt_tokens": 2000,
                     "segments": [{"decode_tokens": 300, "interception": None, "returned_tokens": 0}]}
                    for i in range(4)]


@pytest.mark.parametrize("policy,host_blocks", [("infercept", 0), ("heuristic-preserve", 4000), ("preserve", 4000)])
def test_preserved_paused_requests_are_not_planned_every_step(policy, host_blocks):
    """Forty agents paused on a 0.5 s tool while four long requests decode, on the H100 profile: the
    reference plans every holder every step; the event-driven scheduler plans each only when its guard
    may be crossed, a small fraction of that, with the same decisions. (`infercept` with no host pool:
    with one it would swap them all out; without, it preserves them while a discard would cost more.)"""
    trace = paused_beside_decoders(40, 0.01, 40, "calc", 0.5, decoders_at=0.0)
    reference, planned_ref, _ = run(policy, "h100", trace, 4000, host_blocks, False, oracle_hints=False)
    events, planned_ev, _ = run(policy, "h100", trace, 4000, host_blocks, True, oracle_hints=False)
    assert events == reference
    assert planned_ref > 2000, "the scenario never held many paused requests across steps"
    assert planned_ev * 10 < planned_ref, (planned_ev, planned_ref)


def test_paused_requests_kept_while_memory_is_ample_are_not_planned_every_step():
    """Forty agents paused on a 600 s call while four long requests decode, on a CPU-like profile with
    room for everything: the default keeps every paused context while memory is ample (`ample_preserve`
    where copies stall the forward pass), whatever the waste rule would say; the reference plans them
    all every step, the event-driven scheduler once, until a step's pool is not ample."""
    trace = paused_beside_decoders(40, 0.01, 40, "slow", 600.0, decoders_at=0.0)
    reference, planned_ref, _ = run("infercept", "cpu", trace, 4000, 4000, False, oracle_hints=True)
    events, planned_ev, _ = run("infercept", "cpu", trace, 4000, 4000, True, oracle_hints=True)
    assert events == reference
    assert all(kv == (41, 0) for *_, paused, _ in reference for _, kv in paused), \
        "memory was not ample: some paused context left the device"  # 40 prompt tokens + the first decoded
    assert planned_ref > 2000, "the scenario never held many paused requests across steps"
    assert planned_ev * 10 < planned_ref, (planned_ev, planned_ref)


def test_tool_completions_do_not_wake_contexts_kept_while_memory_is_ample():
    """Two hundred agents on one tool whose calls take 5 to 105 s, on a CPU-like profile with room for
    everything: every few hundred ms a call completes and adds a duration to the tool's history while
    the others wait. Contexts kept because memory is ample read no estimate (`PreserveGuard.reads_estimate`),
    so no completion wakes them; the decisions equal planning every holder every step."""
    trace = paused_beside_decoders(200, 0.01, 40, "calc", 0.0, decoders_at=0.0)
    for i, agent in enumerate(trace[:200]):
        agent["segments"][0]["interception"]["duration_s"] = 5.0 + i * 0.5
    reference, planned_ref, _ = run("infercept", "cpu", trace, 8000, 8000, False, oracle_hints=False)
    events, planned_ev, _ = run("infercept", "cpu", trace, 8000, 8000, True, oracle_hints=False)
    assert events == reference
    assert planned_ref > 20_000, "the scenario never held many paused requests across steps"
    assert planned_ev * 20 < planned_ref, (planned_ev, planned_ref)


def test_proactive_swap_in_looks_only_at_host_holders_near_their_resume():
    """Two hundred agents paused with their KV swapped to the host for a 600 s call (hinted) while four
    long requests decode, on the H100 profile: the reference asks every host holder's prediction every
    step; the event-driven scheduler keys each by when its copy back could be due and asks again only
    then (or when its KV moves or its tool's history changes), with the same decisions. Counted while
    the calls are far from their end (the first 100 s): near it every one is due to be looked at."""
    trace = paused_beside_decoders(200, 0.001, 200, "slow", 600.0, decoders_at=0.3)
    logs, asked = {}, {}
    for event_driven in (False, True):
        engine = SimulatedEngine("infercept", PROFILES["h100"](), num_device_blocks=4000, num_host_blocks=8000,
                                 max_num_seqs=16, event_driven=event_driven)
        predicted, count = engine.scheduler.estimator.predicted, [0]

        def counting(*args, predicted=predicted, count=count, clock=engine.clock):
            count[0] += clock.now() < 100.0
            return predicted(*args)

        engine.scheduler.estimator.predicted = counting
        log: list = []
        result = engine.run_trace(trace, oracle_hints=True, on_step=step_log(engine, log, []))
        assert all(r.finish is not None for r in result.records)
        logs[event_driven], asked[event_driven] = log, count[0]
    assert logs[True] == logs[False]
    assert asked[False] > 20_000, "the scenario never held many host holders across steps"  # 200 x steps
    assert asked[True] * 20 < asked[False], asked


def test_host_holders_are_looked_at_when_keyed_moved_or_their_tool_learns():
    history = DurationEstimator(min_history=1)
    index = PausedKV(history=history)
    ids = lambda t: [r.request_id for r in index.host_holders_before(t, 4.0)]  # noqa: E731
    index.add(_request("a", 1.0), 0, 32)
    index.add(_request("b", 2.0), 0, 16)
    index.add(_request("c", 3.0), 32, 0)  # no host KV: never a host holder
    assert ids(-math.inf) == ["a", "b"] and index.next_host_key() == -math.inf  # new: not keyed yet
    index.key_host("a", 10.0, "calc", 0)
    index.key_host("b", None, "calc", 0)  # not predicted: only its tool's history can change that
    assert ids(5.0) == [] and index.next_host_key() == 10.0
    assert ids(10.5) == ["a"] and ids(11.0) == ["a"]  # stays due until keyed again
    index.key_host("a", 20.0, None, 0)
    history.observe("calc", 1.0)
    assert ids(0.0) == ["b"]  # a new duration of calc: b may be predicted now (a has no tool)
    index.key_host("b", 15.0, "calc", 1)
    index.moved("b", 16, 0)  # swapped back in: no longer a host holder
    assert ids(30.0) == ["a"]
    index.key_host("a", 40.0, None, 0)
    index.moved("c", 0, 32)  # swapped out: a new host holder
    assert ids(0.0) == ["c"]
    index.remove("c")
    assert ids(0.0) == [] and index.next_host_key() == 40.0


def _request(rid: str, arrival: float, tokens: int = 32) -> Request:
    return Request(rid, [1] * tokens, SamplingParams(), arrival_time=arrival, intercept=InterceptParams())


def test_paused_kv_totals_and_newest_holder_follow_every_move():
    index = PausedKV()
    a, b, c = _request("a", 1.0), _request("b", 3.0), _request("c", 2.0)
    index.add(a, 32, 0)
    index.add(b, 16, 16)
    index.add(c, 0, 0)
    assert (index.device_tokens, index.host_tokens, index.discarded_tokens) == (48, 16, 32)
    assert index.count_by_state == {"device": 1, "host": 0, "partial": 1, "discarded": 1}
    assert index.newest_holder() is b
    index.moved("b", 0, 32)
    assert index.newest_holder() is a
    assert index.count_by_state == {"device": 1, "host": 1, "partial": 0, "discarded": 1}
    index.remove("a")
    assert index.newest_holder() is None
    assert (index.device_tokens, index.host_tokens, index.discarded_tokens) == (0, 32, 32)


def test_settled_holders_wake_on_their_timer_swap_room_and_tool_history():
    history = DurationEstimator(min_history=1)
    index = PausedKV(history=history)
    for i, rid in enumerate("abc"):
        index.add(_request(rid, float(i)), 32, 0)
    assert [r.request_id for r in index.to_plan(0.0, 0, True, 0.01)] == ["a", "b", "c"]
    index.settle("a", expected_wake=5.0, swap_wake=math.inf, swap_iteration_s=math.inf, min_running_tokens=0, tool=None, tool_version=0)
    index.settle("b", expected_wake=math.inf, swap_wake=1.0, swap_iteration_s=0.5, min_running_tokens=0, tool=None, tool_version=0)
    index.settle("c", expected_wake=math.inf, swap_wake=math.inf, swap_iteration_s=math.inf, min_running_tokens=0, tool="calc",
                 tool_version=0)
    assert index.to_plan(2.0, 0, False, 0.01) == []  # b's swap wake waits for swap room
    assert [r.request_id for r in index.to_plan(2.0, 0, True, 0.01)] == ["b"]
    index.settle("b", expected_wake=math.inf, swap_wake=math.inf, swap_iteration_s=0.5, min_running_tokens=0, tool=None, tool_version=0)
    assert [r.request_id for r in index.to_plan(2.0, 0, True, 0.6)] == ["b"]  # a long iteration
    index.settle("b", expected_wake=math.inf, swap_wake=math.inf, swap_iteration_s=math.inf, min_running_tokens=0,
                 tool=None, tool_version=0)
    index.add(_request("d", 4.0), 16, 0)
    index.settle("d", expected_wake=math.inf, swap_wake=math.inf, swap_iteration_s=math.inf,
                 min_running_tokens=100, tool=None, tool_version=0)
    assert index.to_plan(2.0, 100, False, 0.01) == []
    assert [r.request_id for r in index.to_plan(2.0, 99, False, 0.01)] == ["d"]
    index.remove("d")
    history.observe("calc", 1.0)
    assert [r.request_id for r in index.to_plan(2.0, 0, False, 0.01)] == ["c"]
    assert [r.request_id for r in index.to_plan(5.0, 0, False, 0.01)] == ["a", "c"]  # a's timer; c stays live


def test_a_new_duration_wakes_only_the_pauses_whose_estimate_it_can_change():
    """Rule 1 reads only the past calls that outlasted the elapsed time: a call that completes in 2 s
    changes the estimates of calls paused for less than 2 s, never of those paused longer (now or later).
    A tool completing many times a second then wakes its recent pauses, not all of them."""
    history = DurationEstimator(min_history=2, history_size=3)
    index = PausedKV(history=history)
    ids = ("ancient", "old", "mid", "new")
    for rid, paused_at in zip(ids, (-40.0, 0.0, 7.0, 9.5)):
        index.add(_request(rid, paused_at), 32, 0)
        index._entries[rid].request.paused_at = paused_at
    for _ in range(2):
        history.observe("calc", 30.0)
    assert history.changed_since("calc", 0) == math.inf  # reaching min_history changes every estimate
    planned = lambda now: [r.request_id for r in index.to_plan(now, 0, False, 0.01)]  # noqa: E731

    def settle(*rids):
        for rid in rids:
            index.settle(rid, math.inf, math.inf, math.inf, 0, "calc", history.version("calc"))

    assert planned(10.0) == list(ids)
    settle(*ids)
    assert planned(10.0) == []
    history.observe("calc", 2.0)  # paused 50, 10, 3 and 0.5 s: only "new" can see a 2 s call
    assert history.changed_since("calc", 2) == 2.0 and history.changed_since("calc", 3) == 0.0
    assert planned(10.0) == ["new"]
    settle("new")
    history.observe("calc", 1.0)  # the history is full: the oldest 30 s call drops out, which every
    assert history.changed_since("calc", 3) == 30.0  # pause shorter than 30 s could see
    assert planned(10.5) == ["old", "mid", "new"]  # paused 50.5 s, "ancient" never saw the 30 s calls


def test_next_jump_bounds_every_estimate_rule():
    est = DurationEstimator(min_history=2)
    assert est.next_jump(10.0, 9.0) == math.inf  # elapsed rule: grows with the clock, never jumps
    assert est.next_jump(10.0, 9.0, hint_seconds=5.0) == 14.0  # the hint is outlived at 9 + 5
    est.observe("calc", 2.0)
    est.observe("calc", 6.0)
    assert est.version("calc") == 2 and est.version("other") == 0
    assert est.next_jump(10.0, 9.0, "calc") == 11.0  # elapsed 1 s: the 2 s call drops out at 9 + 2
    assert est.next_jump(10.0, 6.0, "calc") == 12.0  # elapsed 4 s: the 6 s call is next
    assert est.next_jump(10.0, 0.0, "calc") == math.inf  # outlived all history: the elapsed rule
    # between jumps the estimate grows no faster than the clock
    for start in (9.0, 6.0, 0.0):
        for hint in (None, 5.0):
            t0, e0 = 10.0, est.estimate(10.0, start, "calc", hint)
            jump = est.next_jump(t0, start, "calc", hint)
            for k in range(1, 50):
                t = t0 + k * 0.1
                if t >= jump:
                    break
                assert est.estimate(t, start, "calc", hint) <= e0 + (t - t0) + 1e-9


@pytest.mark.parametrize("oracle_hints", [False, True])
def test_paused_requests_leave_the_device_when_their_guard_is_crossed(oracle_hints):
    """Calls of 0.1 s on the toy profile (a 25 ms round trip to the host): a fresh pause is preserved, and
    swapped once its expected time reaches the round trip, at the same step as under the reference."""
    trace = [{"id": f"p{i}", "augment": "test", "arrival": 0.003 * i, "prompt_tokens": 40,
              "segments": [{"decode_tokens": 3, "interception": {"kind": "tool", "tool": "t", "duration_s": 0.1},
                            "returned_tokens": 4}] * 3 + [{"decode_tokens": 2, "interception": None,
                                                            "returned_tokens": 0}]}
             for i in range(12)]
    trace.append({"id": "long", "augment": "test", "arrival": 0.0, "prompt_tokens": 30,
                  "segments": [{"decode_tokens": 120, "interception": None, "returned_tokens": 0}]})
    # The 200-block pool holds everyone: the default's ample-memory rule would preserve them all, so the
    # waste rule's guards are checked without it (and the default against its own reference below).
    reference, planned_ref, _ = run("infercept+no-ample-preserve", "toy", trace, 200, 200, False, oracle_hints)
    events, planned_ev, _ = run("infercept+no-ample-preserve", "toy", trace, 200, 200, True, oracle_hints)
    assert sum(len(step[2]) for step in reference) > 0, "nothing was swapped out"
    assert events == reference
    assert run("infercept", "toy", trace, 200, 200, True, oracle_hints)[0] == run(
        "infercept", "toy", trace, 200, 200, False, oracle_hints)[0]
