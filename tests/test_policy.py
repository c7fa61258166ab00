"""Unit tests of the pure-Python policy layer (infercept.engine.policy): numbers checked by hand."""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stdlib_only import non_stdlib_imports
from infercept.engine.policy import (FIGURE3_ABLATION, POLICIES, DurationEstimator, IterationInfo, KVAction,
                                     PausedInfo, Profile, SwapBudget, a100_gptj_6b, detect_saturation_point,
                                     make_policy, recompute_chunk_size, split_swap_budget, waste_chunk_discard,
                                     waste_discard, waste_preserve, waste_swap)

POLICY_DIR = Path(__file__).resolve().parents[1] / "engine" / "policy"


def toy_profile(**overrides) -> Profile:
    """Round numbers: T_fwd flat at 10 ms up to 100 tokens, then +0.1 ms per token; M = 10 B;
    1 MB/s both ways (T_swap(200) = 2 ms); S = 150; blocks of 10 tokens."""
    fields = dict(model="toy", device="cpu", dtype="float32", bytes_per_token=10, block_size=10,
                  t_fwd_samples=((1, 0.01), (100, 0.01), (200, 0.02), (400, 0.04)),
                  d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6, saturation_point=150)
    fields.update(overrides)
    return Profile(**fields)


def paused(rid, C, expected_s, state="device", device=None, arrival=0.0, elapsed=0.0) -> PausedInfo:
    if device is None:
        device = C if state == "device" else 0
    return PausedInfo(request_id=rid, arrival_time=arrival, num_tokens=C, kv_state=state,
                      num_device_tokens=device, elapsed_s=elapsed, expected_s=expected_s)


# -- waste equations ------------------------------------------------------------------------------

def test_waste_preserve_eq2():
    # T_int × C × M = 2 s × 100 tokens × 10 B
    assert waste_preserve(2.0, 100, 10) == pytest.approx(2000.0)


def test_waste_discard_eq1():
    p = toy_profile()
    # T_fwd(200) = 0.02 s: 0.02·200·10 + 0.02·300·10 = 40 + 60
    assert waste_discard(200, 300, 10, p.t_fwd) == pytest.approx(100.0)


def test_waste_chunk_discard_eq4():
    p = toy_profile()
    # chunk 100: n = 2, T_fwd(100) = 0.01: 0.02·200·10/2 + 2·0.01·300·10 = 20 + 60
    assert waste_chunk_discard(200, 300, 10, p.t_fwd, 100) == pytest.approx(80.0)
    # chunk 80: n = ceil(200/80) = 3, T_fwd(66.7) = 0.01 (floor): 20 + 3·0.01·300·10 = 20 + 90
    assert waste_chunk_discard(200, 300, 10, p.t_fwd, 80) == pytest.approx(110.0)
    assert waste_chunk_discard(0, 300, 10, p.t_fwd, 80) == 0.0
    with pytest.raises(ValueError):
        waste_chunk_discard(200, 300, 10, p.t_fwd, 0)


def test_waste_swap_eq3():
    p = toy_profile()
    # T_swap(200) = 200·10 / 1e6 = 2 ms: 2 · 0.002 · 500 · 10
    assert waste_swap(200, 500, 10, p.t_swap) == pytest.approx(20.0)


# -- profile --------------------------------------------------------------------------------------

def test_t_fwd_piecewise_linear_fit():
    p = toy_profile()
    assert p.t_fwd(0) == 0.0
    assert p.t_fwd(0.5) == pytest.approx(0.01)  # below the first sample: the floor
    assert p.t_fwd(150) == pytest.approx(0.015)  # interpolated
    assert p.t_fwd(200) == pytest.approx(0.02)  # on a sample
    assert p.t_fwd(600) == pytest.approx(0.06)  # extrapolated with the last slope (1e-4 s/token)


def test_swap_time_and_budget():
    p = toy_profile(h2d_bytes_per_s=5e5)
    assert p.t_swap(200) == pytest.approx(0.002)
    assert p.t_swap(200, "in") == pytest.approx(0.004)
    # T_swap(N) = 10 ms with the slower direction (0.5 MB/s, 10 B/token): N = 500 tokens
    assert p.swap_budget_tokens(0.01) == 500
    assert p.swap_budget_tokens(0.0) == 0
    with pytest.raises(ValueError):
        p.t_swap(1, "sideways")


