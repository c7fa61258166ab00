"""GPU-scale serving on a virtual clock: the real `Scheduler` and `BlockManager`, a `ModeledRunner`.

`SimulatedEngine.step()` is the engine's three calls (schedule -> run -> update) with the forward pass
replaced by the profile's cost model, so every policy decision, block allocation, swap and recompute is
the production code's; only time is modeled. `run_trace` replays agent requests on that clock (the JSON
format is described in `benchmarks/workload.py`): a request arrives, decodes its first segment, pauses
for an interception of known duration, gets the tool result appended, decodes the next segment, and so
on; its last segment finishes it.

Metrics (paper §5), computed by `TraceResult.summary()`:

- normalized latency: median over requests of (end-to-end latency - time spent in interceptions) /
  generated tokens. A request still unfinished when the run stops counts with the time and tokens it
  has so far (like the paper's artifact, which stops at the end of its window); one with no token yet
  counts as infinitely slow, so an overloaded system cannot look fast by never starting requests.
- completed requests/s: requests finished by the end of the arrival window, divided by the window.
- recompute share: of the tokens the forward passes processed (`EngineStats.recompute_token_share`),
  and of modeled forward time, attributing each iteration's T_fwd to its tokens pro rata.
- memory waste: bytes paused requests hold on the device x seconds they hold them
  (`EngineStats.memory_waste_byte_seconds`, over the virtual clock: iterations and the idle gaps
  between them, when a paused request's KV is just as idle), over device pool bytes x duration, as a
  %. The paper's accounting (Eqs. 1 and 3) also charges recomputation and synchronous-swap stalls
  with the memory of the whole running batch, which waits for them; that sum is reported as "total
  waste".

Coarse simulation (`token_scale` k > 1, optional): one simulated token stands for k real tokens and one
iteration for k identical real iterations. `coarsen_profile` scales the profile so that every quantity
stays consistent: T_fwd'(n) = k·T_fwd(n) (k iterations of the same batch), M' = k·M, block size / k,
copy bandwidth unchanged (so T_swap and the swap budget are unchanged in bytes), S unchanged (per
iteration). Steady decode batches and chunked prefill/recompute are exact under this mapping; what is
approximated is anything that happens in the middle of k real iterations (a request finishing or
pausing, a one-shot recompute, which is charged as k iterations of C/k tokens instead of one of C). So
are swap copies: budgeted per real iteration, they hide behind the k real passes a step stands for, and
the one real iteration a request whose KV came back sits out (`Scheduler.swap_ins_run_next_step`) is
left out, as a whole step of k would charge it k-fold (`ModeledRunner`, coarse).
It cuts the number of scheduler steps by k, which is what makes a 1,800 s window of a 6B-on-A100 server
simulate in seconds.
"""
from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SchedulerConfig
from .modeled_runner import HostCost, IterationCost, ModeledRunner, VirtualClock
from .outputs import SchedulerOutput
from .policy import DurationEstimator, Profile, make_policy
from .request import InterceptParams, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats
from .step_loop import StepLoop

PROMPT_TOKEN_ID = 7
APPENDED_TOKEN_ID = 200
UNLIMITED_MODEL_LEN = 1 << 40  # the modeled runner has no position limit; the workload decides lengths


def coarsen_profile(profile: Profile, k: int) -> Profile:
    """The profile of a simulation in which one token stands for `k` (see the module docstring)."""
    if k == 1:
        return profile
    if k < 1 or profile.block_size % k:
        raise ValueError(f"token scale {k} must be a positive divisor of the block size {profile.block_size}")
    return Profile(model=profile.model, device=profile.device, dtype=profile.dtype,
                   bytes_per_token=profile.bytes_per_token * k, block_size=profile.block_size // k,
                   t_fwd_samples=tuple((n, t * k) for n, t in profile.t_fwd_samples),
                   d2h_bytes_per_s=profile.d2h_bytes_per_s, h2d_bytes_per_s=profile.h2d_bytes_per_s,
                   saturation_point=profile.saturation_point,
                   # k real iterations over contexts k times as long: both attention terms scale by k^2.
                   attention_read_s_per_token=profile.attention_read_s_per_token * k * k,
                   attention_pair_s=profile.attention_pair_s * k * k,
                   copy_overlap=profile.copy_overlap,
                   notes=f"{profile.notes} [coarsened: 1 token = {k} tokens]")


