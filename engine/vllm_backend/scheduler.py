"""InferCept's policy inside vLLM: `InterceptScheduler`, a subclass of vLLM V1's `Scheduler`.

vLLM loads it by name in its engine-core process (`SchedulerConfig.scheduler_cls` names
`intercept_scheduler`, which builds it, or `AsyncInterceptScheduler` when vLLM schedules asynchronously,
as it does by default on a GPU); it refuses a model whose KV cache is not one group of full attention
(`host_tier.unsupported_kv_cache`: hybrid, sliding-window and MLA models run on stock vLLM, `--policy
prefix-cache`). It is configured by
`additional_config["infercept"]` (`scheduler_config(...)` builds it): the policy's name and, optionally,
the address of the policy channel to the worker (`PolicyChannel`). Runs on vLLM's python, with the
repository root on `sys.path`: it imports vllm and our pure-python `engine.policy`, paused-KV index
(`engine.paused_kv`) and output stage (`engine.output_stage`), nothing else of ours.

A paused generation is a vLLM streaming-input session waiting for its next chunk
(`WAITING_FOR_STREAMING_REQ`). Stock vLLM keeps its KV blocks until the session ends ("preserve", and
paused sessions can fill the pool). Here:

- every step, before vLLM's own scheduling, the policy plans the paused sessions that hold device KV
  and whose decision could change (`Policy.plan`, the same code the native engine runs, over the same
  paused-KV index, `engine/paused_kv.py`: fresh pauses, and a preserved one only once its
  `PreserveGuard` may be crossed, so sessions waiting on slow tools cost a step nothing): each keeps its
  blocks, is swapped out to the host tier (within the step's swap budget, `Profile.swap_budget_tokens`;
  a context larger than the budget is copied over several steps, going on every step, and leaves the
  device when the copy completes), or is discarded;
- when an allocation fails (a running request's next chunk, or a waiting request's admission), paused
  KV is reclaimed first, newest paused first, swapped or discarded as `Policy.reclaim` says, and only
  then does vLLM preempt a running request: paused KV never blocks live work, so a pool of paused
  sessions cannot deadlock;
- a session whose KV leaves the device is freed like a preempted request (blocks back to the pool, still
  in the prefix cache until evicted: lazy discard; `num_computed_tokens` = 0; its next chunk queues it
  in the plain waiting queue). When its next chunk arrives, vLLM's session update runs against the frontier it had, so the
  context is the same; admission then looks up the prefix cache, loads what the host holds past the hit
  (`HostTierConnector`, host_tier.py) and recomputes the rest;
- a turn ends where the backend's output stage would end it: the turn's `TurnRule` (stop strings, tool
  calls the model has moved past) is checked on every token after vLLM's own stop checks, and a match
  stops the turn as EOS does, so the session waits with its KV (vLLM's own stop strings would end it);
- a paused session waits outside vLLM's queues and counts (parked until its next chunk or its end),
  wherever its KV is: stock vLLM scans every session waiting for input every step (skipping it) and
  counts each as a running seat when it admits (its V2 model runner keeps a slot per request until the
  request ends or is preempted), so thousands of paused sessions would slow every step and as many as
  `max_num_seqs` would block every new and resumed request for good. A paused session is also reported
  to the model runner as preempted (its slot is freed; its next chunk re-adds it from scratch, as every
  chunk of a session is). vLLM's test for finished requests awaiting a connector's cleanup
  (`has_finished_requests`) counts the parked sessions too, so an engine with nothing but paused
  sessions takes no step;
- proactive swap-in (`Policy.prefetch`): after vLLM has scheduled a step, a paused session whose KV is
  all on the host and whose resume looks imminent (`engine.policy.prefetch`, the native engine's choice)
  gets device blocks that nothing queued needs, from vLLM's KV cache manager (the prefix cache's hit
  first), and the connector copies the rest back in that step, before its forward; the session is then
  paused with its KV on the device, as if it had kept it, and its resume finds it there. An engine core
  with nothing to run sleeps on its input queue: vLLM asks `has_finished_requests` before it sleeps, which
  owes a step to host KV due back, and otherwise has the worker wake the engine core when the earliest copy
  back may be due (`{"op": "wake"}`);
- after each step that changed something, the worker is sent where the paused sessions' KV is, naming
  only the sessions whose KV moved, paused, resumed or ended since the last report.

The policy runs with the parts this backend can run (`policy_parts.py`: expected waste, context cost,
deferred swaps, ample-memory preserve, whose free-pool test reads vLLM's block pool and waiting queues,
proactive swap-in, and the preemption rule for paused KV); a name asking for another (a queue order other
than arrival, admission) is refused here as at start-up.

The host tier exists when vLLM runs our connector (the backend configures it with a host pool size); without
it the swap budget is 0 and `infercept` chooses between preserve and discard.

The forward-time profile the policy needs is measured by the worker on this vLLM instance at start-up
and sent over the channel (`{"op": "profile"}`); until it arrives nothing is discarded by plan (reclaim
under memory pressure needs no profile). Tool names and client hints for the duration estimate arrive
the same way (`{"op": "pause"}`, which has the session planned again), after the server has judged the
turn; the scheduler measures each pause itself (pause to the next chunk) and feeds the estimator.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property
from multiprocessing.connection import Client, Connection

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from engine.output_stage import TurnRule, TurnWatch
from engine.paused_kv import WAKE_EARLY_S, PausedKV
from engine.policy import DurationEstimator, IterationInfo, KVAction, PausedInfo, Profile, prefetch
from engine.policy.budget import iteration_swap_limit, memory_ample, swap_room
from engine.vllm_backend.host_tier import HostTierConnector, refusal
from engine.vllm_backend.params import TURN_RULE_KEY
from engine.vllm_backend.policy_parts import vllm_policy

logger = logging.getLogger("infercept.vllm_scheduler")

CONFIG_KEY = "infercept"
PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ
# The vLLM internals this module overrides or calls: tests/test_vllm_scheduler.py checks their signatures
# against the installed vLLM, so a version bump that changes one fails there, not in production.
OVERRIDDEN = ("schedule", "update_from_output", "add_request", "_handle_stopped_request",
              "_update_request_as_session", "finish_requests", "_update_request_with_output", "has_finished_requests")
CALLED = ("_free_request_blocks", "_request_blocks_can_be_freed", "_holds_kv_blocks", "_is_blocked_waiting_status",
          "_enqueue_waiting_request", "get_request_counts")
KV_CACHE_MANAGER_CALLED = ("allocate_slots", "free", "get_computed_blocks")
RECENT_STEPS = 32  # measured steps the step lead reads (`_step_lead_s`), as the native scheduler's
QUEUE_CALLED = ("add_request", "remove_request")


def external_id(request_id: str) -> str:
    """The id the worker gave a request: vLLM's input processor appends "-" and 8 random characters
    (`InputProcessor.assign_request_id`; tests check that it still does), and the scheduler sees only
    that. Messages to and from the worker use the worker's ids."""
    head, dash, tail = request_id.rpartition("-")
    return head if dash and len(tail) == 8 else request_id


