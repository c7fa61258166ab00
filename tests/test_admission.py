"""Admission under overload: the AIMD rule by hand, and the scheduler's hook (new
programs held back within the cap, turns of active programs never; no deadlock)."""
from __future__ import annotations

import pytest

from infercept.engine.block_manager import BlockManager
from infercept.engine.config import SchedulerConfig
from infercept.engine.outputs import RunnerOutput, SampledToken
from infercept.engine.policy import AdmissionController, make_policy
from infercept.engine.request import InterceptParams, Request, RequestStatus
from infercept.engine.sampling_params import SamplingParams
from infercept.engine.scheduler import Scheduler

BLOCK_SIZE = 4
SAMPLED = 5


def window(ctl: AdmissionController, t: float, thrash: int, generated: int, active: int, waiting_new: int = 5,
           computed: int = 100) -> float:
    """Close one window of `ctl` (window_s=1, min_steps=1) with one step at t + 1; returns t + 1."""
    ctl.observe(t + 1, thrash, computed, generated, active, waiting_new)
    return t + 1


def controller() -> AdmissionController:
    ctl = AdmissionController(window_s=1.0, min_steps=1)
    ctl.observe(0.0, 0, 0, 0, 0, 0)  # opens the first window at t = 0
    return ctl


# -- the rule by hand --------------------------------------------------------------------------------

def test_aimd_decreases_on_thrash_once_per_round_trip_and_increases_when_clean():
    ctl = controller()
    t = window(ctl, 0, thrash=0, generated=100, active=40)
    assert ctl.cap is None and ctl.admits(10_000)  # uncapped until the first thrash
    t = window(ctl, t, thrash=20, generated=100, active=40)  # 20% thrash, goodput flat: stop growing
    assert ctl.cap == 40 and not ctl.admits(40) and ctl.admits(39)
    t = window(ctl, t, thrash=20, generated=100, active=40)  # the cap binds and it still thrashes
    assert ctl.cap == 28  # floor(40 x 0.7)
    t = window(ctl, t, thrash=20, generated=100, active=35)  # still draining to 28: no second cut yet
    assert ctl.cap == 28
    t = window(ctl, t, thrash=20, generated=100, active=28)  # drained, still thrashing: cut again
    assert ctl.cap == 19
    t = window(ctl, t, thrash=3, generated=100, active=19)  # between 1% and 5%: hold
    assert ctl.cap == 19
    ctl.hold()
    t = window(ctl, t, thrash=0, generated=100, active=19)  # clean and the cap held a program back: +1
    assert ctl.cap == 20
    t = window(ctl, t, thrash=0, generated=100, active=19)  # clean, nobody held back: hold
    assert ctl.cap == 20
    assert (ctl.num_decreases, ctl.num_increases) == (3, 1)


def test_aimd_leaves_the_cap_alone_when_goodput_rises_or_nobody_waits():
    ctl = controller()
    t = window(ctl, 0, thrash=0, generated=100, active=40)
    t = window(ctl, t, thrash=50, generated=120, active=40)  # thrash, but goodput +20%: it pays off
    assert ctl.cap is None
    t = window(ctl, t, thrash=50, generated=120, active=40, waiting_new=0)  # nobody to hold back
    assert ctl.cap is None
    window(ctl, t, thrash=50, generated=120, active=40)
    assert ctl.cap == 40


def test_a_cut_that_lowers_goodput_is_undone_and_becomes_the_floor():
    ctl = controller()
    t = window(ctl, 0, thrash=20, generated=100, active=40)
    t = window(ctl, t, thrash=20, generated=100, active=40)
    assert ctl.cap == 28
    t = window(ctl, t, thrash=0, generated=50, active=30)  # not drained yet: not judged
    assert ctl.cap == 28
    t = window(ctl, t, thrash=0, generated=50, active=28)  # drained; goodput halved: undone
    assert (ctl.cap, ctl.floor, ctl.num_reverts) == (40, 40, 1)
    t = window(ctl, t, thrash=20, generated=50, active=40)  # thrash again, but never below the floor
    assert ctl.cap == 40 and ctl.admits(39) and not ctl.admits(40)
    ctl.hold()
    window(ctl, t, thrash=0, generated=50, active=40)  # clean growth still works above it
    assert ctl.cap == 41


def test_aimd_floor_keeps_one_program_admissible():
    ctl = controller()
    t = 0.0
    for active in (3, 3, 2, 1, 1, 1):
        t = window(ctl, t, thrash=90, generated=10, active=active)
    assert ctl.cap == 1
    assert ctl.admits(0) and not ctl.admits(1)
    with pytest.raises(ValueError):
        AdmissionController(min_cap=0)


