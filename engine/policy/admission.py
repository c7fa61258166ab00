"""Admission under overload: AIMD on the number of active programs.

A program is an agent: one request that pauses at tool calls and resumes across turns. It is *active*
from its first scheduled token until it finishes (running, paused wherever its KV is, or waiting to
resume). When the device pool thrashes, every active program makes every other one slower: their KV
is pushed off the device and comes back by recompute or copy, and the device spends its iterations
redoing work. Admitting new programs more slowly then finishes more of them (CONCUR's agent-level
admission control, after TCP's congestion window): the number of active programs is capped, the cap
falls multiplicatively while the pool thrashes and goodput does not rise, and grows by one per
window while it is clean and the cap holds new programs back.

Policy apart from mechanism: `AdmissionController` only sees numbers. The scheduler feeds it each
step's signals (`observe`) and asks it, for a program that has never been scheduled, whether it may
start (`admits`); turns of active programs are never held back (holding them would strand their KV).
Programs held back wait in the scheduler's waiting queue, so the server's bounded queue
(`--max-concurrent-requests`, then 429 with Retry-After) bounds them too.

Signals, per step (`SchedulerOutput.num_thrashed_tokens`, fed from `Scheduler.update`):

- thrash: KV the device computes or copies again: recomputed tokens (after a preemption by recompute
  or a discard, chosen or forced), plus the KV of running requests preempted by swap and of resumed
  requests whose swap-in was evicted half-way (re-swapped). Counted when the work is done, so a
  preemption by recompute counts once, at its recompute.
- computed: tokens the forward pass processed (the thrash share's denominator: redo / all work).
- generated: tokens sampled (goodput).
- demand: new programs waiting to start. Without any, a cap would hold nothing back, so thrash then is
  not the admission's to fix (a discard min-waste chooses on a lightly loaded server recomputes too):
  the cap moves only while programs queue for it.

Rule, once per window (`window_s` of the scheduler's clock and at least `min_steps` steps):

- thrashing (thrash >= `thrash_high` of computed), goodput not above the last window's by more than
  `goodput_gain`, and new programs waiting: the first time, the cap becomes the number active (stop
  growing); after that, if the active programs are within the cap (the cap is what binds),
  ``cap = max(floor, active x decrease)``. While more programs are active than the cap (they have
  not drained to the last decrease yet), the cap holds: one decrease per round trip, as TCP cuts its
  window once per loss event, or the cap would fall to the floor before the first decrease could show.
- a cut is judged once the active programs have drained to it: if goodput fell by more than
  `goodput_gain` against the window that triggered it, the cut is undone and becomes the floor
  (`_judge_cut`). Measured reason: on the mix without a host pool, cuts ended the thrash (recompute
  44% -> 2% of forward time) but tripled the time to finish, since most active programs are in their
  tools and fewer of them leave the batch empty.
- clean (thrash < `thrash_low` of computed) and some new program was held back in the window:
  ``cap += 1``.
- otherwise the cap holds.

Never a deadlock: the floor is at least `min_cap` >= 1, so with no program active a new one always starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Constants and why:
# - WINDOW_S: thrash comes in bursts of one or two iterations (a preemption, then its recompute); a
#   second of clock holds ~100 H100 iterations (8 ms each), enough to tell a burst from a trend, and
#   still well under a program's life (the six-augment mix's programs last tens of seconds), so the cap
#   reacts before the active set turns over.
# - MIN_STEPS: a coarse simulation's iteration is k real ones (simulation.py, token scale 16: ~0.15 s),
#   so a window also needs a few iterations for its ratios to mean anything.
# - THRASH_HIGH = 5%: on the six-augment mix in the H100 simulation InferCept recomputes 1-2% of
#   forward time even at twice the rate it sustains (mix@28, mix@36: compute-bound, not thrashing);
#   a twentieth of the device's work redone is pressure, not a stray preemption.
# - THRASH_LOW = 1%: clean below this; between the two the cap holds (hysteresis, no oscillation on
#   a steady trickle of preemptions).
# - DECREASE = 0.7: TCP CUBIC's factor; 0.5 (Reno) halves the batch at every loss and
#   idles the device while the active programs drain, and a program drains slowly (its tools run).
# - GOODPUT_GAIN = 5%: if goodput still rose with the load, the thrash is the price of a bigger batch
#   that is paying off; a noise margin, windows are short.
# - MIN_CAP = 1: the floor; never 0, so the engine cannot stall.
WINDOW_S = 1.0
MIN_STEPS = 8
THRASH_HIGH = 0.05
THRASH_LOW = 0.01
DECREASE = 0.7
GOODPUT_GAIN = 0.05
MIN_CAP = 1


@dataclass(frozen=True)
class AdmissionWindow:
    """What one closed window saw (for tests and logs)."""

    seconds: float
    num_steps: int
    num_thrash_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int
    held: bool  # a new program was held back in the window

    @property
    def thrash_share(self) -> float:
        return self.num_thrash_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0

    @property
    def goodput(self) -> float:
        """Generated tokens per second."""
        return self.num_generated_tokens / self.seconds if self.seconds > 0 else 0.0


class AdmissionController:
    """AIMD cap on active programs; see the module docstring. `cap` is None until the first thrash."""

    def __init__(self, window_s: float = WINDOW_S, min_steps: int = MIN_STEPS, thrash_high: float = THRASH_HIGH,
                 thrash_low: float = THRASH_LOW, decrease: float = DECREASE, goodput_gain: float = GOODPUT_GAIN,
                 min_cap: int = MIN_CAP):
        if min_cap < 1:
            raise ValueError("min_cap must be at least 1, or the engine could hold every program back")
        if not 0 < decrease < 1:
            raise ValueError("decrease must be in (0, 1)")
        self.window_s, self.min_steps = window_s, min_steps
        self.thrash_high, self.thrash_low = thrash_high, thrash_low
        self.decrease, self.goodput_gain, self.min_cap = decrease, goodput_gain, min_cap
        self.cap: int | None = None
        self.floor = min_cap  # raised to a cap whose cut lowered goodput (`_judge_cut`)
        self.num_decreases = 0
        self.num_increases = 0
        self.num_reverts = 0
        self._cut: tuple[int, float] | None = None  # (cap before, goodput of the window) of the last cut
        self.last_window: AdmissionWindow | None = None
        self._start: float | None = None
        self._steps = self._thrash = self._computed = self._generated = 0
        self._held = False

    def admits(self, num_active: int) -> bool:
        """May a new program start while `num_active` programs are active?"""
        return self.cap is None or num_active < max(self.cap, self.floor)

    def hold(self) -> None:
        """The scheduler held a new program back this step (the cap binds)."""
        self._held = True

    def observe(self, now: float, num_thrash_tokens: int, num_computed_tokens: int, num_generated_tokens: int,
                num_active: int, num_waiting_new: int) -> None:
        """One step's signals, at `now` (the scheduler's clock after the step): `num_active` programs
        are active and `num_waiting_new` new ones wait to start."""
        if self._start is None:
            self._start = now
        self._steps += 1
        self._thrash += num_thrash_tokens
        self._computed += num_computed_tokens
        self._generated += num_generated_tokens
        if now - self._start < self.window_s or self._steps < self.min_steps:
            return
        window = AdmissionWindow(now - self._start, self._steps, self._thrash, self._computed, self._generated,
                                 self._held)
        self._decide(window, num_active, num_waiting_new)
        self.last_window = window
        self._start, self._steps, self._thrash, self._computed, self._generated = now, 0, 0, 0, 0
        self._held = False

    def _judge_cut(self, window: AdmissionWindow, num_active: int) -> bool:
        """Once the active programs have drained to a cut cap, did the cut pay? If goodput fell by more
        than the noise margin, the thrash was cheaper than the idle device the cut left (programs spend
        most of their life in tools, so fewer active ones can mean an emptier batch): the cut is undone
        and the cap is never cut below that level again. True if it was undone."""
        if self._cut is None or num_active > self.cap:
            return False
        before, goodput = self._cut
        self._cut = None
        if window.goodput >= goodput * (1 - self.goodput_gain):
            return False
        self.cap = self.floor = before
        self.num_reverts += 1
        return True

    def _decide(self, window: AdmissionWindow, num_active: int, num_waiting_new: int) -> None:
        if self._judge_cut(window, num_active):
            return
        last = self.last_window
        goodput_rose = last is not None and window.goodput > last.goodput * (1 + self.goodput_gain)
        if window.thrash_share >= self.thrash_high and not goodput_rose and num_waiting_new:
            if self.cap is None:
                self.cap = max(num_active, self.min_cap)
                self.num_decreases += 1
            elif num_active <= self.cap and self.cap > self.floor:
                self._cut = (self.cap, window.goodput)
                self.cap = max(self.floor, math.floor(num_active * self.decrease))
                self.num_decreases += 1
        elif window.thrash_share < self.thrash_low and window.held and self.cap is not None:
            self.cap += 1
            self.num_increases += 1
