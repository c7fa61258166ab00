"""How much longer will a paused request stay paused? (paper §4.4, improved with per-tool history)

`DurationEstimator.estimate` returns the expected *remaining* interception time in seconds. That number
is ``T_int`` in WastePreserve (Eq. 2), for this reason: the policy re-decides every iteration, and the
memory a request has already held is spent whatever it decides now, so the only preserve waste a decision
can still avoid is ``remaining × C × M``.

Rules, first that applies:

1. **Per-tool history** (at least ``min_history`` past durations of this tool): the empirical mean
   residual life ``mean(d − elapsed for d in history if d > elapsed)``, i.e. the expected remaining time
   of the past calls that lasted at least as long as this one so far. It is a mean, not a median, because
   waste is linear in time and we minimise expected waste. If every past call was shorter than the time
   already elapsed, this call is unlike the history: fall through to rules 2-3.
2. **Client hint** ``h`` (the caller's expected *total* duration of this call): ``h − elapsed`` while
   ``elapsed < h``. A hint that has already been outlived was wrong, so fall through to rule 3.
3. **Paper §4.4**: ``t_now − t_call``. The paper uses the elapsed time as the estimate of the duration;
   read as a remaining-time estimate it is the "Lindy" rule for heavy-tailed durations (a call that has
   run for t seconds is expected to run about t more). It makes a fresh interception cheap to preserve and
   a long one increasingly expensive, and the paper measures it at 93% of an oracle.

Why history before the hint: a hint is the client's guess, often a tool's declared typical
duration written once and never checked; the history is what this tool's calls measured on this
server. A hint serves until the tool has history, and for tools that never get any. An estimator
built with ``hints_first`` puts the hint first: for an oracle whose hints are each call's true duration
(the simulation's ``oracle_hints``, the paper's §4.4 comparison).

`DurationEstimator.remaining` gives the same rules as a distribution (the history's survivors less the
elapsed time; a hint or the elapsed time as one point), for the expected-waste decisions
(`expected_waste.expected_waste_plan`).

Why history matters: with rule 3 alone a 1 ms calculator and a 30 s human turn look the same when they
start; with history the human turn is swapped or discarded at once and the calculator is never moved.
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import deque

DEFAULT_HISTORY_SIZE = 32  # recent calls per tool: adapts to drift, bounded memory
DEFAULT_MIN_HISTORY = 3  # fewer samples than this are noise, use the paper's rule instead
CHANGE_LOG_SIZE = 64  # per tool: how many recent history changes `changed_since` can describe


class DurationEstimator:
    """Expected remaining interception time from the elapsed time, a client hint and tool history."""

    def __init__(self, history_size: int = DEFAULT_HISTORY_SIZE, min_history: int = DEFAULT_MIN_HISTORY,
                 hints_first: bool = False):
        if history_size <= 0 or min_history <= 0:
            raise ValueError("history_size and min_history must be positive")
        self.hints_first = hints_first  # a live hint wins over history (an oracle's hints)
        self.history_size = history_size
        self.min_history = min_history
        self._history: dict[str, deque[float]] = {}
        self._versions: dict[str, int] = {}  # per tool: bumped by every observation
        # Per tool, (version, reach) of recent observations: reach is the longest duration the observation
        # added to or dropped from the history (`changed_since`).
        self._changes: dict[str, deque[tuple[int, float]]] = {}
        # observe() runs where tool results arrive (server side), estimate() in the engine loop.
        self._lock = threading.Lock()

    def observe(self, tool_name: str | None, duration: float) -> None:
        """Record how long a finished interception of ``tool_name`` took (seconds)."""
        if tool_name is None or duration < 0:
            return
        with self._lock:
            history = self._history.setdefault(tool_name, deque(maxlen=self.history_size))
            dropped = history[0] if len(history) == history.maxlen else 0.0
            history.append(float(duration))
            version = self._versions[tool_name] = self._versions.get(tool_name, 0) + 1
            if len(history) < self.min_history:
                reach = 0.0  # rule 1 does not read a history this short
            elif len(history) == self.min_history:
                reach = math.inf  # rule 1 starts to apply: every estimate of this tool may change
            else:
                reach = max(float(duration), dropped)
            self._changes.setdefault(tool_name, deque(maxlen=CHANGE_LOG_SIZE)).append((version, reach))

    def version(self, tool_name: str | None) -> int:
        """How many observations of `tool_name` were recorded: an estimate made at one version holds
        (as a function of time) until the version changes."""
        return self._versions.get(tool_name, 0) if tool_name is not None else 0

    def changed_since(self, tool_name: str, version: int) -> float:
        """How far back the observations of `tool_name` since `version` reach: the longest duration they
        added to or dropped from its history (0.0: none since). Rule 1 reads only the past calls longer
        than the elapsed time, so for a call paused at least that long, now and from now on, every
        estimate (`estimate`, `remaining`, `predicted`, `next_jump`) is what it was at `version`: a new
        observation need not wake it. math.inf where that cannot be said (the history reached
        `min_history`, or `version` is older than the recent changes kept)."""
        with self._lock:
            if version >= self._versions.get(tool_name, 0):
                return 0.0
            log = self._changes.get(tool_name, ())
            if not log or log[0][0] > version + 1:
                return math.inf
            return max(reach for v, reach in log if v > version)

    def history(self, tool_name: str) -> list[float]:
        with self._lock:
            return list(self._history.get(tool_name, ()))

    def expected_total(self, tool_name: str) -> float | None:
        """Median past duration of ``tool_name`` (for reports), or None with too little history."""
        samples = self.history(tool_name)
        return statistics.median(samples) if len(samples) >= self.min_history else None

    def estimate(self, now: float, call_start: float, tool_name: str | None = None,
                 hint_seconds: float | None = None) -> float:
        """Expected remaining seconds of the interception that began at ``call_start``.

        The result is ``T_int`` for WastePreserve (Eq. 2); see the module docstring for the rules.
        """
        predicted = self.predicted(now, call_start, tool_name, hint_seconds)
        return max(now - call_start, 0.0) if predicted is None else predicted

    def remaining(self, now: float, call_start: float, tool_name: str | None = None,
                  hint_seconds: float | None = None) -> tuple[float, ...]:
        """The remaining time as equally likely samples, by the rules of `estimate` (whose result is
        their mean): per-tool history is the past durations that outlasted the elapsed time, less it
        (the distribution conditioned on the time already paused); a hint or the elapsed time is one
        point. The min-waste policy with ``expected_waste`` integrates its wastes over them."""
        elapsed = max(now - call_start, 0.0)
        totals = self._totals(elapsed, tool_name, hint_seconds)
        return tuple(d - elapsed for d in totals) if totals else (elapsed,)

    def predicted(self, now: float, call_start: float, tool_name: str | None = None,
                  hint_seconds: float | None = None) -> float | None:
        """`estimate` where it rests on history or a hint (rules 1-2), None where only the elapsed time
        speaks: only a prediction can say a resume is near (rule 3 says a fresh pause ends at once). One
        pass over the history: proactive swap-in asks it of every paused request with host KV, every
        step."""
        elapsed = max(now - call_start, 0.0)
        totals = self._totals(elapsed, tool_name, hint_seconds)
        return _mean_remaining(totals, elapsed) if totals else None

    def next_jump(self, now: float, call_start: float, tool_name: str | None = None,
                  hint_seconds: float | None = None) -> float:
        """The first time after `now` at which `estimate` may jump up (math.inf: never, until the tool's
        history changes). Between `now` and that time the estimate grows at most as fast as the clock:
        ``estimate(t) <= estimate(now) + (t - now)``. Each rule is either falling with time (a mean
        residual over a fixed set of past calls, a hint) or the elapsed time itself; a jump comes only
        when the elapsed time passes a past call's duration or outlives a hint. The scheduler uses this
        to wake a paused request's decision when it could change, instead of asking every iteration."""
        totals = self._totals(max(now - call_start, 0.0), tool_name, hint_seconds)
        return call_start + min(totals) if totals else math.inf

    def _totals(self, elapsed: float, tool_name: str | None, hint_seconds: float | None) -> tuple[float, ...]:
        """The total durations the first rule that applies predicts, all longer than `elapsed`: the
        tool's past calls that outlasted it (rule 1), or the hint (rule 2); () for rule 3."""
        hint = (hint_seconds,) if hint_seconds is not None and elapsed < hint_seconds else ()
        if hint and self.hints_first:
            return hint
        if tool_name is not None:
            samples = self.history(tool_name)
            if len(samples) >= self.min_history:
                survivors = tuple(d for d in samples if d > elapsed)
                if survivors:
                    return survivors
        return hint


def _mean_remaining(totals: tuple[float, ...], elapsed: float) -> float:
    """``mean(d - elapsed for d in totals)``, as `statistics.fmean` computes it (an exactly rounded sum
    over the count) without its generic overhead: it runs for every paused request with host KV, every
    step (`predicted`)."""
    return mean_of([d - elapsed for d in totals])


def mean_of(samples) -> float:
    """The mean of `remaining`'s samples as `estimate` computes it: equal to `estimate` for the same
    arguments, so a caller that needs both walks the history once."""
    return math.fsum(samples) / len(samples)
