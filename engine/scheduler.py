"""Iteration-level scheduler: which tokens of which requests run in the next forward pass.

Counting tokens, not phases: each request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (those with KV in the cache). Every step gives each scheduled request a chunk of
its uncomputed tokens, so prefill, chunked prefill, decode and recompute after preemption are one path.

Order of service (FCFS by arrival):
  1. running requests, oldest first; when blocks run out, the newest running request is preempted
     (its blocks are freed and it is recomputed later);
  2. waiting requests, oldest first, while the token budget, the sequence cap and the pool allow.
"""
from __future__ import annotations

import bisect

from .block_manager import BlockManager
from .config import SchedulerConfig
from .outputs import RunnerOutput, ScheduledChunk, SchedulerOutput
from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Request] = []  # sorted by arrival_time
        self.running: list[Request] = []  # sorted by arrival_time
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # dropped since the last step, for the runner

    # -- admission and removal ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        keys = [r.arrival_time for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.arrival_time), request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- schedule ---------------------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._enqueue_waiting(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + n
            while not self.blocks.can_allocate(request.request_id, total):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self.blocks.allocate(request.request_id, total)
            scheduled.append((request, n))
            budget -= n

        # No admissions in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + n
            if not self.blocks.can_allocate(request.request_id, total):
                break
            self.waiting.pop(0)
            self.blocks.allocate(request.request_id, total)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_time)
            scheduled.append((request, n))
            budget -= n

        chunks = [
            ScheduledChunk(
                request_id=r.request_id,
                token_ids=r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n],
                start_pos=r.num_computed_tokens,
                block_table=list(self.blocks.block_table(r.request_id)),
                sample=r.num_computed_tokens + n == r.num_tokens,
                sampling_params=r.sampling_params,
                num_output_tokens=r.num_output_tokens,
            )
            for r, n in scheduled
        ]
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(chunks=chunks, finished_request_ids=finished)

    # -- update -----------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance the scheduled requests; returns those that got a new token or finished."""
        changed = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(chunk.token_ids)
            sampled = runner_output.sampled.get(chunk.request_id)
            if sampled is None:
                continue
            request.token_ids.append(sampled.token_id)
            if request.sampling_params.logprobs is not None:
                request.output_logprobs.append(sampled)
            status = self._check_stop(request, sampled.token_id)
            if status is not None:
                self.finish(request, status)
            changed.append(request)
        return changed

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
