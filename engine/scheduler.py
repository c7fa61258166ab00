"""Iteration-level scheduler: which tokens of which requests run in the next forward pass, and where
paused requests keep their KV.

Counting tokens, not phases: each request has `num_tokens` (prompt + generated + appended tool
results) and `num_computed_tokens` (those with KV). Every step gives each scheduled request a chunk of
its uncomputed tokens, so prefill, chunked prefill, decode, resume and recompute after a discard are
one path.

A step, in order (three queues, each FCFS by arrival time, paper §4.3, or by another program-level
order the policy names: `Policy.priority`, `Request.priority`; ahead of either, a request's own
`priority`, vLLM's, lower first, 0 by default):
  1. paused requests: the policy decides preserve / swap out / discard (`policy.plan`) for those
     holding device KV whose decision could differ from last time (fresh pauses, swaps in progress,
     preserved ones whose `PreserveGuard` may be crossed: `paused_kv.py`), so waiting agents cost a
     step nothing; swap-out is limited by the iteration's swap budget, split with swap-in
     (`split_swap_budget`);
  2. swapped: resumed requests whose KV is on the host get it back within the swap-in budget;
  3. running, oldest first; when blocks run out, paused requests' KV leaves the device first
     (discarded, or swapped out when the policy finds that less wasteful: `Policy.reclaim`), then the
     newest running request is preempted (by the same rule: swapped out and back in, or freed and
     recomputed later);
  4. waiting (new, preempted, resumed after a discard), while the token budget, the sequence cap and
     the pool allow. The token budget `max_num_batched_tokens` plays the paper's saturation point S,
     so a recompute chunk is S minus the running tokens. Under `Policy.admission` a new program (never
     scheduled yet) starts only within the admission cap on active programs (`policy/admission.py`);
     the turns of programs already active are never held back.

Prefix caching: a request admitted without KV first reuses the longest prefix of its context that the
device pool still holds by content (its own blocks from before a discard or preemption, or another
request's with the same system prompt and tools), and computes only the rest. After each step, the
full blocks a request has computed are registered for others to find. A discarded paused request's
blocks stay cached until evicted when the policy discards lazily (`Policy.lazy_discard`), so on
resume only the evicted part is recomputed.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable

from .block_manager import BlockManager, chain_hashes
from .config import SchedulerConfig
from .outputs import RunnerOutput, ScheduledChunk, SchedulerOutput
from .paused_kv import WAKE_EARLY_S, PausedKV, kv_state
from .policy import (DurationEstimator, IterationInfo, KVAction, PausedInfo, Policy, Profile,
                     split_swap_budget, swap_room)
from .policy.admission import AdmissionController
from .policy.estimator import mean_of
from .policy import prefetch
from .policy.budget import iteration_swap_limit, memory_ample
from .request import PLACEHOLDER, Request, RequestStatus


# Steps whose measured time sets proactive swap-in's lead (`Scheduler.step_lead_s`): enough to see the
# long steps of the current mix (on this CPU server a prefill chunk every ten or so 40 ms decode steps;
# the last 8 steps missed it often enough to lose 2 of 96 resumes), few enough to forget a burst that
# has passed.
RECENT_STEPS = 32


def _by_priority(r: Request) -> tuple:
    """Queue order (`Request.priority`, set by `Scheduler._enqueue` from `Policy.priority`): lower first."""
    return r.priority


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: Policy | None = None,
                 profile: Profile | None = None, clock: Callable[[], float] = time.monotonic,
                 estimator: DurationEstimator | None = None, event_driven: bool = True,
                 copies_overlap: bool = False):
        self.config = config
        self.blocks = block_manager
        # No policy: paused requests keep their KV on the device until memory runs short.
        self.policy = policy
        self.profile = profile
        self.clock = clock
        self.estimator = estimator or DurationEstimator()
        self.waiting: list[Request] = []  # each queue sorted by priority (arrival time by default)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.paused: dict[str, Request] = {}
        # Where the paused requests' KV is, and which of them the next plan must see (`paused_kv.py`);
        # `event_driven=False` plans every holder every step (the reference the tests compare with).
        self.paused_kv = PausedKV(event_driven, self.estimator)
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # dropped since the last step, for the runner
        self._last_batched_tokens = 1
        self._preempted_this_step = False
        self._swapped_in_this_step: set[str] = set()
        # Where the runner's copies run beside the forward pass (a CUDA copy stream, `copy_stream.py`),
        # a request whose KV a step brings back from the host first runs in the next step: the pass
        # would otherwise stand still until the copy landed, its whole batch with it, and the swap budget
        # assumes copies hidden behind the pass (paper §4.1). Not for the synchronous `swap` baseline,
        # whose copies block the step by definition. Where copies are synchronous (a CPU) the KV is
        # back before the pass and the request runs in the same step.
        self.swap_ins_run_next_step = copies_overlap and not (policy is not None and policy.swap_synchronous)
        # Paused since the policy last planned: the engine owes them a step even when nothing else
        # runs, so a decision made at the interception (discard, swap out) never waits for new work.
        self._undecided: set[str] = set()
        # Paused requests whose host KV was brought back before their resume (`Policy.prefetch`).
        self._prefetched: set[str] = set()
        # Programs (requests) scheduled at least once and not finished: the active ones, wherever they
        # are; and how many never-scheduled ones wait (new programs), for admission under overload.
        self._started: set[str] = set()
        self._num_waiting_new = 0
        self.admission = AdmissionController() if policy is not None and policy.admission else None
        self._held_this_step = False
        # When the step in flight was planned, and how long the last steps took (planned to updated):
        # the lead proactive swap-in needs (`step_lead_s`).
        self._step_planned_at: float | None = None
        self._recent_step_s: deque[float] = deque(maxlen=RECENT_STEPS)

    # -- admission, pause, resume, removal ---------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.num_cached_tokens = request.num_tokens  # nothing computed yet; admission lowers it
        self._num_waiting_new += 1
        self._enqueue(self.waiting, request, RequestStatus.WAITING)

    def _enqueue(self, queue: list[Request], request: Request, status: RequestStatus) -> None:
        request.status = status
        request.priority = self._priority(request)
        bisect.insort(queue, request, key=_by_priority)

    def _priority(self, request: Request) -> tuple:
        """The request's place in every queue: its own `priority` (SamplingParams: vLLM's, lower first),
        then the policy's program-level rule (`Policy.priority`), fixed while it stays queued: its
        service counts what was computed before it was queued, so the running queue keeps its order as
        it computes."""
        rule = self.policy.priority if self.policy is not None else "arrival"
        if rule == "las":
            order = (request.num_service_tokens, request.program_arrival)
        elif rule == "program-arrival":
            order = (request.program_arrival,)
        else:
            order = (request.arrival_time,)
        return (request.sampling_params.priority, *order)

    def _dequeue(self, request: Request) -> None:
        """Take the request out of the queue its status names (only that one: a long waiting queue
        is not searched for a running request that pauses)."""
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting,
                 RequestStatus.SWAPPED: self.swapped}.get(request.status)
        if queue is not None and request in queue:
            queue.remove(request)
        self.paused.pop(request.request_id, None)
        self.paused_kv.remove(request.request_id)
        self._undecided.discard(request.request_id)
        self._prefetched.discard(request.request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and release its blocks."""
        if request.request_id in self._started:
            self._started.remove(request.request_id)
        elif request.request_id in self.requests:
            self._num_waiting_new -= 1  # never scheduled: it was waiting as a new program
        self._dequeue(request)
        request.status = status
        self.blocks.free(request.request_id)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def pause(self, request: Request, tool_calls: list) -> None:
        """Intercept a running request: it keeps its id, arrival time, tokens and (for now) its KV."""
        self._dequeue(request)
        request.status = RequestStatus.INTERCEPTED
        request.pending_stop = None
        request.paused_at = self.clock()
        request.tool_calls = list(tool_calls)
        self.paused[request.request_id] = request
        self.paused_kv.add(request, *self.kv_tokens(request))
        if self.policy is not None:
            self._undecided.add(request.request_id)

    def resume(self, request_id: str, appended_token_ids: list[int], result_at: float | None = None) -> Request:
        """Continue a paused request with the tokens the interception returned; `result_at`: when the
        result arrived (default now). The tool's duration history records the pause up to then, not up
        to this call: a resume waits for the step in flight to end, and counting that wait would teach the
        history that every call lasts a step longer than it does (on a CPU, hundreds of ms: proactive
        swap-in, timed by the history, would then start after the result is already back)."""
        self.decide_fresh_pause(request_id)
        request = self.paused.pop(request_id)
        self.paused_kv.remove(request_id)
        self._prefetched.discard(request_id)
        now = self.clock()
        ended = now if result_at is None else min(result_at, now)
        self.estimator.observe(request.duration_key, max(ended - request.paused_at, 0.0))
        request.token_ids += appended_token_ids
        request.turn_start = len(request.token_ids)
        request.output_logprobs = []  # per turn, like the generated tokens
        request.paused_at = None
        request.num_turns += 1
        device, host = self.kv_tokens(request)
        # The turn reuses what it kept; a discarded context is admitted again and reuses what the prefix
        # cache still holds (admission lowers this bound to that).
        request.num_cached_tokens = device + host or request.num_tokens
        if host:
            self._enqueue(self.swapped, request, RequestStatus.SWAPPED)
        elif request.num_computed_tokens == 0:  # discarded: recompute through the waiting queue
            if self.policy is not None and not self.policy.keeps_arrival_time:
                request.arrival_time = now  # today's servers: a new request at the tail
            request.recompute_all = self.policy is not None and not self.policy.chunked_recompute
            self._enqueue(self.waiting, request, RequestStatus.WAITING)
        else:
            self._enqueue(self.running, request, RequestStatus.RUNNING)
        return request

    def decide_fresh_pause(self, request_id: str) -> None:
        """Before a resume: a pause no step has planned yet (the synchronous API, or a client faster
        than the engine thread) still gets the policy's decision at the interception, so a discarding
        policy drops the KV and the turn recomputes as the system it stands for would. A swap-out is not
        carried out: the request runs in the next step, so the copy would be undone at once (the
        synchronous swap baseline is spared one round trip here, and only here)."""
        if request_id not in self._undecided:
            return
        self._undecided.discard(request_id)
        request = self.paused[request_id]
        if self.policy is None or self.profile is None or not self.kv_tokens(request)[0]:
            return
        plan = self.policy.plan([self._paused_info(request)], self._iteration_info(0), self.profile)
        if plan.action(request.request_id) is KVAction.DISCARD:
            self._discard(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something to compute or copy, or a fresh pause to plan, or a paused request's host KV due back
        (proactive swap-in: the engine steps for it even when nothing else runs, and `idle_wake_s` says
        when to look again); paused requests the policy has seen leave the engine idle otherwise."""
        if self.running or self.waiting or self.swapped or self._undecided:
            return True
        return self.blocks.num_free_blocks > 0 and bool(self._prefetch_candidates())

    def idle_wake_s(self) -> float | None:
        """With nothing to run, how long the engine may sleep before a paused request's host KV could be
        due back (`resume_imminent`), or None: nothing predicted holds host KV. Early, never late: the
        earliest host key (`_host_holders_due_by`), which is early until it is looked at again."""
        if not self._prefetches() or self.blocks.num_free_blocks == 0:
            return None  # nothing to bring back, or no room for it until a resume or arrival
        now = self.clock()
        self._host_holders_due_by(-math.inf)  # key the new host holders (none is due: `has_work` said so)
        wake = self.paused_kv.next_host_key() - now - self.step_lead_s()
        # A hair late, so that at the wake the resume is imminent by a strict margin, not by rounding.
        return None if wake == math.inf else max(wake, 0.0) + WAKE_EARLY_S

    # -- where KV lives ----------------------------------------------------------------------------
    def kv_tokens(self, request: Request) -> tuple[int, int]:
        """(device, host) tokens of the request's computed KV."""
        host = min(self.blocks.num_host_blocks_of(request.request_id) * self.blocks.block_size,
                   request.num_computed_tokens)
        return request.num_computed_tokens - host, host

    def kv_location(self, request_id: str) -> dict[str, int]:
        """Tokens of the request's context whose KV is on the device, on the host, or not computed
        (discarded, or never computed yet); `cached`: of the discarded ones, those the prefix cache
        still holds (reused without computing when the request is admitted again)."""
        request = self.requests[request_id]
        device, host = self.kv_tokens(request)
        cached = len(self._prefix_hit(request)) * self.blocks.block_size if not device + host else 0
        return {"device": device, "host": host, "discarded": request.num_tokens - device - host, "cached": cached}

    def _prefix_hit(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of a request without KV; at least its last token is
        left to compute, since the next token is sampled from it."""
        if not self.blocks.enable_caching:
            return []
        bs = self.blocks.block_size
        request.block_hashes = chain_hashes(request.token_ids, bs, request.block_hashes, request.cache_salt)
        reusable = (request.num_tokens - 1) // bs
        if request.needs_prompt_logprobs:  # only the positions whose logprobs it has may be skipped
            reusable = min(reusable, (len(request.prompt_logprobs) - 1) // bs)
        return self.blocks.match_prefix(request.block_hashes[:reusable])

    def _register_computed(self, request: Request) -> None:
        """Make the request's computed full blocks findable by content."""
        bs = self.blocks.block_size
        full = request.num_computed_tokens // bs
        if full <= self.blocks.num_registered(request.request_id):
            return  # no block filled since (most decode steps)
        if len(request.block_hashes) < full:
            request.block_hashes = chain_hashes(request.token_ids[:full * bs], bs, request.block_hashes,
                                                request.cache_salt)
        self.blocks.register_blocks(request.request_id, request.block_hashes[:full])

    def paused_device_tokens(self) -> int:
        """KV tokens paused requests hold on the device: idle memory."""
        return self.paused_kv.device_tokens

    def _kv_moved(self, request: Request) -> None:
        """A request's KV changed place: keep the paused index in step (no-op for unpaused ones)."""
        if request.request_id in self.paused_kv:
            self.paused_kv.moved(request.request_id, *self.kv_tokens(request))

    def _kv_state(self, request: Request) -> str:
        return kv_state(*self.kv_tokens(request))

    # -- schedule ---------------------------------------------------------------------------------
    def _discard(self, request: Request) -> int:
        """Drop a paused (or swapped) request's KV; it is recomputed on resume. Returns tokens dropped."""
        dropped = request.num_computed_tokens
        self.blocks.free(request.request_id, keep_cached=self.policy is None or self.policy.lazy_discard)
        request.num_computed_tokens = 0
        self._kv_moved(request)
        if request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            request.recompute_all = self.policy is not None and not self.policy.chunked_recompute
            self._enqueue(self.waiting, request, RequestStatus.WAITING)
        return dropped

    def _preempt(self, out: SchedulerOutput, request: Request) -> None:
        """Take a running request off the device: its KV goes to the host when the policy finds that
        cheaper than recomputing it (`Policy.reclaim`) and the host has room, else it is freed and the
        request recomputes from the waiting queue (vLLM's preemption by recompute)."""
        self.running.remove(request)
        request.num_preemptions += 1
        out.num_preempted += 1
        self._preempted_this_step = True
        blocks = len(self.blocks.block_table(request.request_id))
        if blocks and self._swap_out_chosen(request) and self.blocks.can_swap_out(blocks):
            out.swap_out += self.blocks.swap_out(request.request_id, blocks)
            out.num_reclaim_swap_out_blocks += blocks
            out.num_preempted_by_swap += 1
            out.num_thrashed_tokens += request.num_computed_tokens  # swapped out now, back in later
            self._enqueue(self.swapped, request, RequestStatus.SWAPPED)
            return
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        self._enqueue(self.waiting, request, RequestStatus.WAITING)

    def _swap_budget_tokens(self) -> int | None:
        """N_i: tokens whose copy time equals this iteration's forward time. None = unlimited: also in a
        step with nothing to run (it only plans fresh pauses), where no forward pass could hide the copy
        and none waits for it; a budgeted swap would otherwise stop half-way until new work arrives."""
        if self.profile is None or (self.policy is not None and self.policy.swap_synchronous):
            return None
        if not (self.running or self.waiting or self.swapped):
            return None
        return iteration_swap_limit(self.profile, self._last_batched_tokens)

    def _paused_info(self, r: Request) -> PausedInfo:
        """How the policy sees a paused request (or a running one about to be preempted: away for no
        expected time, its KV all on the device)."""
        device, _ = self.kv_tokens(r)
        if r.paused_at is None:
            return PausedInfo(r.request_id, r.arrival_time, r.num_tokens, self._kv_state(r), device, 0.0, 0.0)
        now = self.clock()
        if self.policy is not None and self.policy.expected_waste:
            # One pass over the tool's history: the estimate is the samples' mean (`DurationEstimator`).
            remaining = self.estimator.remaining(now, r.paused_at, r.duration_key, r.duration_hint)
            expected = mean_of(remaining)
        else:
            remaining = None
            expected = self.estimator.estimate(now, r.paused_at, r.duration_key, r.duration_hint)
        return PausedInfo(r.request_id, r.arrival_time, r.num_tokens, self._kv_state(r), device,
                          now - r.paused_at, expected, remaining, r.request_id in self._prefetched)

    def _plan_paused(self, out: SchedulerOutput, swap_in_demand: int) -> int | None:
        """Apply the policy's decisions to paused requests; returns the swap-in budget in tokens."""
        total = self._swap_budget_tokens()
        bs = self.blocks.block_size
        free_device = self.blocks.num_free_blocks * bs
        free_host = self.blocks.num_free_host_blocks * bs
        if self.policy is None or self.profile is None or not self.paused:
            return total
        swap_out_demand = self.paused_kv.device_tokens
        if total is None:
            swap_in_budget, swap_out_budget = None, swap_out_demand
        else:
            split = split_swap_budget(total, swap_in_demand, swap_out_demand, free_device, free_host)
            swap_in_budget, swap_out_budget = split.swap_in, split.swap_out
        if not swap_out_demand:
            return swap_in_budget  # no paused request holds device KV: nothing to decide
        iteration = self._iteration_info(swap_out_budget)
        # The holders whose decision could differ from "preserve" now; the others sleep (paused_kv.py).
        due = self.paused_kv.to_plan(self.clock(), iteration.num_running_tokens, swap_room(iteration) > 0,
                                     self.profile.t_fwd(iteration.num_batched_tokens), ample=memory_ample(iteration))
        infos = {r.request_id: self._paused_info(r) for r in due}
        plan = self.policy.plan(list(infos.values()), iteration, self.profile)
        for decision in plan:
            request = self.paused[decision.request_id]
            if decision.action is KVAction.DISCARD:
                out.num_discarded_tokens += self._discard(request)
            elif decision.action is KVAction.SWAP_OUT:
                self._swap_out_or_discard(out, request, -(-decision.swap_out_tokens // bs))
            else:  # preserved: it sleeps until its policy's guard may be crossed (`PausedKV.settle_preserved`)
                info = infos[request.request_id]
                guard = self.policy.preserve_guard(info, iteration, self.profile)
                self.paused_kv.settle_preserved(request, info, guard, request.duration_key, request.duration_hint)
        return swap_in_budget

    def _iteration_info(self, swap_out_budget: int) -> IterationInfo:
        running_tokens = sum(r.num_computed_tokens for r in self.running)
        return IterationInfo(running_tokens, self._last_batched_tokens, swap_out_budget,
                             self.blocks.num_free_host_blocks * self.blocks.block_size, self._spare_device_tokens(),
                             self.step_lead_s() if self.policy is not None and self.policy.prefetch else None)

    def _spare_device_tokens(self) -> int | None:
        """Free device tokens less what queued work will need there: the waiting requests' uncomputed
        tokens (no prefix hit assumed), the host KV of swapped and paused requests, and one step's new
        KV. Only for a policy that reads it (`Policy.ample_preserve`): it walks the queues."""
        if self.policy is None or not self.policy.ample_preserve:
            return None
        need = (sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
                + sum(self.kv_tokens(r)[1] for r in self.swapped) + self.paused_kv.host_tokens
                + self.config.max_num_batched_tokens)
        return self.blocks.num_free_blocks * self.blocks.block_size - need

    def _swap_out_or_discard(self, out: SchedulerOutput, request: Request, blocks: int) -> None:
        """Swap `blocks` of a paused request's device KV to the host; discard it if the host is full."""
        if self.blocks.can_swap_out(blocks):
            out.swap_out += self.blocks.swap_out(request.request_id, blocks)
            self._kv_moved(request)
        else:
            out.num_discarded_tokens += self._discard(request)

    def _swap_in(self, out: SchedulerOutput, budget_tokens: int | None) -> int | None:
        """Bring swapped requests' KV back, oldest first, within the swap-in budget. A resumed request
        is running work: like a running request it may take paused requests' device KV for room."""
        bs = self.blocks.block_size
        budget = None if budget_tokens is None else -(-budget_tokens // bs)
        for request in list(self.swapped):
            if request.status is not RequestStatus.SWAPPED:
                continue  # an older one's room discarded it meanwhile (it waits to be recomputed)
            want = self.blocks.num_host_blocks_of(request.request_id)
            n = want if budget is None else min(want, budget)
            reserve = self._growth_blocks(request)
            while self.blocks.num_free_blocks < n + reserve and (
                    self._free_paused_for_room(out) or self._evict_newer_swapping_in(out, request)):
                pass
            n = max(min(n, self.blocks.num_free_blocks - reserve), 0)
            if n:
                out.swap_in += self.blocks.swap_in(request.request_id, n)
                self._swapped_in_this_step.add(request.request_id)
                if budget is not None:
                    budget -= n
            if n == want:
                self.swapped.remove(request)
                self._enqueue(self.running, request, RequestStatus.RUNNING)
            if budget == 0 or self.blocks.num_free_blocks == 0:
                break
        return budget

    def step_lead_s(self) -> float:
        """How long the next step may run before the scheduler can act again: the longest of the last
        `RECENT_STEPS` steps as measured, and at least the profile's forward time of a full token budget.
        Proactive swap-in must act this far ahead of a resume. The profile alone times the model's
        forward pass; a real step also samples, detokenizes and copies, and decode steps over long
        contexts read more KV than the profile's prefill (a burst of agents on the real server on a CPU:
        profile 0.25 s, steps up to 0.7 s)."""
        profiled = self.profile.t_fwd(self.config.max_num_batched_tokens) if self.profile is not None else 0.0
        return max(profiled, max(self._recent_step_s, default=0.0))

    def _prefetches(self) -> bool:
        return (self.policy is not None and self.profile is not None and self.policy.prefetch
                and self.paused_kv.host_tokens > 0)

    def _host_holders_due_by(self, horizon: float) -> list[tuple[Request, int, float]]:
        """Paused requests with KV on the host that may be due back before `horizon` (or have no key
        yet: `PausedKV.host_holders_before`) and whose remaining pause is predicted (a hint, the tool's
        history: the elapsed-time rule cannot say a resume is near), with their host tokens and that
        expected remaining time. Each is keyed again by when its copy back could first be due
        (`prefetch.key_time`; early until its tool's history changes: `key_host`). Only the estimate,
        not the full `_paused_info` with its remaining-time distribution."""
        now, out = self.clock(), []
        for r in self.paused_kv.host_holders_before(horizon, now):
            host = self.kv_tokens(r)[1]
            expected = self.estimator.predicted(now, r.paused_at, r.duration_key, r.duration_hint)
            at = None if expected is None else prefetch.key_time(now, expected, self.profile, host)
            self.paused_kv.key_host(r.request_id, at, r.duration_key, self.estimator.version(r.duration_key))
            if expected is not None:
                out.append((r, host, expected))
        return out

    def _prefetch_candidates(self) -> list[tuple[Request, int]]:
        """Paused requests with KV on the host whose resume looks imminent, soonest first, with their
        host tokens: the policy's proactive swap-in (`prefetch.due`), after the resumed requests' own
        swap-ins. Only under a policy that prefetches. Not a walk over every host holder: only those
        keyed before `prefetch.horizon` are looked at."""
        if not self._prefetches():
            return []
        step_s, per_step = self.step_lead_s(), self._swap_budget_tokens()
        ahead = sum(self.kv_tokens(r)[1] for r in self.swapped)
        horizon = prefetch.horizon(self.clock(), self.profile, step_s, per_step, ahead,
                                   self.paused_kv.host_tokens) + WAKE_EARLY_S
        return prefetch.due(self._host_holders_due_by(horizon), self.profile, step_s, per_step, ahead)

    def _prefetch(self, out: SchedulerOutput, due: list[tuple[Request, int]], budget_blocks: int | None) -> None:
        """Swap in what this step's swap-in budget has left of paused requests' host KV, into device
        blocks nothing scheduled in this step needs, keeping one free block per running request for its
        next token. A wrong guess costs the budget: the plan may move the KV out again."""
        # No budget: no step runs for the copy to stall (nothing else to do, `has_work`), so bring back
        # all that fits.
        budget = math.inf if budget_blocks is None else budget_blocks
        spare = self.blocks.num_free_blocks - len(self.running)
        for request, _ in due:
            n = min(self.blocks.num_host_blocks_of(request.request_id), budget, spare)
            if n <= 0:
                break
            out.swap_in += self.blocks.swap_in(request.request_id, n)
            self._swapped_in_this_step.add(request.request_id)
            self._prefetched.add(request.request_id)
            self._kv_moved(request)
            budget -= n
            spare -= n

    def _growth_blocks(self, swapping_in: Request) -> int:
        """Device blocks a swapping-in request must leave free besides its own KV: what the running
        requests older than it need for their chunks of this step (the running loop's budget walk),
        and what its own next chunk needs, less what the newer running requests hold (FCFS: those are
        preempted for it). Taking more would only get it preempted again in the same step, its copy
        in wasted."""
        budget, need = self.config.max_num_batched_tokens, 0
        for r in self.running:
            if budget <= 0 or r.priority >= swapping_in.priority:
                break
            n = self._chunk_size(r, budget)
            need += max(self.blocks.blocks_for(r.num_computed_tokens + n) - len(self.blocks.block_table(r.request_id)), 0)
            budget -= n
        if budget > 0:
            held = len(self.blocks.block_table(swapping_in.request_id)) + self.blocks.num_host_blocks_of(
                swapping_in.request_id)
            n = self._chunk_size(swapping_in, budget)
            need += max(self.blocks.blocks_for(swapping_in.num_computed_tokens + n) - held, 0)
        newer = sum(len(self.blocks.block_table(r.request_id)) for r in self.running
                    if r.priority > swapping_in.priority)
        return max(need - newer, 0)

    def _free_paused_for_room(self, out: SchedulerOutput) -> bool:
        """Memory pressure: the newest paused request's device KV leaves the device (idle memory goes
        first). False if no paused request holds device KV."""
        newest = self.paused_kv.newest_holder()
        if newest is None:
            return False
        self._evict(out, newest)
        return True

    def _evict_newer_swapping_in(self, out: SchedulerOutput, request: Request) -> bool:
        """FCFS among swapping-in requests: the newest one newer than `request` that holds device
        blocks gives them up, so two half-swapped-in requests never wait for each other."""
        newer = self._swapping_in_newer_than(request)
        if not newer:
            return False
        self._evict(out, max(newer, key=_by_priority))
        return True

    def _swapping_in_newer_than(self, request: Request) -> list[Request]:
        """Resumed requests newer than `request` whose KV is partly back on the device."""
        return [r for r in self.swapped
                if r.priority > request.priority and self.blocks.block_table(r.request_id)]

    def _evict(self, out: SchedulerOutput, request: Request) -> None:
        """Take a paused or swapping-in request's device KV off the device. The policy says whether it
        is swapped (back) out, host room permitting, or discarded (a swapping-in one then loses its
        host part too and moves to the waiting queue). The worst case is discard + recompute."""
        if request.status is RequestStatus.SWAPPED:
            out.num_thrashed_tokens += self.kv_tokens(request)[0]  # a swap-in undone: re-swapped
        if self._swap_out_chosen(request):
            before = len(out.swap_out)
            self._swap_out_or_discard(out, request, len(self.blocks.block_table(request.request_id)))
            out.num_reclaim_swap_out_blocks += len(out.swap_out) - before
        else:
            out.num_discarded_tokens += self._discard(request)

    def _swap_out_chosen(self, request: Request) -> bool:
        """The policy would rather copy this request's device KV to the host than drop it (`reclaim`).
        Never for one swapped in during this very step: a step's swap-outs are copied before its
        swap-ins (see SchedulerOutput), so its blocks would be copied out before its KV had arrived."""
        if self.policy is None or self.profile is None or request.request_id in self._swapped_in_this_step:
            return False
        action = self.policy.reclaim(self._paused_info(request), self._iteration_info(0), self.profile)
        return action is KVAction.SWAP_OUT

    def _owed_to_swapped(self, priority: tuple) -> int:
        """Device blocks that resumed requests ahead of `priority` (older, by default) still need to bring their KV
        back from the host. Admission leaves them free: a newer request must not take the room an
        older resumed one waits for (three queues, one FCFS order; under pressure it would otherwise
        wait until the new work finishes)."""
        return sum(self.blocks.num_host_blocks_of(r.request_id) for r in self.swapped
                   if r.priority < priority)

    def _reclaim(self, out: SchedulerOutput, protect: Request) -> bool:
        """Free device blocks for a running request: paused KV goes first (it is idle), then the newest
        of the running requests and the swapping-in requests newer than `protect` (FCFS: never an
        older one) gives way. Returns False if `protect` itself had to be preempted."""
        if self._free_paused_for_room(out):
            return True
        victim = max(self._swapping_in_newer_than(protect) + [self.running[-1]], key=_by_priority)
        if victim.status is RequestStatus.SWAPPED:
            self._evict(out, victim)
            return True
        self._preempt(out, victim)
        return victim is not protect

    def _chunk_size(self, request: Request, budget: int, computed: int | None = None) -> int:
        remaining = request.num_tokens - (request.num_computed_tokens if computed is None else computed)
        return remaining if request.recompute_all else min(remaining, budget)

    def _admission(self, request: Request, budget: int) -> tuple[list[int], int, int]:
        """For a waiting request: the cached blocks it would reuse, the tokens whose KV it would then
        have, and the tokens it would compute."""
        hit = self._prefix_hit(request) if request.num_computed_tokens == 0 else []
        computed = request.num_computed_tokens + len(hit) * self.blocks.block_size
        return hit, computed, self._chunk_size(request, budget, computed)

    def _admit_waiting(self, out: SchedulerOutput, scheduled: list[tuple[Request, int]], budget: int,
                       ahead_of: tuple | None = None) -> int:
        """Admit waiting requests in queue order while the token budget, the sequence cap and the pool
        allow (only those ahead of `ahead_of` in queue order, if given); returns the budget left. No
        admissions in a step that had to preempt: the pool is full."""
        while self.waiting and budget > 0 and not self._preempted_this_step and len(self.running) < self.config.max_num_seqs:
            i = self._next_waiting()
            if i is None:
                break
            request = self.waiting[i]
            if ahead_of is not None and not request.priority < ahead_of:
                break
            reserve = self._owed_to_swapped(request.priority)
            while True:
                hit, computed, n = self._admission(request, budget)
                if (self.blocks.can_allocate(request.request_id, computed + n, hit, reserve)
                        or not self._free_paused_for_room(out)):
                    break  # paused KV never blocks new work: it is dropped (and recomputed on resume)
            if not self.blocks.can_allocate(request.request_id, computed + n, hit, reserve):
                break
            self.waiting.pop(i)
            if request.request_id not in self._started:
                self._started.add(request.request_id)
                self._num_waiting_new -= 1
            self.blocks.allocate(request.request_id, computed + n, hit)
            if request.num_computed_tokens == 0 and self.blocks.enable_caching:
                self.blocks.record_lookup((request.num_tokens - 1) // self.blocks.block_size, len(hit))
            if request.num_output_tokens == 0:
                # Reused = the turn's context below the lowest position it ever computed from. KV dropped
                # before the first token (a preemption by recompute, a swapping-in request discarded) is
                # computed again from `computed`, however much was reused before the drop.
                request.num_cached_tokens = min(request.num_cached_tokens, computed)
            request.num_computed_tokens = computed
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            scheduled.append((request, n))
            budget -= n

        return budget

    def _next_waiting(self) -> int | None:
        """Index in `waiting` of the first request that may start now: the head, unless it is a new
        program the admission cap holds back (`Policy.admission`); then the first turn of an active
        program behind it, which is never held back. None if every waiting request is held back."""
        head = self.waiting[0]
        if self.admission is None or head.request_id in self._started or self.admission.admits(len(self._started)):
            return 0
        self.admission.hold()
        self._held_this_step = True
        if len(self.waiting) == self._num_waiting_new:
            return None  # only new programs wait
        return next(i for i, r in enumerate(self.waiting) if r.request_id in self._started)

    @property
    def num_active_programs(self) -> int:
        """Requests scheduled at least once and not finished (running, paused, or waiting to resume)."""
        return len(self._started)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[])
        self._held_this_step = False
        self._step_planned_at = self.clock()
        prefetch = self._prefetch_candidates()
        # In whole blocks: a sum of token counts would round several requests' partial last blocks
        # into one, and the budget would leave each but the first a block short on the host.
        swap_in_demand = self.blocks.block_size * sum(self.blocks.num_host_blocks_of(r.request_id)
                                                      for r in self.swapped + [r for r, _ in prefetch])
        swap_in_budget = self._plan_paused(out, swap_in_demand)
        out.num_fresh_pauses_planned, self._undecided = len(self._undecided), set()
        self._swapped_in_this_step.clear()
        prefetch_blocks = self._swap_in(out, swap_in_budget)

        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        self._preempted_this_step = False
        for request in list(self.running):
            # max_num_seqs bounds the batch. `running` itself may hold more for a while: a request
            # resumed with its KV on the device (or swapped back in) joins it whatever the batch size.
            if budget <= 0 or len(scheduled) == self.config.max_num_seqs:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.pending_stop is not None:
                continue  # its turn ended; the engine's output stage, one step behind, pauses or finishes it
            if request.awaiting_sample and self._at_length_limit(request):
                continue  # its turn ends with the sample on its way (asynchronous scheduling)
            if self.swap_ins_run_next_step and request.request_id in self._swapped_in_this_step:
                continue  # its KV is on its way back while this step runs
            if self.policy is not None and self.policy.priority != "arrival":
                # One program-level order across the queues: waiting programs ahead of this running
                # one (a new program under least attained service) get the budget first. The paper's
                # order serves running requests first.
                budget = self._admit_waiting(out, scheduled, budget, ahead_of=request.priority)
                if budget <= 0 or len(scheduled) >= self.config.max_num_seqs:
                    break
            n = self._chunk_size(request, budget)
            while not self.blocks.can_allocate(request.request_id, request.num_computed_tokens + n):
                if not self._reclaim(out, protect=request):
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self.blocks.allocate(request.request_id, request.num_computed_tokens + n)
            scheduled.append((request, n))
            budget -= n

        budget = self._admit_waiting(out, scheduled, budget)

        if prefetch and prefetch_blocks != 0:
            self._prefetch(out, prefetch, prefetch_blocks)
        for r, n in scheduled:
            start = r.num_computed_tokens
            out.num_recomputed_tokens += max(0, min(start + n, r.num_computed_high) - start)
            sample = start + n == r.num_tokens
            out.chunks.append(ScheduledChunk(
                request_id=r.request_id,
                token_ids=r.token_ids[start:start + n],
                start_pos=start,
                block_table=list(self.blocks.block_table(r.request_id)),
                sample=sample,
                sampling_params=r.sampling_params,
                num_output_tokens=r.num_output_tokens,
                context_token_ids=list(r.token_ids) if sample and self._needs_context(r) else None,
                prompt_logprob_targets=(r.prompt_token_ids[start + 1:start + n + 1] or None)
                if r.needs_prompt_logprobs else None,
            ))
        out.num_thrashed_tokens += out.num_recomputed_tokens
        out.num_paused_device_tokens = self.paused_device_tokens()
        if self.admission is not None:
            out.admission_cap = self.admission.cap
            out.num_held_back = self._num_waiting_new if self._held_this_step else 0
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        self._last_batched_tokens = max(out.num_batched_tokens, 1)
        return out

    @staticmethod
    def _needs_context(request: Request) -> bool:
        """Whether the runner reads the request's tokens where it samples: its penalties count them and its
        bad words match their ends each time; a thinking budget reads, at a turn's first token, whether the
        context left it thinking."""
        params = request.sampling_params
        return (params.penalized or bool(params.bad_words)
                or (params.thinking_token_budget is not None and request.num_output_tokens == 0))

    # -- update -----------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance the scheduled requests and apply their samples; returns those that got a new token.

        A request that hit EOS, a stop token or its length limit is finished here, unless it may be
        intercepted: then `pending_stop` is set and the engine decides between finish and pause.
        """
        return self.apply_samples(self.advance(output, prompt_logprobs=runner_output.prompt_logprobs), runner_output)

    def advance(self, output: SchedulerOutput, placeholders: bool = False,
                prompt_logprobs: dict[str, list] | None = None) -> list[Request]:
        """The step ran: its requests' KV now covers their chunks (and their prompt logprobs, from
        `RunnerOutput.prompt_logprobs`, the positions the chunks computed), and its block copies were
        queued. Returns the requests it sampled a token for, in its chunks' order, for `apply_samples`.
        With `placeholders` (asynchronous scheduling: the samples are still on the device), each of them
        gets a `PLACEHOLDER` as its newest token, so the next step can be planned at once."""
        self.blocks.copies_done()  # the runner copied this step's blocks
        if self._step_planned_at is not None and output.chunks:
            self._recent_step_s.append(self.clock() - self._step_planned_at)
        if self.admission is not None:
            self.admission.observe(self.clock(), output.num_thrashed_tokens, output.num_batched_tokens,
                                   sum(c.sample for c in output.chunks), len(self._started), self._num_waiting_new)
        sampling = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING or request.pending_stop is not None:
                continue  # aborted, paused or stopped while the step ran: what it computed is dropped
            request.num_computed_tokens += len(chunk.token_ids)
            request.num_service_tokens += len(chunk.token_ids)
            request.num_computed_high = max(request.num_computed_high, request.num_computed_tokens)
            request.recompute_all = False
            if chunk.prompt_logprob_targets is not None and prompt_logprobs:
                # (a chunk computed again after a preemption writes over the same positions)
                at = chunk.start_pos + 1
                request.prompt_logprobs[at:at + len(chunk.prompt_logprob_targets)] = prompt_logprobs[chunk.request_id]
            if self.blocks.enable_caching:
                self._register_computed(request)
            if chunk.sample:
                sampling.append(request)
                if placeholders:
                    request.token_ids.append(PLACEHOLDER)
        return sampling

    def apply_samples(self, sampling: list[Request], runner_output: RunnerOutput) -> list[Request]:
        """The sampled tokens of `advance`'s requests, appended (or in place of their placeholders), and
        checked for a stop; returns the requests that got one. A request may have been preempted since
        its step was planned (asynchronous scheduling): its token counts all the same."""
        changed = []
        for request in sampling:
            if request.status.finished:
                continue  # aborted since
            sampled = runner_output.sampled[request.request_id]
            if request.awaiting_sample:
                request.token_ids[-1] = sampled.token_id
            else:
                request.token_ids.append(sampled.token_id)
            if request.sampling_params.logprobs is not None:
                request.output_logprobs.append(sampled)
            status = self._check_stop(request, sampled.token_id)
            if status is not None:
                if request.intercept is None:
                    self.finish(request, status)
                else:
                    request.pending_stop = status
            changed.append(request)
        return changed

    def _at_length_limit(self, request: Request) -> bool:
        return (request.num_output_tokens >= request.sampling_params.max_tokens
                or request.num_tokens >= self.config.max_model_len)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(request):
            return RequestStatus.FINISHED_LENGTH
        return None