def scheduler_config(policy: str, channel: str | None = None, authkey: str | None = None) -> dict:
    """`additional_config` for vLLM's engine arguments."""
    return {CONFIG_KEY: {"policy": policy, "channel": channel, "authkey": authkey}}


@dataclass
class _Pause:
    """A paused session as the scheduler follows it; also its record in the paused-KV index
    (`engine/paused_kv.py` reads `request_id`, `num_tokens`, `priority` and `paused_at`)."""

    request: Request
    paused_at: float  # time.monotonic, the clock of the scheduler's plans
    num_tokens: int = 0  # its context at the pause (what the index counts as kept or discarded)
    tool: str | None = None
    hint_s: float | None = None
    result_at: float | None = None  # when its tool result reached the server (time.monotonic, one clock per host)
    frontier: int | None = None  # set while off the device: the computed tokens it had (vLLM's session update needs it)
    queued_at: float | None = None  # its turn's arrival: its place in vLLM's queue when its next chunk comes

    @property
    def request_id(self) -> str:
        """The worker's id (the key of `pauses` and of the index)."""
        return external_id(self.request.request_id)

    @property
    def priority(self) -> tuple:
        """Queue order: arrival, as reclaim orders paused sessions (`_newest_paused_holder`)."""
        return (self.request.arrival_time,)