def test_a_window_needs_its_seconds_and_its_steps():
    ctl = AdmissionController(window_s=1.0, min_steps=4)
    for t in (0.0, 0.5, 1.5):  # 1.5 s but three steps: still open
        ctl.observe(t, 50, 100, 10, 10, 5)
    assert ctl.last_window is None
    ctl.observe(1.6, 50, 100, 10, 10, 5)
    assert ctl.last_window is not None and ctl.last_window.num_steps == 4
    assert ctl.last_window.thrash_share == pytest.approx(0.5)
    assert ctl.cap == 10


# -- the scheduler's hook ----------------------------------------------------------------------------

def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def step(sched: Scheduler):
    out = sched.schedule()
    sched.blocks.check_integrity()
    sampled = {c.request_id: SampledToken(SAMPLED) for c in out.chunks if c.sample}
    changed = sched.update(out, RunnerOutput(sampled=sampled))
    for r in changed:  # a turn that ended pauses (intercepting requests) or has finished already
        if r.pending_stop is not None and not r.status.finished:
            sched.pause(r, [])
    return out


def agent(rid: str, arrival: float, turns_left: bool = True) -> Request:
    return Request(rid, [10 + i for i in range(4)], greedy(2), eos_token_ids=frozenset({SAMPLED}),
                   arrival_time=arrival, intercept=InterceptParams(pause_on_stop=True) if turns_left else None)


def capped_scheduler(policy: str, cap: int) -> tuple[Scheduler, list[float]]:
    from test_block_manager import cheap_copy_profile

    now = [0.0]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20),
                      BlockManager(32, 32, BLOCK_SIZE), make_policy(policy), cheap_copy_profile(),
                      clock=lambda: now[0])
    if sched.admission is not None:
        sched.admission = AdmissionController(window_s=1e9)  # no window closes: the cap stays as set
        sched.admission.cap = cap
    return sched, now


def test_only_admission_policies_get_a_controller():
    assert Scheduler(SchedulerConfig(), BlockManager(4, 0, BLOCK_SIZE), make_policy("infercept")).admission is None
    assert Scheduler(SchedulerConfig(), BlockManager(4, 0, BLOCK_SIZE),
                     make_policy("infercept-paper+admission")).admission is not None
    assert make_policy("infercept+admission").label == "infercept+admission"


def test_new_programs_wait_for_the_cap_but_resumed_turns_never_do():
    """Cap 1: A starts, B (new) is held back. A's KV is discarded while it pauses (`discard` requeues
    it at the tail, behind B): its resumed turn still runs past the held-back B. Once A finishes, B
    starts: nothing active, so the cap admits it (no deadlock)."""
    sched, now = capped_scheduler("discard+admission", cap=1)
    a, b = agent("a", 0.0), agent("b", 0.1)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert (out.num_held_back, out.admission_cap, sched.num_active_programs) == (1, 1, 1)
    step(sched)  # a's second token ends its turn: it pauses
    assert a.status is RequestStatus.INTERCEPTED and b.status is RequestStatus.WAITING
    step(sched)  # the discard policy drops a's KV
    assert a.num_computed_tokens == 0
    now[0] = 1.0
    a.intercept = None  # the last turn finishes
    sched.resume("a", [50])
    assert [r.request_id for r in sched.waiting] == ["b", "a"]  # a requeued at the tail
    out = step(sched)
    assert [c.request_id for c in out.chunks] == ["a"] and out.num_held_back == 1
    for _ in range(5):
        out = step(sched)
        assert "b" not in [c.request_id for c in out.chunks]
        if a.status is RequestStatus.FINISHED_LENGTH:
            break
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert sched.num_active_programs == 0
    out = step(sched)
    assert [c.request_id for c in out.chunks] == ["b"] and out.num_held_back == 0


def test_the_cap_limits_new_starts_and_frees_as_programs_finish():
    sched, _ = capped_scheduler("infercept-paper+admission", cap=2)
    for i in range(4):
        sched.add(agent(f"r{i}", float(i), turns_left=False))
    out = step(sched)
    assert sorted(c.request_id for c in out.chunks) == ["r0", "r1"] and out.num_held_back == 2
    for _ in range(5):
        out = step(sched)
        assert sorted(c.request_id for c in out.chunks) == ["r0", "r1"]
        if not sched.num_active_programs:
            break
    out = step(sched)
    assert sorted(c.request_id for c in out.chunks) == ["r2", "r3"]


def test_uncapped_admission_changes_nothing():
    """`+admission` with no thrash seen (cap None) schedules exactly as the policy without it."""
    def run(policy):
        sched, _ = capped_scheduler(policy, cap=None)
        for i in range(6):
            sched.add(agent(f"r{i}", float(i), turns_left=False))
        return [[c.request_id for c in step(sched).chunks] for _ in range(8)]

    assert run("infercept-paper+admission") == run("infercept-paper")