def _knee_curve(n):  # flat at 10 ms up to 256 tokens, then 0.1 ms per extra token
    return 0.01 + max(0, n - 256) * 1e-4


@pytest.mark.parametrize("ns", [
    [2 ** k for k in range(0, 13)],  # powers of two
    list(range(32, 2049, 32)),  # dense, linear spacing: the per-doubling normalisation must cope
])
def test_saturation_point_detection(ns):
    samples = [(n, _knee_curve(n)) for n in ns]
    assert detect_saturation_point(samples) == 256
    assert Profile(**{**_profile_fields(), "t_fwd_samples": samples}).saturation_point == 256


def test_saturation_point_unsaturated_curve_is_largest_sample():
    samples = [(n, 0.01) for n in (1, 64, 512, 1024)]  # throughput still doubling at the end
    assert detect_saturation_point(samples) == 1024


def _profile_fields():
    return dict(model="m", device="cpu", dtype="float32", bytes_per_token=8, block_size=16,
                t_fwd_samples=((1, 0.01),), d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)


def test_profile_json_round_trip(tmp_path):
    p = a100_gptj_6b()
    assert Profile.from_json(p.to_json()) == p
    explicit = toy_profile(saturation_point=123)
    path = tmp_path / "profile.json"
    explicit.save(path)
    loaded = Profile.load(path)
    assert loaded == explicit and loaded.saturation_point == 123 and loaded.notes == explicit.notes


def test_profile_rejects_bad_input():
    with pytest.raises(ValueError, match="format"):
        Profile.from_json('{"format": "something-else"}')
    with pytest.raises(ValueError):
        Profile(**{**_profile_fields(), "t_fwd_samples": ()})
    with pytest.raises(ValueError):
        Profile(**{**_profile_fields(), "t_fwd_samples": ((0, 0.01),)})


def test_a100_gptj_profile_constants():
    p = a100_gptj_6b()
    assert p.bytes_per_token == 2 * 28 * 4096 * 2 == 458_752
    assert p.saturation_point == 512  # derived from the assumed curve, not hard-coded
    assert p.block_size == 16
    # 33 ms iteration at 25 GB/s: 0.033 · 25e9 / 458752 = 1798.3 tokens
    assert p.swap_budget_tokens(p.t_fwd(512)) == 1798
    assert p.matches("EleutherAI/gpt-j-6b", "NVIDIA A100", "float16")


# -- estimator ------------------------------------------------------------------------------------

def test_estimator_paper_rule_without_history():
    est = DurationEstimator()
    assert est.estimate(now=10.0, call_start=7.0) == pytest.approx(3.0)
    assert est.estimate(now=10.0, call_start=7.0, tool_name="unknown") == pytest.approx(3.0)
    assert est.estimate(now=7.0, call_start=10.0) == 0.0  # clock skew never gives negative time


def test_estimator_uses_history_mean_residual():
    est = DurationEstimator(min_history=3)
    for d in (1.0, 2.0, 3.0, 10.0):
        est.observe("search", d)
    # elapsed 2.5: calls that lasted longer were 3 and 10, remaining 0.5 and 7.5 -> mean 4
    assert est.estimate(now=2.5, call_start=0.0, tool_name="search") == pytest.approx(4.0)
    # elapsed 0: mean of the history
    assert est.estimate(now=0.0, call_start=0.0, tool_name="search") == pytest.approx(4.0)
    # outlived every past call: back to the paper's elapsed-time rule
    assert est.estimate(now=20.0, call_start=0.0, tool_name="search") == pytest.approx(20.0)
    assert est.expected_total("search") == pytest.approx(2.5)  # median, for reports


def test_estimator_needs_min_history_and_bounds_it():
    est = DurationEstimator(history_size=32, min_history=3)
    est.observe("calc", 0.001)
    est.observe("calc", 0.001)
    assert est.estimate(now=5.0, call_start=0.0, tool_name="calc") == pytest.approx(5.0)  # 2 < 3 samples
    for _ in range(40):
        est.observe("calc", 0.001)
    assert len(est.history("calc")) == 32
    assert est.estimate(now=0.0, call_start=0.0, tool_name="calc") == pytest.approx(0.001)
    est.observe(None, 1.0)  # unnamed calls are not recorded
    assert est.expected_total("other") is None


