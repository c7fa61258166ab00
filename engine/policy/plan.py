"""The policy's inputs and output: the paused requests (`PausedInfo`) and the iteration (`IterationInfo`)
in, one `KVDecision` per paused request holding device memory out (`KVPlan`: preserve, swap out or
discard), and how long a preserve stands (`PreserveGuard`).

Works on plain dataclasses, not engine objects, so it runs without torch and without a model. Once per
iteration the scheduler describes the paused requests (`PausedInfo`) and the iteration (`IterationInfo`)
and asks its policy for a `KVPlan`; the mechanism executes it.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property

KV_STATES = ("device", "host", "discarded", "partial")


class KVAction(str, enum.Enum):
    PRESERVE = "preserve"  # keep the device KV where it is
    SWAP_OUT = "swap_out"  # copy `swap_out_tokens` device tokens to the host this iteration
    DISCARD = "discard"  # free the device KV; recompute on resume


# -- inputs and outputs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PausedInfo:
    """One paused (intercepted) request, as the policy sees it."""

    request_id: str
    arrival_time: float  # original arrival; orders ties and FCFS-ordered baselines
    num_tokens: int  # C: context tokens (all of them, wherever their KV is)
    kv_state: str  # one of KV_STATES
    num_device_tokens: int  # tokens whose KV is on the device now (what preserving holds)
    elapsed_s: float  # t_now - t_call
    expected_s: float  # expected REMAINING interception time: DurationEstimator.estimate(...)
    # The remaining time as equally likely samples (DurationEstimator.remaining: the tool's past durations
    # that outlasted `elapsed_s`, less `elapsed_s`); their mean is `expected_s`. None: one point,
    # `expected_s`. Only policies with `expected_waste` read it.
    remaining_s: tuple[float, ...] | None = None
    # Its KV was brought back toward the device before its resume (proactive swap-in, `Policy.prefetch`).
    prefetched: bool = False

    @cached_property
    def remaining_sorted(self) -> tuple[float, ...]:
        """`remaining_s` (or the one point `expected_s`) ascending, none below 0: what the expected-waste
        rule integrates over, three times a plan for each request."""
        points = self.remaining_s if self.remaining_s else (self.expected_s,)
        return tuple(sorted(max(r, 0.0) for r in points))

    def __post_init__(self) -> None:
        if self.kv_state not in KV_STATES:
            raise ValueError(f"kv_state must be one of {KV_STATES}, not {self.kv_state!r}")
        if not 0 <= self.num_device_tokens <= self.num_tokens:
            raise ValueError(f"{self.request_id}: need 0 <= num_device_tokens <= num_tokens, got "
                             f"{self.num_device_tokens} of {self.num_tokens}")


@dataclass(frozen=True)
class IterationInfo:
    """The iteration the plan is for."""

    num_running_tokens: int  # C_other: KV tokens held by the running (not paused) requests
    num_batched_tokens: int  # B_i: query tokens the running batch schedules (sets the recompute chunk)
    swap_out_budget: int  # tokens that may be swapped out in this iteration (`split_swap_budget`)
    free_host_tokens: int | None = None  # host pool room in tokens; None: unlimited
    # Device pool room in tokens left once every queued need is met (the waiting requests' uncomputed
    # tokens, the host KV of resumed and paused requests, one step's token budget); None: not known.
    spare_device_tokens: int | None = None
    # How long the next step may run (`Scheduler.step_lead_s`: measured steps, at least a full token
    # budget's forward): how far ahead proactive swap-in must act; None: not known (the forward time of
    # the last step's batch stands in).
    step_lead_s: float | None = None


@dataclass(frozen=True)
class KVDecision:
    request_id: str
    action: KVAction
    swap_out_tokens: int = 0  # > 0 only for SWAP_OUT; may be less than the device tokens (chunked swap)
    waste_preserve: float = 0.0  # byte·s, Eq. 2 with the expected remaining time
    waste_discard: float = 0.0  # byte·s, Eq. 4 if the policy recomputes in chunks, else Eq. 1


@dataclass(frozen=True)
class KVPlan:
    """One decision per paused request that holds device memory, in input order.

    Requests with nothing on the device (kv_state "host" or "discarded") get no decision: there is
    nothing to move, and KV never moves back toward the device before the request resumes.
    """

    decisions: tuple[KVDecision, ...] = ()

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def get(self, request_id: str) -> KVDecision | None:
        return next((d for d in self.decisions if d.request_id == request_id), None)

    def action(self, request_id: str) -> KVAction | None:
        decision = self.get(request_id)
        return decision.action if decision else None

    def ids(self, action: KVAction) -> list[str]:
        return [d.request_id for d in self.decisions if d.action is action]

    @property
    def swap_out_tokens(self) -> int:
        return sum(d.swap_out_tokens for d in self.decisions)


@dataclass(frozen=True)
class PreserveGuard:
    """How long a PRESERVE decision stands, whatever else the iterations hold (other requests, the
    running batch, the budget): the policy's plan would preserve the request again at every iteration
    while its expected remaining time stays below `expected_s`, and, in iterations with swap room,
    below `swap_expected_s` with the iteration's forward time below `swap_iteration_s`. The scheduler
    asks again only once one of them is crossed (or the tool's duration history changes), so requests
    waiting on slow tools cost no work per iteration (`Policy.preserve_guard`). `expected_s` may rest
    on the running requests' KV (the more memory waits for a recompute, the dearer a discard): then it
    holds only while that stays at least `min_running_tokens`."""

    expected_s: float = math.inf
    swap_expected_s: float = math.inf
    swap_iteration_s: float = math.inf
    min_running_tokens: int = 0
    # The bounds stand only while the device pool stays ample (`memory_ample`): the first iteration it
    # is not, the request is planned again (a policy that keeps everything while memory is ample).
    while_ample: bool = False

    @classmethod
    def until_swap_room(cls) -> "PreserveGuard":
        """For a half-swapped request (``kv_state == "partial"``), which no plan discards
        (`min_waste._drop`): without swap room every plan preserves it, so it is planned again only in
        the first iteration with room, where its swap goes on. (With the host pool full, a trace on the
        H100 profile planned some ten such requests an iteration for nothing.)"""
        return cls(swap_expected_s=0.0, swap_iteration_s=0.0)

    @property
    def reads_estimate(self) -> bool:
        """A bound rests on the expected remaining time: a change in the tool's duration history may
        cross it. Without one (keep everything while memory is ample, preserve always) no history does."""
        return self.expected_s < math.inf or self.swap_expected_s < math.inf