@dataclass
class SimAccounting:
    """What `EngineStats` does not split out: pure forward time, its recompute part, stalls, idle."""

    forward_seconds: float = 0.0  # sum of T_fwd (without copy stalls)
    recompute_seconds: float = 0.0  # T_fwd attributed to recomputed tokens, pro rata
    stall_seconds: float = 0.0  # time forward passes waited for copies (`ModeledRunner`)
    copy_seconds: float = 0.0  # all copy time, hidden or not
    idle_seconds: float = 0.0  # no work: the clock jumped to the next event
    recompute_waste_byte_seconds: float = 0.0  # Eq. 1: recompute time x the running batch's KV
    stall_waste_byte_seconds: float = 0.0  # Eq. 3: stall time x the running batch's KV


@dataclass
class StepResult:
    output: SchedulerOutput
    cost: IterationCost
    sampled: list[Request]  # requests that got a token this step
    paused: list[Request]  # ... and paused at the end of their turn
    finished: list[Request]  # ... and finished (their last turn ended)

    @property
    def made_progress(self) -> bool:
        out = self.output
        return bool(out.chunks or out.swap_out or out.swap_in or out.num_discarded_tokens
                    or out.num_fresh_pauses_planned)


class SimulatedEngine:
    """The engine's step loop with a `ModeledRunner` on a `VirtualClock` (scheduler clock = virtual)."""

    def __init__(self, policy_name: str, profile: Profile, num_device_blocks: int, num_host_blocks: int,
                 block_size: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = 256, max_model_len: int = UNLIMITED_MODEL_LEN,
                 estimator: DurationEstimator | None = None, event_driven: bool = True, token_scale: int = 1,
                 host_cost: HostCost | None = None):
        """`profile`: the coarsened one (`coarsen_profile`) when `token_scale` k > 1, the trace's token
        counts are divided by k (`run_trace`). `host_cost`: the host's unhidden time a step (none by
        default: the device's time alone)."""
        self.profile = profile
        self.token_scale = token_scale
        self.block_size = block_size or profile.block_size
        self.clock = VirtualClock()
        self.policy = make_policy(policy_name)
        self.policy_name = policy_name
        self.block_manager = BlockManager(num_device_blocks, num_host_blocks, self.block_size)
        # The token budget plays the saturation point S (scheduler docstring).
        config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens or profile.saturation_point,
                                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, self.policy, profile, clock=self.clock.now,
                                   estimator=estimator, event_driven=event_driven,
                                   copies_overlap=profile.copies_overlap and token_scale == 1)
        self.runner = ModeledRunner(profile, self.clock, self.block_size,
                                    swap_synchronous=self.policy.swap_synchronous, coarse=token_scale > 1,
                                    host_cost=host_cost)
        self.stats = EngineStats(bytes_per_token=profile.bytes_per_token)
        self.loop = StepLoop(self.scheduler, self.runner, self.stats)
        self.acc = SimAccounting()
        self._last_turn: set[str] = set()
        self._ids = itertools.count()
        self._prompt_serials = itertools.count()
        # How long an engine loop that cannot schedule anything takes to try again: one minimal iteration.
        self.idle_tick = profile.t_fwd(1)

    @property
    def device_pool_bytes(self) -> int:
        return self.block_manager.device.num_blocks * self.block_size * self.profile.bytes_per_token

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: int | list[int], max_tokens: int, *, request_id: str | None = None,
                    arrival_time: float | None = None, kind: str = "tool", expected_s: float | None = None,
                    last_turn: bool = False) -> str:
        """Queue an interceptible request: its turn ends after `max_tokens` tokens and it pauses (or,
        with `last_turn`, finishes). `prompt` is token ids or a number of dummy prompt tokens."""
        request_id = request_id or f"sim-{next(self._ids)}"
        # Dummy prompts start with a token unique to the request: the prefix cache must not see two
        # requests' contexts as one (its hashes chain, so one distinct first token is enough).
        token_ids = [PROMPT_TOKEN_ID + 1 + next(self._prompt_serials)] + [PROMPT_TOKEN_ID] * (prompt - 1) \
            if isinstance(prompt, int) and prompt > 0 else list(prompt or [])
        if not token_ids:
            raise ValueError("the prompt is empty")
        request = Request(request_id, token_ids, _greedy(max_tokens),
                          arrival_time=self.clock.now() if arrival_time is None else arrival_time,
                          intercept=InterceptParams(pause_on_stop=True, expected_s=expected_s, kind=kind))
        self.scheduler.add(request)
        self._set_last_turn(request_id, last_turn)
        return request_id

    def resume(self, request_id: str, num_appended_tokens: int, max_tokens: int, *, last_turn: bool = False,
               expected_s: float | None = None, kind: str | None = None,
               result_at: float | None = None) -> Request:
        """Append `num_appended_tokens` dummy tokens (the tool result) and decode `max_tokens` more;
        `kind`: the tool the turn's interception will call (its duration history), default unchanged;
        `result_at`: when the result arrived (`Scheduler.resume`), default now."""
        if num_appended_tokens < 1:
            raise ValueError("a resume needs at least one token")
        request = self.scheduler.paused[request_id]
        request.sampling_params = _greedy(max_tokens)
        self.loop.resume(request_id, [APPENDED_TOKEN_ID] * num_appended_tokens, result_at)
        if request.intercept is not None and (request.intercept.expected_s, request.intercept.kind) != \
                (expected_s, kind or request.intercept.kind):
            request.intercept = InterceptParams(pause_on_stop=True, expected_s=expected_s,
                                                kind=kind or request.intercept.kind)
        self._set_last_turn(request_id, last_turn)
        return request

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)
        self._last_turn.discard(request_id)

    def _set_last_turn(self, request_id: str, last_turn: bool) -> None:
        if last_turn:
            self._last_turn.add(request_id)
        else:
            self._last_turn.discard(request_id)

    def kv_location(self, request_id: str) -> dict[str, int]:
        return self.scheduler.kv_location(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> StepResult:
        out, (sampled, paused, finished) = self.loop.step(self._update, lambda: self.runner.last.seconds)
        cost = self.runner.last
        self._account(out, cost)
        return StepResult(out, cost, sampled, paused, finished)

    def _update(self, out: SchedulerOutput, runner_output) -> tuple[list[Request], list[Request], list[Request]]:
        """A turn ends when its scripted tokens are out: the request pauses, or finishes after its last turn."""
        sampled = self.scheduler.update(out, runner_output)
        paused, finished = [], []
        for request in sampled:
            if request.pending_stop is None or request.status.finished:
                continue
            if request.request_id in self._last_turn:
                self._last_turn.discard(request.request_id)
                self.scheduler.finish(request, request.pending_stop)
                finished.append(request)
            else:
                self.scheduler.pause(request, [])
                paused.append(request)
        return sampled, paused, finished

    def _account(self, out: SchedulerOutput, cost: IterationCost) -> None:
        acc = self.acc
        acc.forward_seconds += cost.t_fwd
        acc.stall_seconds += cost.t_stall
        acc.copy_seconds += cost.t_copy
        self.stats.copy_wait_seconds += cost.t_stall
        self.stats.device_seconds += cost.t_fwd
        t_recompute = cost.t_fwd * out.num_recomputed_tokens / cost.num_batched_tokens if cost.num_batched_tokens else 0.0
        acc.recompute_seconds += t_recompute
        if t_recompute or cost.t_stall:
            # The whole running batch's memory waits for recomputation and stalls (Eqs. 1 and 3).
            batch_blocks = sum(len(c.block_table) for c in out.chunks)  # tables as scheduled
            batch_bytes = batch_blocks * self.block_size * self.profile.bytes_per_token
            acc.recompute_waste_byte_seconds += t_recompute * batch_bytes
            acc.stall_waste_byte_seconds += cost.t_stall * batch_bytes

    def paused_device_tokens(self) -> int:
        return self.scheduler.paused_device_tokens()

    def idle_until(self, t: float) -> None:
        """No work until `t`: jump the clock (the paused KV held meanwhile is charged by `EngineStats.hold`
        at the next change)."""
        gap = t - self.clock.now()
        if gap <= 0:
            return
        self.acc.idle_seconds += gap
        self.clock.advance_to(t)

    # -- traces -----------------------------------------------------------------------------------
    def run_trace(self, trace: Iterable[dict], *, until: float | None = None,
                  window: float | None = None, oracle_hints: bool = False,
                  on_step: Callable[["SimulatedEngine", StepResult], None] | None = None) -> "TraceResult":
        """Replay agent requests (dicts in the `benchmarks/workload.py` format) on the virtual clock.

        Requests arrive at `arrival`; each segment decodes `decode_tokens`, then its interception lasts
        `duration_s` from the moment the request pauses, then `returned_tokens` are appended and the next
        segment starts. Token counts are divided by the engine's `token_scale` (rounded, at least 1) for a
        coarse simulation; reported token counts are multiplied back. The run stops when every request has
        finished or at `until` (virtual seconds), whichever is first; requests still in the engine then are
        recorded as unfinished and aborted, so the block pools end empty either way. `window` is the
        arrival window for completed requests/s (default: the last arrival). `oracle_hints` passes each
        interception's true duration as the client hint `expected_s` (the paper's oracle, §4.4).
        `on_step` is called after every step (tests use it to check invariants).
        """
        k = self.token_scale
        self.scheduler.estimator.hints_first = oracle_hints  # an oracle's hints are exact: they beat history
        trace = sorted(trace, key=lambda r: r["arrival"])
        records: dict[str, RequestRecord] = {}
        events: list[tuple[float, int, str, str]] = []
        seq = itertools.count()
        for i, spec in enumerate(trace):
            rid = str(spec.get("id", f"r{i}"))
            records[rid] = RequestRecord(rid, spec.get("augment", ""), float(spec["arrival"]), spec)
            heapq.heappush(events, (float(spec["arrival"]), next(seq), "arrive", rid))

        def scaled(n: int) -> int:
            return max(1, round(n / k))

        def hint(rec: RequestRecord) -> float | None:
            inter = rec.spec["segments"][rec.segment].get("interception")
            return float(inter["duration_s"]) if oracle_hints and inter else None

        def tool_of(spec: dict, segment: int) -> str:
            # The duration history is per tool: the one this segment's interception calls, else the
            # augment type (paper §2.2's hint: one tool per augment).
            inter = spec["segments"][segment].get("interception")
            return str(inter.get("tool") or inter.get("kind") or spec.get("augment") or "tool") \
                if inter else str(spec.get("augment") or "tool")

        def start_segment(rec: RequestRecord, at: float) -> None:
            segments = rec.spec["segments"]
            seg = segments[rec.segment]
            last = rec.segment == len(segments) - 1 or not seg.get("interception")
            if rec.segment == 0:
                self.add_request(scaled(int(rec.spec["prompt_tokens"])), scaled(int(seg["decode_tokens"])),
                                 request_id=rec.request_id, arrival_time=rec.arrival, kind=tool_of(rec.spec, 0),
                                 expected_s=hint(rec), last_turn=last)
            else:
                returned = segments[rec.segment - 1].get("returned_tokens", 1)
                # The result arrived at `at`, during the step that just ended: the tool's history records
                # its duration, not the wait for the step (as `AsyncEngine.resume` on a real server).
                self.resume(rec.request_id, scaled(int(returned)), scaled(int(seg["decode_tokens"])),
                            last_turn=last, expected_s=hint(rec), kind=tool_of(rec.spec, rec.segment),
                            result_at=at)

        def deliver(now: float) -> None:
            while events and events[0][0] <= now:
                t, _, kind, rid = heapq.heappop(events)
                rec = records[rid]
                if kind == "resume":
                    rec.interception_s += rec.pending_interception_s
                    rec.paused_at = None
                    rec.segment += 1
                rec.turn_started = t
                rec.turn_starts.append(t)
                start_segment(rec, t)

        while True:
            now = self.clock.now()
            if until is not None and now >= until:
                break
            deliver(now)
            if self.has_work():
                result = self.step()
                now = self.clock.now()
                for request in result.sampled:
                    rec = records[request.request_id]
                    rec.output_tokens += k
                    if rec.first_token is None:
                        rec.first_token = now
                    if len(rec.turn_ttfts) == rec.segment:
                        rec.turn_ttfts.append(now - rec.turn_started)
                for request in result.paused:
                    rec = records[request.request_id]
                    duration = float(rec.spec["segments"][rec.segment]["interception"]["duration_s"])
                    rec.paused_at, rec.pending_interception_s = now, duration
                    heapq.heappush(events, (now + duration, next(seq), "resume", rec.request_id))
                for request in result.finished:
                    records[request.request_id].finish = now
                if on_step is not None:
                    on_step(self, result)
                if not result.made_progress:
                    # Work is queued but nothing fits and nothing moves (e.g. preserved paused KV fills
                    # the pool): a real engine loop spins until time changes something. Let time pass
                    # one minimal iteration at a time, so elapsed-time estimates grow, up to the next
                    # event; with no event left nothing can ever change, so stop.
                    if not events:
                        break
                    nxt = min(events[0][0], now + self.idle_tick)
                    self.idle_until(nxt if until is None else min(nxt, until))
            elif events:
                nxt, wake = events[0][0], self.scheduler.idle_wake_s()  # proactive swap-in when idle
                if wake is not None:
                    nxt = min(nxt, now + wake)
                self.idle_until(nxt if until is None else min(nxt, until))
            else:
                break
        end = self.clock.now()
        for rid in list(self.scheduler.requests):
            self.abort(rid)  # unfinished at `until`: release everything
        window = window if window is not None else max((r.arrival for r in records.values()), default=0.0)
        return TraceResult(self.policy_name, list(records.values()), self.stats, self.acc, end, window,
                           self.device_pool_bytes, k)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class RequestRecord:
    request_id: str
    augment: str
    arrival: float
    spec: dict = field(repr=False)
    segment: int = 0  # index of the segment being decoded (or the interception after it)
    finish: float | None = None
    first_token: float | None = None
    interception_s: float = 0.0  # completed interceptions
    paused_at: float | None = None  # in an interception since
    pending_interception_s: float = 0.0
    output_tokens: int = 0  # generated tokens (real tokens: scaled back)
    turn_started: float = 0.0  # when the current segment's turn arrived (arrival or tool result)
    turn_ttfts: list[float] = field(default_factory=list)  # per segment: its turn's first token - turn_started
    turn_starts: list[float] = field(default_factory=list)  # per segment: turn_started

    def completion_time(self) -> float:
        return self.finish - self.arrival if self.finish is not None else math.inf

    def normalized_latency(self, end: float) -> float:
        """(e2e - interception time) / output tokens; unfinished requests up to `end`."""
        stop = self.finish if self.finish is not None else end
        intercepted = self.interception_s
        if self.finish is None and self.paused_at is not None:
            intercepted += min(max(stop - self.paused_at, 0.0), self.pending_interception_s)
        if self.output_tokens == 0:
            return math.inf
        return (stop - self.arrival - intercepted) / self.output_tokens


@dataclass
class TraceResult:
    policy: str
    records: list[RequestRecord]
    stats: EngineStats
    acc: SimAccounting
    duration: float  # virtual seconds at the end of the run
    window: float  # arrival window
    device_pool_bytes: int
    token_scale: int = 1

    @property
    def num_finished(self) -> int:
        return sum(r.finish is not None for r in self.records)

    def summary(self) -> dict:
        recs = self.records
        norm = [r.normalized_latency(self.duration) for r in recs]
        ttft = [r.first_token - r.arrival for r in recs if r.first_token is not None]
        held = self.stats.memory_waste_until(self.duration)
        pool_time = self.device_pool_bytes * self.duration if self.duration > 0 else math.inf
        done_in_window = sum(r.finish is not None and r.finish <= self.window for r in recs)
        return {
            "policy": self.policy,
            "requests": len(recs),
            "finished": self.num_finished,
            "normalized_latency": statistics.median(norm) if norm else math.nan,
            "ttft_median": statistics.median(ttft) if ttft else math.nan,
            "completed_per_s": done_in_window / self.window if self.window > 0 else math.nan,
            "recompute_token_share": self.stats.recompute_token_share,
            "recompute_time_share": (self.acc.recompute_seconds / self.acc.forward_seconds
                                     if self.acc.forward_seconds else 0.0),
            "held_waste_pct": 100 * held / pool_time,
            "total_waste_pct": 100 * (held + self.acc.recompute_waste_byte_seconds
                                      + self.acc.stall_waste_byte_seconds) / pool_time,
            "stall_share": self.acc.stall_seconds / self.duration if self.duration else 0.0,
            "swapped_out_blocks": self.stats.num_swapped_out_blocks,
            "discarded_tokens": self.stats.num_discarded_tokens * self.token_scale,
            "steps": self.stats.num_steps,
            "duration_s": self.duration,
            "output_tokens": sum(r.output_tokens for r in recs),
            # Program view: completion time = finish - arrival (unfinished: infinite, so an
            # overloaded system shows as such); resumed-step TTFT = a resumed turn's first token - the
            # tool result's arrival; first-turn TTFT alone (the new programs' wait).
            "completion_p50": _quantile([r.completion_time() for r in recs], 0.5),
            "completion_p90": _quantile([r.completion_time() for r in recs], 0.9),
            "first_ttft_median": _quantile([r.turn_ttfts[0] for r in recs if r.turn_ttfts], 0.5),
            "resumed_ttft_median": _quantile([t for r in recs for t in r.turn_ttfts[1:]], 0.5),
            "resumed_ttft_p90": _quantile([t for r in recs for t in r.turn_ttfts[1:]], 0.9),
            "resumes_on_device_share": (self.stats.resumes_on_device_share
                                        if any(self.stats.resumes_by_kv.values()) else None),
        }


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank, so infinite values stay infinite); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(math.ceil(q * len(ordered)) - 1, len(ordered) - 1) if q > 0 else 0]


def request_status_counts(engine: SimulatedEngine) -> dict[str, int]:
    """How many requests are in each state (for progress logs)."""
    counts: dict[str, int] = {}
    for r in engine.scheduler.requests.values():
        key = r.status.value if r.status is not RequestStatus.INTERCEPTED else "paused"
        counts[key] = counts.get(key, 0) + 1
    return counts