def test_estimator_history_wins_over_a_hint_once_it_has_data():
    """A hint serves until the tool has history (3 calls), then the measured history wins; an
    outlived hint falls through to the elapsed time. An oracle's estimator (`hints_first`) keeps the hint."""
    est = DurationEstimator(min_history=3)
    for n in range(3):
        assert est.estimate(now=5.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(25.0)
        assert est.predicted(5.0, 0.0, "tool", 30.0) == pytest.approx(25.0)
        assert est.next_jump(5.0, 0.0, "tool", 30.0) == 30.0
        est.observe("tool", 8.0 + n)  # 8, 9, 10 s
    assert est.estimate(now=5.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(4.0)
    assert est.remaining(5.0, 0.0, "tool", 30.0) == pytest.approx((3.0, 4.0, 5.0))
    assert est.next_jump(5.0, 0.0, "tool", 30.0) == 8.0  # when the 8 s call is outlived
    # past every call of the history: the hint again while it lasts, then the elapsed time
    assert est.estimate(now=12.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(18.0)
    assert est.estimate(now=40.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(40.0)
    assert est.predicted(40.0, 0.0, "tool", 30.0) is None and est.next_jump(40.0, 0.0, "tool", 30.0) == math.inf
    oracle = DurationEstimator(min_history=3, hints_first=True)
    for d in (8.0, 9.0, 10.0):
        oracle.observe("tool", d)
    assert oracle.estimate(now=5.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(25.0)
    assert oracle.estimate(now=40.0, call_start=0.0, tool_name="tool", hint_seconds=30.0) == pytest.approx(40.0)


# -- decisions ------------------------------------------------------------------------------------

A100 = a100_gptj_6b()
LOADED = IterationInfo(num_running_tokens=20_000, num_batched_tokens=64, swap_out_budget=0)


def test_calculator_call_is_preserved():
    est = DurationEstimator()
    for _ in range(10):
        est.observe("calculator", 0.001)
    expected = est.estimate(now=100.0, call_start=100.0, tool_name="calculator")
    assert expected == pytest.approx(0.001)
    calc = paused("calc", 1000, expected)
    for budget in (0, 817, 100_000):  # even with swap budget to spare: it is back before a round trip
        plan = make_policy("infercept-paper").plan([calc], IterationInfo(20_000, 64, budget), A100)
        assert plan.action("calc") is KVAction.PRESERVE


def test_human_turn_under_memory_pressure_leaves_the_device():
    human = paused("human", 753, 28.6, elapsed=1.0)
    policy = make_policy("infercept-paper")
    assert policy.plan([human], LOADED, A100).action("human") is KVAction.DISCARD  # no swap budget
    plan = policy.plan([human], IterationInfo(20_000, 64, swap_out_budget=817), A100)
    assert plan.get("human").action is KVAction.SWAP_OUT and plan.get("human").swap_out_tokens == 753
    # budget smaller than the context: whole blocks now (31 × 16), the rest in later iterations
    plan = policy.plan([human], IterationInfo(20_000, 64, swap_out_budget=500), A100)
    assert plan.get("human").swap_out_tokens == 496


def test_min_waste_decision_matches_hand_computation():
    p = toy_profile()  # S = 150, B = 50 -> chunk 100; C_other = 300; M = 10
    it = IterationInfo(num_running_tokens=300, num_batched_tokens=50, swap_out_budget=0)
    assert recompute_chunk_size(p, 50) == 100
    a = paused("a", 200, 0.003, arrival=1.0)  # WP = 0.003·200·10 = 6   < WCD = 80  -> preserve
    b = paused("b", 200, 1.0, arrival=2.0)  # WP = 2000               > WCD = 80  -> discard
    c = paused("c", 100, 1.0, arrival=3.0)  # WP = 1000 > WCD = 0.01·100·10/2 + 0.01·300·10 = 35 -> discard
    plan = make_policy("infercept-paper").plan([a, b, c], it, p)
    assert [d.action for d in plan] == [KVAction.PRESERVE, KVAction.DISCARD, KVAction.DISCARD]
    assert [d.waste_preserve for d in plan] == pytest.approx([6, 2000, 1000])
    assert [d.waste_discard for d in plan] == pytest.approx([80, 80, 35])

    # Swap budget 200: most wasteful first is b (min waste 80 > c's 35).
    plan = make_policy("infercept-paper").plan([a, b, c], IterationInfo(300, 50, swap_out_budget=200), p)
    assert [(d.action, d.swap_out_tokens) for d in plan] == [
        (KVAction.PRESERVE, 0), (KVAction.SWAP_OUT, 200), (KVAction.DISCARD, 0)]
    plan = make_policy("infercept-paper").plan([a, b, c], IterationInfo(300, 50, swap_out_budget=250), p)
    assert plan.get("c").action is KVAction.SWAP_OUT and plan.get("c").swap_out_tokens == 50  # 5 blocks
    # the host pool caps the budget
    plan = make_policy("infercept-paper").plan([a, b, c], IterationInfo(300, 50, 10_000, free_host_tokens=120), p)
    assert plan.swap_out_tokens == 120 and plan.get("b").swap_out_tokens == 120
    # Budget for all: a's call (3 ms) is shorter than its 4 ms round trip, but paused now it idles
    # through this 10 ms iteration anyway, so it is swapped too. With copies 10x slower (a 40 ms round
    # trip, longer than the iteration) it is preserved: it would be back before its KV.
    plan = make_policy("infercept-paper").plan([a, b, c], IterationInfo(300, 50, swap_out_budget=10_000), p)
    assert [d.action for d in plan] == [KVAction.SWAP_OUT] * 3
    slow_copies = toy_profile(d2h_bytes_per_s=1e5, h2d_bytes_per_s=1e5)
    plan = make_policy("infercept-paper").plan([a, b, c], IterationInfo(300, 50, swap_out_budget=10_000), slow_copies)
    assert [d.action for d in plan] == [KVAction.PRESERVE, KVAction.SWAP_OUT, KVAction.SWAP_OUT]


def test_reclaim_under_pressure_swaps_when_that_wastes_less_than_recompute():
    """A running request needs blocks and the paused request `a` (preserved: its call looked short)
    must leave the device. Eq. 3: 2 · T_swap(200) · (300 + 200) · 10 = 2 · 2 ms · 5000 = 20 B·s against
    Eq. 4's 80 B·s: infercept swaps it out. Ten times slower copies: 200 > 80, discard. The paper's
    baselines always discard here."""
    it = IterationInfo(num_running_tokens=300, num_batched_tokens=50, swap_out_budget=0)
    a = paused("a", 200, 0.003)
    assert waste_swap(200, 500, 10, toy_profile().t_swap) == pytest.approx(20.0)
    assert make_policy("infercept-paper").reclaim(a, it, toy_profile()) is KVAction.SWAP_OUT
    slow = toy_profile(d2h_bytes_per_s=1e5, h2d_bytes_per_s=1e5)
    assert waste_swap(200, 500, 10, slow.t_swap) == pytest.approx(200.0)
    assert make_policy("infercept-paper").reclaim(a, it, slow) is KVAction.DISCARD
    for name in ("discard", "improved-discard", "preserve", "prefix-cache", "budgeted-swap"):
        assert make_policy(name).reclaim(a, it, toy_profile()) is KVAction.DISCARD


@pytest.mark.parametrize("name", ["swap", "prefix-cache", "discard", "heuristic-preserve"])
def test_preemption_variants_change_only_the_reclaim_rule(name):
    """The ablation's variants: a baseline with infercept's swap-preemption swaps where infercept
    would (and still discards where copies are dear), infercept with recompute-preemption always
    discards; the pause-time plan is the base policy's."""
    it = IterationInfo(num_running_tokens=300, num_batched_tokens=50, swap_out_budget=0)
    a = paused("a", 200, 0.003)
    slow = toy_profile(d2h_bytes_per_s=1e5, h2d_bytes_per_s=1e5)
    variant = make_policy(f"{name}+swap-preemption")
    assert variant.reclaim(a, it, toy_profile()) is KVAction.SWAP_OUT
    assert variant.reclaim(a, it, slow) is KVAction.DISCARD
    assert variant.label == f"{name}+swap-preemption" and make_policy(variant.label).preemption == "swap"
    base = make_policy(name)
    infos = [paused("p", 200, 30.0), paused("q", 100, 0.001, arrival=1.0)]
    assert variant.plan(infos, it, toy_profile()) == base.plan(infos, it, toy_profile())
    recompute = make_policy("infercept-paper+recompute-preemption")
    assert recompute.reclaim(a, it, toy_profile()) is KVAction.DISCARD
    assert recompute.plan(infos, it, toy_profile()) == make_policy("infercept-paper").plan(infos, it, toy_profile())
    assert make_policy("infercept-paper+swap-preemption").label == "infercept-paper"  # its own rule: no suffix


@pytest.mark.parametrize("bad", ["swap+", "swap+swap", "swap+fast-preemption", "nope+swap-preemption"])
def test_unknown_policy_variants_are_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="preemption|choose one of"):
        make_policy(bad)


def test_partial_swap_is_never_discarded_and_host_or_discarded_get_no_decision():
    p = toy_profile()
    half = paused("half", 200, 100.0, state="partial", device=100)
    gone = paused("gone", 200, 100.0, state="discarded")
    away = paused("away", 200, 100.0, state="host")
    for name in POLICIES:
        plan = make_policy(name).plan([half, gone, away], IterationInfo(300, 50, 0, free_host_tokens=0), p)
        assert [d.request_id for d in plan] == ["half"]
        assert plan.action("half") is KVAction.PRESERVE, name
        assert plan.action("gone") is None


def test_baseline_policies():
    p = toy_profile()
    reqs = [paused("x", 200, 0.003, arrival=1.0), paused("y", 100, 50.0, arrival=2.0)]
    it = IterationInfo(300, 50, swap_out_budget=100, free_host_tokens=250)
    assert make_policy("discard").plan(reqs, it, p).ids(KVAction.DISCARD) == ["x", "y"]
    assert make_policy("preserve").plan(reqs, it, p).ids(KVAction.PRESERVE) == ["x", "y"]
    sync = make_policy("swap").plan(reqs, it, p)  # whole contexts, ignores the budget, host holds 250
    assert [(d.action, d.swap_out_tokens) for d in sync] == [(KVAction.SWAP_OUT, 200), (KVAction.DISCARD, 0)]
    budgeted = make_policy("budgeted-swap").plan(reqs, it, p)  # FCFS within 100 tokens, then discard
    assert [(d.action, d.swap_out_tokens) for d in budgeted] == [(KVAction.SWAP_OUT, 100), (KVAction.DISCARD, 0)]
    heuristic = make_policy("heuristic-preserve").plan(reqs, it, p)  # x is short: kept; y long: swapped
    assert [(d.action, d.swap_out_tokens) for d in heuristic] == [(KVAction.PRESERVE, 0), (KVAction.SWAP_OUT, 100)]


def test_policy_registry_and_properties():
    with pytest.raises(ValueError, match="infercept"):
        make_policy("nope")
    assert all(name in POLICIES for name in FIGURE3_ABLATION)
    props = {n: (p.keeps_arrival_time, p.chunked_recompute, p.swap_synchronous)
             for n in POLICIES for p in [make_policy(n)]}
    assert props["discard"] == props["vllm"] == (False, False, False)
    assert props["improved-discard"] == (True, False, False)
    assert props["chunked-discard"] == props["budgeted-swap"] == props["heuristic-preserve"] == (True, True, False)
    assert props["infercept"] == (True, True, False)
    assert props["swap"] == (True, False, True)
    assert props["prefix-cache"] == (False, True, False)
    assert make_policy("infercept-paper").lazy_discard and not make_policy("discard").lazy_discard
    assert make_policy("infercept", lazy_discard=False).lazy_discard is False


def test_split_swap_budget():
    # swap-in first, swap-out gets the rest
    assert split_swap_budget(1000, 300, 5000, free_device_tokens=10_000, free_host_tokens=10_000) == _budget(300, 700)
    # no free device memory: nothing comes in, everything goes out to make room
    assert split_swap_budget(1000, 300, 5000, free_device_tokens=0, free_host_tokens=10_000) == _budget(0, 1000)
    # host pool nearly full
    assert split_swap_budget(1000, 0, 5000, free_device_tokens=0, free_host_tokens=64) == _budget(0, 64)
    assert split_swap_budget(-5, 10, 10, 10, 10) == _budget(0, 0)


def _budget(swap_in, swap_out):
    return SwapBudget(swap_in=swap_in, swap_out=swap_out)


# -- properties over random paused sets -----------------------------------------------------------

@st.composite
def paused_sets(draw):
    out = []
    for i in range(draw(st.integers(0, 12))):
        state = draw(st.sampled_from(["device", "host", "discarded", "partial"]))
        C = draw(st.integers(2, 5000))
        device = {"device": C, "host": 0, "discarded": 0}.get(state) if state != "partial" else \
            draw(st.integers(1, C - 1))
        out.append(PausedInfo(f"r{i}", draw(st.floats(0, 100)), C, state, device, draw(st.floats(0, 60)),
                              draw(st.floats(0, 60))))
    return out


@settings(max_examples=150, deadline=None)
@given(reqs=paused_sets(), budget=st.integers(0, 6000), host=st.none() | st.integers(0, 6000),
       running=st.integers(0, 50_000), batched=st.integers(0, 1024), name=st.sampled_from(sorted(POLICIES)))
def test_plans_respect_budgets(reqs, budget, host, running, batched, name):
    it = IterationInfo(running, batched, budget, free_host_tokens=host)
    plan = make_policy(name).plan(reqs, it, A100)
    policy = make_policy(name)
    if not policy.swap_synchronous:
        assert plan.swap_out_tokens <= budget  # the per-iteration swap limit is never exceeded
    if host is not None:
        assert plan.swap_out_tokens <= host
    by_id = {r.request_id: r for r in reqs}
    assert [d.request_id for d in plan] == [r.request_id for r in reqs if r.num_device_tokens > 0]
    for d in plan:
        r = by_id[d.request_id]
        assert (d.swap_out_tokens > 0) == (d.action is KVAction.SWAP_OUT)
        assert d.swap_out_tokens <= r.num_device_tokens
        assert not (r.kv_state == "partial" and d.action is KVAction.DISCARD)
        if name == "infercept" and d.action is not KVAction.SWAP_OUT and r.kv_state != "partial":
            # Eq. 5 for everything not swapped, but a deferred swap (`defer_swap`) may keep what Eq. 5
            # would discard: only a whole-device context, and only one the plan without it discards.
            better = KVAction.PRESERVE if d.waste_preserve <= d.waste_discard else KVAction.DISCARD
            if d.action is not better:
                undeferred = make_policy("infercept+no-deferred-swap").plan(reqs, it, A100).action(d.request_id)
                assert (d.action, better, undeferred, r.kv_state) == (
                    KVAction.PRESERVE, KVAction.DISCARD, KVAction.DISCARD, "device")


# -- no torch -------------------------------------------------------------------------------------

def test_policy_sources_import_only_stdlib():
    """Every import in engine/policy/*.py, at any depth, is relative or from the standard library."""
    for path in sorted(POLICY_DIR.glob("*.py")):
        assert non_stdlib_imports(path) == [], path.name


def test_importing_the_policy_scheduler_and_simulation_does_not_import_torch():
    """Through the package, as users import them (`infercept.engine` exports lazily): torch and numpy
    never enter sys.modules."""
    probe = textwrap.dedent("""
        import sys
        import infercept.engine.policy as policy
        import infercept.engine.scheduler, infercept.engine.simulation, infercept.engine.config
        plan = policy.make_policy("infercept-paper").plan(
            [policy.PausedInfo("r", 0.0, 100, "device", 100, 1.0, 1.0)],
            policy.IterationInfo(1000, 10, 100), policy.a100_gptj_6b())
        assert len(plan) == 1
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
        assert not leaked, leaked
        import infercept.engine
        assert infercept.engine.SamplingParams().max_tokens > 0 and "torch" not in sys.modules
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