class _InterceptMixin:
    """The policy hooks; mixed into vLLM's `Scheduler` and `AsyncScheduler` below."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = (self.vllm_config.additional_config or {}).get(CONFIG_KEY) or {}
        policy = config.get("policy") or "infercept"
        if (error := refusal(self.kv_cache_config, f"the policy {policy!r} (InterceptScheduler)")) is not None:
            raise ValueError(error)
        self.intercept_policy = vllm_policy(policy)  # a part only the native engine runs: refused
        self.profile: Profile | None = None
        self.estimator = DurationEstimator()
        self.pauses: dict[str, _Pause] = {}
        self.recompute_from: dict[str, int] = {}  # resumed after a discard -> its frontier before
        self.resumed_hits: dict[str, int] = {}  # resumed after a discard, this turn -> its prefix-cache hit
        self.counters = {"discarded_tokens": 0, "reclaimed_tokens": 0, "recomputed_tokens": 0,
                         "num_discards": 0, "num_reclaims": 0, "num_swaps": 0}
        # The host tier, when vLLM runs our connector (`host_tier.py`): swapped sessions' KV waits there.
        self.host_tier = self.connector if isinstance(self.connector, HostTierConnector) else None
        self._last_batched_tokens = self.max_num_scheduled_tokens
        self._stock_allocate = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_or_reclaim
        self.channel: Connection | None = None
        if config.get("channel"):
            self.channel = Client(config["channel"], authkey=bytes.fromhex(config["authkey"]))
        self._reported: tuple | None = None  # the resumed hits and counters last sent
        self._moved: set[str] = set()  # sessions whose KV location the worker has not been sent since it changed
        self._next_grammar: dict = {}  # session -> its next chunk's StructuredOutputRequest (or None)
        self._parked: set[str] = set()  # paused sessions kept out of vLLM's queues (vLLM's ids)
        self._prefetched: set[str] = set()  # paused sessions whose host KV came back before their resume
        # Steps scheduled, not yet updated: (when, ran tokens); vLLM has at most its batch queue's in flight.
        self._planned_at: deque[tuple[float, bool]] = deque(maxlen=8)
        self._recent_step_s: deque[float] = deque(maxlen=RECENT_STEPS)
        self._wake_sent = -math.inf  # the last time the worker was asked to wake the engine (`_idle_prefetch`)
        self._idle_stuck = False  # an idle step found a prefetch due and could bring none back
        self.turn_watches: dict[str, TurnWatch] = {}  # request -> its turn's rule, while the turn runs
        self._tokenizer = None  # loaded for the first turn with a rule

    # -- vLLM's hooks -------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        try:
            self._read_channel()
            self._plan()
        except Exception:  # a fault in our policy must not take vLLM down: this step runs as stock vLLM
            logger.exception("the InferCept policy failed before this step; it runs without a plan")
        planned_at = time.monotonic()
        out = super().schedule(*args, **kwargs)
        self._planned_at.append((planned_at, out.total_num_scheduled_tokens > 0))
        self._last_batched_tokens = out.total_num_scheduled_tokens or self._last_batched_tokens
        try:
            self._prefetch(out)
        except Exception:
            logger.exception("the InferCept policy's proactive swap-in failed in this step; it goes on without")
        for new in out.scheduled_new_reqs:
            frontier = self.recompute_from.pop(external_id(new.req_id), None)
            if frontier is not None:
                self.counters["recomputed_tokens"] += max(frontier - new.num_computed_tokens, 0)
                self.resumed_hits[external_id(new.req_id)] = new.num_computed_tokens
        self._report()
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        """vLLM's, and the step's time from its planning (the step lead proactive swap-in needs: vLLM
        updates steps in the order it scheduled them)."""
        if self._planned_at:
            planned_at, ran = self._planned_at.popleft()
            if ran:
                self._recent_step_s.append(time.monotonic() - planned_at)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _update_request_with_output(self, request: Request, new_token_ids: list[int], *args, **kwargs):
        """vLLM's stop checks, then the turn's rule (`TurnRule`, sent by the backend in the turn's
        `extra_args`) on every token: a stop string, or tool calls the model has moved past, end the turn
        there, as EOS would (a session then waits for its next chunk with its KV)."""
        rule = (request.sampling_params.extra_args or {}).get(TURN_RULE_KEY) if request.sampling_params else None
        if rule is None:
            return super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        watch = self.turn_watches.get(request.request_id)
        if watch is None or request.num_output_tokens == 0:  # the turn's first token
            watch = self.turn_watches[request.request_id] = TurnWatch(
                self._turn_tokenizer(), request.all_token_ids, TurnRule.from_dict(rule))
        kept: list[int] = []
        for token in new_token_ids:
            taken, stopped = super()._update_request_with_output(request, [token], *args, **kwargs)
            kept += taken
            if stopped:
                return kept, True
            ends, stop_string = watch.add(token)
            if ends:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_string
                return kept, True
        return kept, False

    def _turn_tokenizer(self):
        """The model's tokenizer as the backend's output stage decodes with it (Hugging Face's)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            config = self.vllm_config.model_config
            self._tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, revision=config.tokenizer_revision,
                                                            trust_remote_code=config.trust_remote_code)
        return self._tokenizer

    def _handle_stopped_request(self, request: Request) -> bool:
        self.turn_watches.pop(request.request_id, None)
        finished = super()._handle_stopped_request(request)
        self.resumed_hits.pop(external_id(request.request_id), None)
        if not finished and request.status == PAUSED:
            rid = external_id(request.request_id)
            self._forget_pause(rid)  # (none: a session pauses once a turn)
            pause = self.pauses[rid] = _Pause(request, time.monotonic(),
                                              max(request.num_tokens, request.num_computed_tokens))
            self.paused_kv.add(pause, *self._kv_tokens(pause))
            self._moved.add(rid)
            if self._host_tokens(pause):  # a copy of its prefix left from an earlier pause: its swap goes on
                self._swapping[rid] = pause
            self.reset_preempted_req_ids.add(request.request_id)  # the model runner frees its slot next step
            self._park(request, pause)
        return finished

    def _park(self, request: Request, pause: _Pause) -> None:
        """Take a paused session out of vLLM's queues and counts until its next chunk: vLLM would scan it
        every step (skipping it: blocked) and count it as holding a seat; parked, it costs a step nothing.
        `pause.queued_at` keeps its place: the arrival its turn had."""
        pause.queued_at = request.arrival_time
        self.deferred_waiting.discard(request)
        queue = self.kv_holding_waiting if self._holds_kv_blocks(request) else self.waiting
        if isinstance(queue, deque) and queue and queue[-1] is request:
            queue.pop()  # where vLLM has just put it
        else:
            queue.remove_request(request)
        self.num_waiting_for_streaming_input -= 1
        self._parked.add(request.request_id)

    def _unpark(self, request: Request) -> bool:
        """Back into vLLM's counts (its next chunk or its end arrived); True if it was parked."""
        if request.request_id not in self._parked:
            return False
        self._parked.discard(request.request_id)
        self.num_waiting_for_streaming_input += 1  # as vLLM counted it: its update or finish uncounts it
        return True

    def _requeue(self, session: Request, queued_at: float | None) -> None:
        """A parked session whose next chunk arrived back in vLLM's queue: with a policy that keeps
        arrival order, ahead of the requests that arrived after its turn did, else at the tail."""
        if queued_at is None or not self.intercept_policy.keeps_arrival_time:
            self._enqueue_waiting_request(session)
            return
        if self._is_blocked_waiting_status(session.status):
            self.deferred_waiting.add(session)
        queue = self.kv_holding_waiting if self._holds_kv_blocks(session) else self.waiting
        if not isinstance(queue, deque):
            queue.add_request(session)
            return
        at = next((i for i, r in enumerate(queue) if r.arrival_time > queued_at), len(queue))
        queue.insert(at, session)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # a session's next chunk: its grammar, if any, is the turn's
            self._next_grammar[external_id(request.request_id)] = request.structured_output_request
        super().add_request(request)

    def _update_request_as_session(self, session: Request, update) -> None:
        rid = external_id(session.request_id)
        self._read_channel()  # the result's arrival time, sent ahead of this input
        parked = self._unpark(session)
        pause = self._forget_pause(rid)
        if pause is not None:
            # Until the result arrived, not until this step: as the native scheduler (`Scheduler.resume`).
            now = time.monotonic()
            ended = now if pause.result_at is None else min(pause.result_at, now)
            self.estimator.observe(pause.tool, max(ended - pause.paused_at, 0.0))
        if pause is None or pause.frontier is None:
            if self.host_tier is not None:
                self.host_tier.drop(session.request_id)  # resumed before its swap completed: the device has it
            super()._update_request_as_session(session, update)
        else:
            # Discarded: vLLM's update keeps the tokens up to the computed frontier and drops the rest (the
            # last sampled token), so it runs against the frontier the session had; then nothing is computed.
            session.num_computed_tokens = pause.frontier
            super()._update_request_as_session(session, update)
            session.num_computed_tokens = 0
            self.recompute_from[rid] = pause.frontier
        # vLLM 0.32 keeps a session's first grammar for every later chunk (finished, it would end each
        # turn at once); each turn gets its own, compiled as vLLM compiled it for the chunk, or none.
        session.structured_output_request = self._next_grammar.pop(rid, None)
        if session.structured_output_request is not None:
            session.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR  # until it is compiled
        if parked:
            self._requeue(session, pause.queued_at if pause is not None else None)

    def finish_requests(self, request_ids, finished_status):
        ids = (request_ids,) if isinstance(request_ids, str) else None if request_ids is None else list(request_ids)
        for rid in self._parked.intersection(self.requests if ids is None else ids):
            self._unpark(self.requests[rid])  # (vLLM's finish uncounts it and finds it in no queue: nothing to remove)
        finished = super().finish_requests(ids, finished_status)
        self._idle_stuck = False  # their blocks are free: an idle step may find room for host KV due back
        for request in finished:
            self.turn_watches.pop(request.request_id, None)
            rid = external_id(request.request_id)
            self._forget_pause(rid)
            self.recompute_from.pop(rid, None)
            self.resumed_hits.pop(rid, None)
            self._next_grammar.pop(rid, None)
        return finished

    def has_finished_requests(self) -> bool:
        """vLLM's test, with parked sessions counted: with a KV connector vLLM takes every request in
        `requests` beyond its queues for a finished one awaiting the connector's cleanup, and the engine
        core would step without end while any session is parked (each step planning the paused sessions,
        so a fresh pause's KV would leave the device at once). vLLM asks it only when nothing runs or
        waits: then a step is also owed to a paused session whose host KV is due back (`_idle_prefetch`)."""
        if self.finished_req_ids or self.connector is None or not self._parked:
            return super().has_finished_requests()
        num_running, num_waiting = self.get_request_counts()
        return len(self.requests) > num_running + num_waiting + len(self._parked) or self._idle_prefetch()

    # -- the policy ---------------------------------------------------------------------------------
    @cached_property
    def paused_kv(self) -> PausedKV:
        """The paused sessions in the native scheduler's index (`engine/paused_kv.py`): where their KV is,
        and which of them a plan must see. Made on first use, over this scheduler's tool durations."""
        return PausedKV(True, self.estimator)

    @cached_property
    def _swapping(self) -> dict[str, _Pause]:
        """Paused sessions whose swap-out runs over several steps (a part on the host, every block still on
        the device): they go on every step (`_continue_swaps`), outside the plan."""
        return {}

    def _plan(self) -> None:
        """Swaps in progress go on; then the policy plans the paused sessions holding device KV whose
        decision could differ from PRESERVE now (`PausedKV.to_plan`: fresh pauses, those it did not
        preserve under a guard, and preserved ones whose `PreserveGuard` may be crossed), and the ones it
        preserves sleep until then (`PausedKV.settle_preserved`)."""
        if self.profile is None or not self.paused_kv.device_tokens:
            return  # no profile yet, or no paused session holds device KV: nothing to decide
        now = time.monotonic()
        iteration = self._iteration_info()
        iteration = replace(iteration, swap_out_budget=self._continue_swaps(iteration.swap_out_budget))
        due = self.paused_kv.to_plan(now, iteration.num_running_tokens, swap_room(iteration) > 0,
                                     self.profile.t_fwd(iteration.num_batched_tokens), ample=memory_ample(iteration))
        infos = {p.request_id: self._paused_info(p, now) for p in due if p.request_id not in self._swapping}
        plan = self.intercept_policy.plan(list(infos.values()), iteration, self.profile)
        for decision in plan:
            rid = external_id(decision.request_id)
            pause = self.pauses[rid]
            if decision.action is KVAction.DISCARD:
                self._leave_device(pause, reclaimed=False)
            elif decision.action is KVAction.SWAP_OUT:
                self._swap_part(pause, decision.swap_out_tokens)
            else:  # PRESERVE keeps the blocks, and the session sleeps while its policy's guard holds
                guard = self.intercept_policy.preserve_guard(infos[rid], iteration, self.profile)
                self.paused_kv.settle_preserved(pause, infos[rid], guard, pause.tool, pause.hint_s)

    # -- proactive swap-in ----------------------------------------------------------------------------
    def _prefetches(self) -> bool:
        return (self.intercept_policy.prefetch and self.profile is not None and self.host_tier is not None
                and self.paused_kv.host_tokens > 0)

    def _step_lead_s(self) -> float:
        """How long the next step may run before the scheduler can act again: the longest of the last
        `RECENT_STEPS` steps as measured (planned to updated), and at least the profile's forward time of
        a full token budget; as the native scheduler's `step_lead_s`."""
        profiled = self.profile.t_fwd(self.max_num_scheduled_tokens) if self.profile is not None else 0.0
        return max(profiled, max(self._recent_step_s, default=0.0))

    def _prefetch_candidates(self) -> list[tuple[_Pause, int]]:
        """Paused sessions whose KV is all on the host and whose resume looks imminent, soonest first,
        with their host tokens (`prefetch.due`: the policy's decision, as on the native engine). Only the
        host holders keyed before `prefetch.horizon` are looked at; each is keyed again by when its copy
        back could first be due (`prefetch.key_time`), or, with no prediction (no tool history, no hint),
        by its tool only. A session whose swap-out is still going on (its KV partly on the host) is not
        a candidate; it is looked at again once its KV moves."""
        now, step_s = time.monotonic(), self._step_lead_s()
        horizon = prefetch.horizon(now, self.profile, step_s, None, 0, self.paused_kv.host_tokens) + WAKE_EARLY_S
        holders = []
        for pause in self.paused_kv.host_holders_before(horizon, now):
            host = self._host_tokens(pause)
            expected = None
            if pause.frontier is not None:
                expected = self.estimator.predicted(now, pause.paused_at, pause.tool, pause.hint_s)
            at = None if expected is None else prefetch.key_time(now, expected, self.profile, host)
            self.paused_kv.key_host(pause.request_id, at, pause.tool, self.estimator.version(pause.tool))
            if expected is not None:
                holders.append((pause, host, expected))
        return prefetch.due(holders, self.profile, step_s, None)

    def _prefetch(self, out) -> None:
        """Proactive swap-in after vLLM scheduled this step: the sessions whose host KV is due back
        (`_prefetch_candidates`) get device blocks from vLLM's KV cache manager, past what the prefix
        cache still holds of them, and the connector copies the rest in this step (`swap_in_now`: the
        same copies, in the same order on the worker, as a resume's load; marked synchronous, so vLLM
        loads before the forward). Only blocks the next step needs for queued work stay free: vLLM's free
        blocks less what the running requests still have to compute and their next token, and what the
        next step may admit of the waiting requests' tokens (one step's token budget); later admissions
        take paused KV back as memory pressure does (reclaim), as on the native engine, where prefetch
        keeps one block per running request. A session comes back whole (its KV split between the pools is
        nothing vLLM's admission could load), so the step's swap budget lets sessions through while any of
        it is left, the last one's copy running over it; a step that runs nothing has no budget (no forward
        for the copy to stall). Those the room cannot take are passed over for smaller ones behind them."""
        if not self._prefetches():
            return
        meta, ran = out.kv_connector_metadata, out.total_num_scheduled_tokens > 0
        # Its lead is one step, whatever the budget: the copy back is whole, in one step, and the plan keeps
        # prefetched KV only while its resume is that near (`Policy`'s waste plan); counting the budget's
        # steps ahead would bring it back early, for the plan to send it away again.
        due = self._prefetch_candidates()
        budget = math.inf
        if ran:  # after this step's loads
            budget = iteration_swap_limit(self.profile, self._last_batched_tokens) - len(meta.swap_in) * self.block_size
        self._idle_stuck = False
        if not due or budget <= 0:
            return
        waiting = self._waiting_tokens()
        spare = (self.kv_cache_manager.block_pool.get_num_free_blocks()
                 - sum(-(-(r.num_tokens - r.num_computed_tokens + 1) // self.block_size) for r in self.running)
                 - -(-min(waiting, self.max_num_scheduled_tokens) // self.block_size))
        brought = False
        for pause, host in due:
            if budget <= 0:
                break
            need = -(-host // self.block_size)
            if need <= spare and self._bring_back(pause, meta):
                spare -= need
                budget -= host
                brought = True
        out.has_sync_kv_loads = out.has_sync_kv_loads or brought
        self._idle_stuck = not ran and not brought

    def _bring_back(self, pause: _Pause, meta) -> bool:
        """Device blocks for a paused session whose KV is all on the host, the prefix cache's hit first,
        and the copy of the rest into them this step; it is then paused with its KV on the device, as if
        it had kept it. False (nothing changed) if the pool cannot take it."""
        request, frontier = pause.request, pause.frontier
        if frontier is None or self._host_tokens(pause) != frontier:
            return False
        hit_blocks, hit, _ = self.kv_cache_manager.get_computed_blocks(request)
        if hit > frontier or self._stock_allocate(request, 0, num_new_computed_tokens=hit, new_computed_blocks=hit_blocks,
                                                  num_external_computed_tokens=frontier - hit) is None:
            return False
        device = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        self.host_tier.swap_in_now(meta, request.request_id, device, hit)
        request.num_computed_tokens = frontier
        pause.frontier = None
        self._prefetched.add(pause.request_id)
        self.paused_kv.moved(pause.request_id, *self._kv_tokens(pause))
        self._moved.add(pause.request_id)
        return True

    def _idle_prefetch(self) -> bool:
        """With nothing running or waiting: whether a step is owed to a paused session's host KV that is
        due back and fits (the step brings it back), after the policy channel's news (a pause's tool or
        hint keys its host KV again). If not, the worker is asked to wake the engine when the earliest
        host key less a step lead has passed (vLLM's engine core sleeps on its input queue until then)."""
        self._read_channel()
        if not self._prefetches() or self._idle_stuck:
            return False
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        if any(-(-host // self.block_size) <= free for _, host in self._prefetch_candidates()):
            return True
        now, wake = time.monotonic(), self.paused_kv.next_host_key() - self._step_lead_s() + WAKE_EARLY_S
        if now < wake < math.inf and (wake != self._wake_sent or self._wake_sent <= now):
            self._wake_sent = wake
            self._send({"op": "wake", "at": wake})
        return False

    def _continue_swaps(self, budget: int) -> int:
        """Swaps begun in an earlier step go on first, oldest first, within the step's budget (it is
        the same decision, not a new one); returns the budget left."""
        for pause in sorted(self._swapping.values(), key=lambda p: p.request.arrival_time):
            left = pause.request.num_computed_tokens - self._host_tokens(pause)
            amount = left if left <= budget else budget // self.block_size * self.block_size
            if amount > 0:
                self._swap_part(pause, amount)
                budget -= amount
        return budget

    def _swap_part(self, pause: _Pause, num_tokens: int) -> None:
        """Copy `num_tokens` more of a paused session's KV to the host; once it is all there (or the host
        is full) it leaves the device."""
        copied = self._host_tokens(pause) + num_tokens
        if copied >= pause.request.num_computed_tokens:
            self._leave_device(pause, reclaimed=False, swap=True)
        elif not self._swap_out(pause, copied):
            self._leave_device(pause, reclaimed=False)
        else:  # the rest goes on in the next steps
            self._swapping[pause.request_id] = pause
            self.paused_kv.moved(pause.request_id, *self._kv_tokens(pause))

    def _paused_info(self, pause: _Pause, now: float) -> PausedInfo:
        """A paused session holding device KV, as the policy sees it. Partly copied to the host (a swap
        over several steps): its device blocks stay until the copy completes, and the tokens still to
        copy are what the policy decides about."""
        request = pause.request
        expected = self.estimator.estimate(now, pause.paused_at, pause.tool, pause.hint_s)
        remaining = (self.estimator.remaining(now, pause.paused_at, pause.tool, pause.hint_s)
                     if self.intercept_policy.expected_waste else None)
        computed, host = request.num_computed_tokens, self._host_tokens(pause)
        return PausedInfo(request.request_id, request.arrival_time, max(request.num_tokens, computed),
                          "partial" if host else "device", computed - host, now - pause.paused_at, expected,
                          remaining, pause.request_id in self._prefetched)

    def _iteration_info(self) -> IterationInfo:
        running = sum(r.num_computed_tokens for r in self.running)
        budget, free_host = 0, 0
        if self.host_tier is not None and self.profile is not None:
            budget = iteration_swap_limit(self.profile, self._last_batched_tokens)
            free_host = self.host_tier.free_host_tokens
        return IterationInfo(num_running_tokens=running, num_batched_tokens=self._last_batched_tokens,
                             swap_out_budget=budget, free_host_tokens=free_host,
                             spare_device_tokens=self._spare_device_tokens(),
                             step_lead_s=self._step_lead_s() if self.intercept_policy.prefetch else None)

    def _spare_device_tokens(self) -> int | None:
        """vLLM's free blocks, in tokens, less what queued work will need there: the waiting requests'
        uncomputed tokens (no prefix hit assumed; a session resumed off the device counts its whole
        context), the host KV of paused sessions, and one step's token budget; as the native scheduler
        counts it. Only for a policy that reads it (`Policy.ample_preserve`): it walks vLLM's waiting
        queues."""
        if not self.intercept_policy.ample_preserve:
            return None
        need = self._waiting_tokens() + self.paused_kv.host_tokens + self.max_num_scheduled_tokens
        return self.kv_cache_manager.block_pool.get_num_free_blocks() * self.block_size - need

    def _waiting_tokens(self) -> int:
        """The tokens vLLM's waiting requests have still to compute (a walk over its waiting queues)."""
        return sum(r.num_tokens - r.num_computed_tokens for queue in (self.waiting, self.kv_holding_waiting)
                   for r in queue)

    def _host_tokens(self, pause: _Pause) -> int:
        return 0 if self.host_tier is None else self.host_tier.host_tokens(pause.request.request_id)

    def _kv_tokens(self, pause: _Pause) -> tuple[int, int]:
        """(device, host) KV tokens of a paused session as the index counts them. While its swap runs over
        several steps its blocks all stay on the device, but the part copied counts on the host, as the
        policy sees it (`_paused_info`)."""
        host = self._host_tokens(pause)
        return (max(pause.request.num_computed_tokens - host, 0) if pause.frontier is None else 0), host

    def _forget_pause(self, rid: str) -> _Pause | None:
        """The session resumed or ended: it leaves the paused sessions and the index."""
        self.paused_kv.remove(rid)
        self._swapping.pop(rid, None)
        self._prefetched.discard(rid)
        pause = self.pauses.pop(rid, None)
        if pause is not None:
            self._moved.add(rid)
        return pause

    def _swap_out(self, pause: _Pause, num_tokens: int) -> bool:
        """Have the connector copy the session's KV up to `num_tokens` to the host this step."""
        request = pause.request
        blocks = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return self.host_tier is not None and self.host_tier.swap_out(request.request_id, blocks, num_tokens)

    def _leave_device(self, pause: _Pause, reclaimed: bool, swap: bool = False) -> None:
        """Free a paused session's blocks: swapped (copied to the host first, this step, when `swap` and
        the host has room) or discarded (still in the prefix cache until evicted)."""
        request = pause.request
        frontier = request.num_computed_tokens
        swapped = swap and self._swap_out(pause, frontier)
        if not swapped and self.host_tier is not None:
            self.host_tier.drop(request.request_id)  # a part copied earlier is no use alone
        pause.frontier = frontier
        self._free_request_blocks(request)
        request.num_computed_tokens = 0
        self._swapping.pop(pause.request_id, None)
        self._prefetched.discard(pause.request_id)
        self.paused_kv.moved(pause.request_id, *self._kv_tokens(pause))
        self._moved.add(pause.request_id)
        if swapped:
            self.counters["num_swaps"] += 1
        else:
            self.counters["discarded_tokens"] += frontier
            self.counters["num_discards"] += 1
        if reclaimed:
            self.counters["num_reclaims"] += 1
            self.counters["reclaimed_tokens"] += frontier

    def _allocate_or_reclaim(self, request: Request, *args, **kwargs):
        """vLLM's `allocate_slots`, but a failure first takes paused KV off the device, newest paused
        first (swapped or discarded, as `Policy.reclaim` says), before vLLM falls back to preempting a
        running request."""
        while True:
            blocks = self._stock_allocate(request, *args, **kwargs)
            if blocks is not None:
                return blocks
            victim = self._newest_paused_holder(besides=request)
            if victim is None:
                return None
            swap = False
            if self.host_tier is not None and self.profile is not None:
                info = self._paused_info(victim, time.monotonic())
                swap = self.intercept_policy.reclaim(info, self._iteration_info(), self.profile) is KVAction.SWAP_OUT
            self._leave_device(victim, reclaimed=True, swap=swap)

    def _newest_paused_holder(self, besides: Request) -> _Pause | None:
        holders = [p for p in self.pauses.values() if p.frontier is None and p.request is not besides
                   and p.request.num_computed_tokens > 0 and self._request_blocks_can_be_freed(p.request)]
        return max(holders, key=lambda p: p.request.arrival_time, default=None)

    # -- the channel to the worker --------------------------------------------------------------------
    def _read_channel(self) -> None:
        if self.channel is None:
            return
        try:
            while self.channel.poll():
                self._on_message(self.channel.recv())
        except (EOFError, OSError):
            logger.warning("the policy channel closed; the scheduler goes on without hints")
            self.channel = None

    def _on_message(self, msg: dict) -> None:
        if msg["op"] == "profile":
            self.profile = Profile.from_dict(msg["profile"])
            logger.info("policy %s, profile: %s", self.intercept_policy.label, msg["profile"]["t_fwd_samples"])
        elif msg["op"] == "pause":
            pause = self.pauses.get(msg["id"])
            if pause is not None:
                pause.tool, pause.hint_s = msg.get("tool"), msg.get("expected_s")
                self.paused_kv.replan(msg["id"])  # its estimate reads them: a preserve settled without them ends
        elif msg["op"] == "result":
            pause = self.pauses.get(msg["id"])
            if pause is not None:
                pause.result_at = msg["at"]

    def state(self) -> dict:
        """Where each paused session's KV is ([device, host, discarded] tokens), the tokens found computed
        (prefix cache and host) by each turn resumed after its KV left the device, and the counters."""
        return {"paused": {rid: self._location(p) for rid, p in self.pauses.items()},
                "resumed": dict(self.resumed_hits), "counters": self._all_counters()}

    def _location(self, pause: _Pause) -> list[int]:
        if pause.frontier is None:
            return [pause.request.num_computed_tokens, 0, 0]  # (a partial copy: still all on the device)
        host = self._host_tokens(pause)
        return [0, host, pause.frontier - host]

    def _all_counters(self) -> dict:
        return dict(self.counters) | (self.host_tier.counters if self.host_tier is not None else {})

    def _report(self) -> None:
        """Sent to the worker after a step that changed something: `state()`, but `paused` holds only the
        sessions whose KV moved since the last report (None: no longer paused), so a step costs what
        changed, not what is paused (thousands of sessions on slow tools change nothing for minutes)."""
        if self.channel is None:
            self._moved.clear()
            return
        paused = {rid: self._location(self.pauses[rid]) if rid in self.pauses else None for rid in self._moved}
        self._moved.clear()
        rest = (dict(self.resumed_hits), self._all_counters())
        if not paused and rest == self._reported:
            return
        self._reported = rest
        self._send({"op": "state", "paused": paused, "resumed": rest[0], "counters": rest[1]})

    def _send(self, msg: dict) -> None:
        if self.channel is None:
            return
        try:
            self.channel.send(msg)
        except OSError:
            self.channel = None


class InterceptScheduler(_InterceptMixin, Scheduler):
    """vLLM's scheduler with InferCept's policy (synchronous scheduling: CPU, and GPU without it)."""


class AsyncInterceptScheduler(_InterceptMixin, AsyncScheduler):
    """The same, for vLLM's asynchronous scheduling (GPU)."""


def intercept_scheduler(*args, vllm_config, **kwargs) -> InterceptScheduler | AsyncInterceptScheduler:
    """What the backend names as vLLM's `scheduler_cls`: vLLM's engine core calls it as it would call a
    scheduler class, once its configuration is final, and it builds the scheduler that matches vLLM's
    own choice of scheduling (`SchedulerConfig.async_scheduling`: on by default on a GPU, where vLLM
    supports it; off on a CPU): `AsyncInterceptScheduler` or `InterceptScheduler`."""
    cls = AsyncInterceptScheduler if vllm_config.scheduler_config.async_scheduling else InterceptScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
