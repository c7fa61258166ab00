"""What to do with each paused request's KV this iteration: preserve, swap out, or discard.

Works on plain dataclasses, not engine objects, so it runs without torch and without a model. Once per
iteration the scheduler describes the paused requests (`PausedInfo`) and the iteration (`IterationInfo`)
and asks its policy for a `KVPlan`; the mechanism executes it.

The min-waste rule (paper §4.3, `min_waste_plan`):

1. for every paused request holding device memory, ``Waste = min(WastePreserve, WasteChunkDiscard)``
   (Eq. 5, with Eqs. 2 and 4 from `waste`);
2. sort by that waste, descending, and swap out from the top until the swap-out budget is spent
   (swapping within the budget overlaps the forward pass, so it wastes nothing);
3. preserve or discard each remaining request, whichever of its two wastes is smaller.

Deviations from the paper, each for a stated reason:

- A request is swapped only if its KV would otherwise sit idle for at least the round trip
  ``T_swap_out(device tokens) + T_swap_in(C)``: its expected remaining pause, but at least this
  iteration's forward time, since a request paused now runs again in the next iteration at the
  earliest. Otherwise it would be back before its KV is, and the swap-in would delay it for nothing
  (this keeps a 1 ms calculator call from being copied to the host and back when iterations are
  shorter than the copies; where they are longer, as on a CPU, the copy hides behind the iteration the
  KV would idle through anyway, and preserving it would only hold memory).
- A request whose KV is partly on the host (``kv_state == "partial"``, a budgeted swap-out in progress)
  is never discarded: its device part is preserved until a later iteration's budget finishes the copy.
  Discarding the tail of a half-swapped context would make resumption a swap-in followed by a
  recompute, a path the mechanism need not support.
- Swap amounts are whole KV blocks unless they finish a request's device tokens, because the mechanism
  moves blocks.

Ties between preserve and discard go to preserve: equal waste, and preserve needs no recompute work.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import ClassVar, Sequence

from .profile import Profile
from .waste import num_chunks, waste_chunk_discard, waste_discard, waste_preserve, waste_swap

KV_STATES = ("device", "host", "discarded", "partial")
PREEMPTIONS = ("recompute", "swap")  # Policy.preemption
PRIORITIES = ("arrival", "program-arrival", "las")  # Policy.priority
# Policy.ample_preserve, the default's: keep everything where copies stall the forward pass (a CPU), no
# discard only where they overlap it (a GPU's copy stream).
BY_COPY_OVERLAP = "by-copy-overlap"
AMPLE_NO_DISCARD = "no-discard"  # Policy.ample_preserve: no discard while memory is ample; swaps stay


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

    @property
    def reads_estimate(self) -> bool:
        """A bound rests on the expected remaining time: a change in the tool's duration history may
        cross it. Without one (keep everything while memory is ample, preserve always) no history does."""
        return self.expected_s < math.inf or self.swap_expected_s < math.inf


# -- budgets and chunks ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SwapBudget:
    swap_in: int
    swap_out: int


def split_swap_budget(total: int, swap_in_demand: int, swap_out_demand: int,
                      free_device_tokens: int, free_host_tokens: int) -> SwapBudget:
    """Split one iteration's swap limit ``N_i`` between swap-in and swap-out (paper §4.1).

    The paper's criteria: (1) ``in + out <= N_i``; (2) swapped-out memory fits in free host memory;
    (3) swapped-in memory fits in free device memory. Swap-in is served first: a resumed request is
    ready to produce tokens and waits for nothing else, while a swap-out only frees memory for later
    (paper: the swap-in budget "should always be utilized by resumed requests as much as the budget
    allows"). Swap-out takes what is left. Under device pressure this balances by itself: with no free
    device memory swap-in gets nothing, swap-out gets the whole budget and frees memory for the next
    iteration.

    Conservative versus the paper: memory freed by this iteration's copies in one direction is not
    counted as room for this iteration's copies in the other (criteria 2-3 count it); that would need
    the mechanism to order the two copy streams inside one iteration. The cost is at most one iteration
    of delay.
    """
    total = max(total, 0)
    swap_in = max(min(swap_in_demand, total, free_device_tokens), 0)
    swap_out = max(min(swap_out_demand, total - swap_in, free_host_tokens), 0)
    return SwapBudget(swap_in=swap_in, swap_out=swap_out)


def iteration_swap_limit(profile: Profile, num_batched_tokens: int) -> int:
    """``N_i``: the tokens whose copy takes as long as an iteration of `num_batched_tokens` query tokens
    runs (paper §4.1), so swaps within it hide behind the forward pass."""
    return profile.swap_budget_tokens(profile.t_fwd(num_batched_tokens))


def recompute_chunk_size(profile: Profile, num_batched_tokens: int) -> int:
    """Tokens of a discarded context to recompute per iteration: ``S - B_i`` (paper §4.2).

    Floored at one block so recomputation always progresses, even when the running batch alone
    reaches the saturation point.
    """
    return max(profile.saturation_point - num_batched_tokens, profile.block_size)


def swap_amount(device_tokens: int, budget: int, block_size: int) -> int:
    """Tokens to swap out of one request: all of them if they fit, else as many whole blocks as fit."""
    if device_tokens <= budget:
        return max(device_tokens, 0)
    return max(budget, 0) // block_size * block_size


def swap_round_trip(info: PausedInfo, profile: Profile) -> float:
    """Seconds to copy the request's device KV to the host and its whole context back."""
    return profile.t_swap(info.num_device_tokens, "out") + profile.t_swap(info.num_tokens, "in")


def worth_swapping(info: PausedInfo, profile: Profile, iteration_s: float) -> bool:
    """True if the request's KV would sit idle on the device for at least its round trip to the host.

    It sits idle for its expected remaining pause, but never less than this iteration (`iteration_s`):
    a request paused now cannot run before the next iteration, even if its result arrives at once.
    """
    return max(info.expected_s, iteration_s) >= swap_round_trip(info, profile)


def swap_room(iteration: IterationInfo) -> int:
    """Swap-out tokens this iteration may use: the budget, capped by the host pool. With none, no plan
    swaps anything out."""
    if iteration.free_host_tokens is None:
        return max(iteration.swap_out_budget, 0)
    return max(min(iteration.swap_out_budget, iteration.free_host_tokens), 0)


# -- scoring --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Scored:
    info: PausedInfo
    waste_preserve: float
    waste_discard: float

    @property
    def min_waste(self) -> float:
        """Eq. 5: the waste of the better of preserve and (chunked) discard."""
        return min(self.waste_preserve, self.waste_discard)

    @property
    def cheaper_to_preserve(self) -> bool:
        return self.waste_preserve <= self.waste_discard

    def decide(self, action: KVAction, swap_out_tokens: int = 0) -> KVDecision:
        return KVDecision(self.info.request_id, action, swap_out_tokens, self.waste_preserve,
                          self.waste_discard)


def score(info: PausedInfo, iteration: IterationInfo, profile: Profile, chunked: bool = True) -> _Scored:
    """WastePreserve (Eq. 2) and WasteChunkDiscard (Eq. 4, or Eq. 1 unchunked) of one paused request.

    ``C`` is the request's device tokens: those are what preserving holds and what discarding frees and
    later recomputes. ``T_int`` is its expected remaining paused time.
    """
    C, M = info.num_device_tokens, profile.bytes_per_token
    preserve = waste_preserve(info.expected_s, C, M)
    if chunked:
        chunk = recompute_chunk_size(profile, iteration.num_batched_tokens)
        discard = waste_chunk_discard(C, iteration.num_running_tokens, M, profile.t_fwd, chunk,
                                      profile.t_recompute_attention(C, num_chunks(C, chunk)))
    else:
        discard = waste_discard(C, iteration.num_running_tokens, M, profile.t_fwd)
    return _Scored(info, preserve, discard)


def _holding_device(paused: Sequence[PausedInfo]) -> list[PausedInfo]:
    return [p for p in paused if p.num_device_tokens > 0]


def _in_input_order(paused: Sequence[PausedInfo], decisions: dict[str, KVDecision]) -> KVPlan:
    return KVPlan(tuple(decisions[p.request_id] for p in paused if p.request_id in decisions))


def _drop(scored: _Scored) -> KVDecision:
    """Discard, except a half-swapped request, whose device part stays until its swap completes."""
    if scored.info.kv_state == "partial":
        return scored.decide(KVAction.PRESERVE)
    return scored.decide(KVAction.DISCARD)


def _swap_in_order(ordered: Sequence[_Scored], budget: int, profile: Profile,
                   eligible=lambda s: True) -> tuple[dict[str, KVDecision], list[_Scored]]:
    """Swap out requests in the given order while the budget lasts; returns (decisions, the rest).

    A request that does not fit whole gets as many whole blocks as remain; later, smaller requests
    may still fit in what is left.
    """
    decisions: dict[str, KVDecision] = {}
    rest: list[_Scored] = []
    for s in ordered:
        amount = swap_amount(s.info.num_device_tokens, budget, profile.block_size) if eligible(s) else 0
        if amount > 0:
            decisions[s.info.request_id] = s.decide(KVAction.SWAP_OUT, amount)
            budget -= amount
        else:
            rest.append(s)
    return decisions, rest


def min_waste_plan(paused: Sequence[PausedInfo], iteration: IterationInfo, profile: Profile,
                   deferred_swap: bool = False) -> KVPlan:
    """The paper's per-iteration min-waste decision (§4.3); see the module docstring. `deferred_swap`:
    `defer_swap` before a discard (`Policy.deferred_swap`)."""
    scored = [score(p, iteration, profile, chunked=True) for p in _holding_device(paused)]
    # Most wasteful first; ties by original arrival (older first) so the order is deterministic.
    ordered = sorted(scored, key=lambda s: (-s.min_waste, s.info.arrival_time, s.info.request_id))
    iteration_s = profile.t_fwd(iteration.num_batched_tokens)

    def eligible(s: _Scored) -> bool:
        return worth_swapping(s.info, profile, iteration_s)

    decisions, rest = _swap_in_order(ordered, swap_room(iteration), profile, eligible=eligible)
    decisions.update(_preserve_or_drop(rest, decisions, iteration, profile, eligible if deferred_swap else None))
    return _in_input_order(paused, decisions)


def _preserve_or_drop(rest: Sequence[_Scored], swapped: dict[str, KVDecision], iteration: IterationInfo,
                      profile: Profile, swappable=None) -> dict[str, KVDecision]:
    """Step 3 of the rule for what the budget did not swap: preserve or discard, whichever wastes less;
    with `swappable` (`Policy.deferred_swap`), a discard is first weighed against `defer_swap`."""
    decisions: dict[str, KVDecision] = {}
    backlog = 0  # device tokens deferred ahead of the next one, most wasteful first
    host_room = math.inf if iteration.free_host_tokens is None else iteration.free_host_tokens - sum(
        d.swap_out_tokens for d in swapped.values())
    iteration_s = profile.t_fwd(iteration.num_batched_tokens)
    per_iteration = iteration_swap_limit(profile, iteration.num_batched_tokens)  # what a full budget copies
    for s in rest:
        if s.cheaper_to_preserve:
            decisions[s.info.request_id] = s.decide(KVAction.PRESERVE)
        elif (swappable is not None and s.info.kv_state == "device" and swappable(s)
              and backlog + s.info.num_device_tokens <= host_room
              and defer_swap(s, backlog, per_iteration, iteration_s, profile.bytes_per_token)):
            decisions[s.info.request_id] = s.decide(KVAction.PRESERVE)
            backlog += s.info.num_device_tokens
        else:
            decisions[s.info.request_id] = _drop(s)
    return decisions


def defer_swap(scored: _Scored, backlog: int, per_iteration: int, iteration_s: float, bytes_per_token: int) -> bool:
    """Keep a context the rule would discard for the iterations its swap-out needs, when this
    iteration's budget is spent (`Policy.deferred_swap`, beyond the paper): the paper weighs a discard
    against preserving for the whole pause, never against a swap a few iterations later, so under a
    busy copy engine (swap-ins go first: a long-context workload's resumes took the whole budget in most
    iterations, simulated) it discards contexts it would have swapped had the budget come one step
    sooner, and recomputes them. The wait is the iterations a full budget ``N_i`` (`per_iteration`
    tokens) needs for `backlog` (the device tokens deferred ahead of this one) and this context, at this
    iteration's forward time `iteration_s`.
    Deferred while the pause outlasts the wait and the memory held since the pause plus during the
    wait wastes less than the discard (Eq. 4): counting the time already held ends the deferral of a
    context the budget keeps passing over; the reclaim path takes it at once if a running request needs
    the room."""
    info = scored.info
    if per_iteration <= 0:
        return False
    wait = math.ceil((backlog + info.num_device_tokens) / per_iteration) * iteration_s
    held = (info.elapsed_s + wait) * info.num_device_tokens * bytes_per_token
    return wait < info.expected_s and held < scored.waste_discard


def cheaper_to_swap_than_discard(info: PausedInfo, iteration: IterationInfo, profile: Profile) -> bool:
    """Memory pressure forces a paused request's device KV off the device at once: is a synchronous
    copy to the host (Eq. 3, the batch waits for the copy out and later in) less waste than chunked
    recomputation (Eq. 4)? On a CPU, where the host pool is the same DRAM, the copy nearly always
    wins; over PCIe a large model's long context with a small running batch may not."""
    C = info.num_device_tokens
    swap = waste_swap(C, iteration.num_running_tokens + C, profile.bytes_per_token, profile.t_swap)
    return swap < score(info, iteration, profile, chunked=True).waste_discard


# -- durations as distributions ----------------------------------------------------------------------
#
# The paper scores preserve with the expected remaining time, Eq. 2 at T_int = E[R]. Waste is linear in
# R, so that is already the expectation of Eq. 2 over R; what a distribution adds is the option to stop
# waiting. The policy re-plans whenever the estimate could change (at the latest when the elapsed time
# passes one of the tool's past durations), so "preserve now" really means "preserve for a while, then
# decide again". Among the TTLs "preserve until the k-th shortest past call would have returned, then
# discard" (Continuum's pin-with-TTL), the expected waste is
#
#     W(τ) = C·M·E[min(R, τ)] + P(R > τ)·W_discard
#
# with τ = 0 the discard now and τ = max(R) Eq. 2 at E[R]. Preserve now iff some τ > 0 beats τ = 0. A
# tool that returns in 0.1 s nine times in ten and in 60 s otherwise has a mean residual of 6 s (the
# paper discards a context whose Eq. 4 is below 6 s of its memory); its best TTL is 0.1 s, after which
# the conditional distribution is the 60 s mode alone and the context goes.
#
# Re-queueing delay (Continuum): a discarded context resumes only after its recompute, (n - 1) more
# iterations than a preserved one, and a swapped one after the part of its swap-in that no iteration
# hides. The program waits that long; it is charged like memory held idle for that time
# (delay x C x M), so the units stay byte·s.


def resume_delay_discard(C: int, iteration: IterationInfo, profile: Profile) -> float:
    """Seconds a discarded context's resume waits for its recompute beyond a preserved one: the chunks
    before the last (`recompute_chunk_size`), each an iteration at the saturation point."""
    n = num_chunks(C, recompute_chunk_size(profile, iteration.num_batched_tokens))
    if n <= 1:
        return 0.0
    # With attention modeled (`Policy.context_cost`): that of every chunk but the last (over all of C).
    attention = profile.t_recompute_attention(C, n) - profile.t_attention(C / n, C) if profile.has_attention else 0.0
    return (n - 1) * profile.t_fwd(profile.saturation_point) + attention


def resume_delay_swap(C: int, profile: Profile, iteration_s: float) -> float:
    """Seconds a swapped-out context's resume waits for its swap-in beyond the iteration it overlaps."""
    return max(profile.t_swap(C, "in") - iteration_s, 0.0)


def _remaining(info: PausedInfo) -> list[float]:
    return sorted(max(r, 0.0) for r in info.remaining_s) if info.remaining_s else [max(info.expected_s, 0.0)]


def best_ttl_waste(remaining: Sequence[float], C: int, M: int, discard_waste: float) -> float:
    """min over τ in `remaining` (sorted ascending, τ > 0 candidates) of
    ``C·M·E[min(R, τ)] + P(R > τ)·discard_waste``, R uniform over `remaining`; the last candidate is
    Eq. 2 at E[R]. One pass: E[min(R, τ_k)] = (sum of the first k + (N - k)·τ_k) / N."""
    N = len(remaining)
    best, prefix = math.inf, 0.0
    for k, tau in enumerate(remaining, start=1):
        prefix += tau
        if k < N and remaining[k] == tau:
            continue  # ties: the survival share counts every sample at this value
        held = (prefix + (N - k) * tau) / N
        best = min(best, held * C * M + (N - k) / N * discard_waste)
    return best


def score_expected(info: PausedInfo, iteration: IterationInfo, profile: Profile) -> _Scored:
    """Expected waste of preserving (best TTL, see above) and of discarding (Eq. 4 + re-queue delay)."""
    C, M = info.num_device_tokens, profile.bytes_per_token
    chunk = recompute_chunk_size(profile, iteration.num_batched_tokens)
    discard = (waste_chunk_discard(C, iteration.num_running_tokens, M, profile.t_fwd, chunk,
                                   profile.t_recompute_attention(C, num_chunks(C, chunk)))
               + resume_delay_discard(C, iteration, profile) * C * M)
    return _Scored(info, best_ttl_waste(_remaining(info), C, M, discard), discard)


def expected_swap_waste(info: PausedInfo, profile: Profile, iteration_s: float) -> float:
    """A budgeted swap costs no waste while it overlaps iterations (paper §4.1), except when the call
    returns before the KV could be back (the resume waits out the rest of the round trip) and the
    swap-in that no iteration hides: ``C·M·(E[max(0, T_rt - max(R, T_iter))] + delay_in)``."""
    C = info.num_device_tokens
    round_trip = swap_round_trip(info, profile)
    remaining = _remaining(info)
    early = sum(max(round_trip - max(r, iteration_s), 0.0) for r in remaining) / len(remaining)
    return (early + resume_delay_swap(info.num_tokens, profile, iteration_s)) * C * profile.bytes_per_token


def expected_waste_plan(paused: Sequence[PausedInfo], iteration: IterationInfo, profile: Profile,
                        deferred_swap: bool = False) -> KVPlan:
    """`min_waste_plan` with expected wastes over the remaining-time distribution: scored by
    `score_expected`; swapped out, most wasteful first within the budget, only where the paper's
    round-trip check passes (`worth_swapping`) and the swap's expected waste is at most both others
    (a tie goes to the swap, as in the paper: within the budget it costs nothing). `deferred_swap` as
    in `min_waste_plan`."""
    scored = [score_expected(p, iteration, profile) for p in _holding_device(paused)]
    ordered = sorted(scored, key=lambda s: (-s.min_waste, s.info.arrival_time, s.info.request_id))
    iteration_s = profile.t_fwd(iteration.num_batched_tokens)

    def eligible(s: _Scored) -> bool:
        return (worth_swapping(s.info, profile, iteration_s)
                and expected_swap_waste(s.info, profile, iteration_s) <= s.min_waste)

    decisions, rest = _swap_in_order(ordered, swap_room(iteration), profile, eligible=eligible)
    decisions.update(_preserve_or_drop(rest, decisions, iteration, profile, eligible if deferred_swap else None))
    return _in_input_order(paused, decisions)


def expected_waste_guard(info: PausedInfo, iteration: IterationInfo, profile: Profile) -> PreserveGuard | None:
    """`PreserveGuard` for `expected_waste_plan`. Discard's expected waste is at least
    ``D_low = (T_fwd(C)/2 + b·floor)·C·M`` (no re-queue delay, the cheapest chunking, half this
    iteration's running KV as the floor, as `InferCeptPolicy.preserve_guard`). One remaining-time
    point r: preserve beats discard while ``C·M·r < D_low``, a bound on the expected time. Several
    samples: between two jumps of the estimate (`DurationEstimator.next_jump`, where the scheduler wakes
    anyway) the surviving samples stay the same and all shrink with the clock, so every TTL's waste
    falls (τ shrinks with them) and a preserve that beats ``D_low`` now still does until the jump.
    Swaps need `worth_swapping`, so none while the expected time and the iteration stay below the round
    trip (the expected time only falls between jumps)."""
    if info.kv_state == "partial":
        return None
    C, M = info.num_device_tokens, profile.bytes_per_token
    per_other_token = min(n * profile.t_fwd(C / n) for n in range(1, num_chunks(C, profile.block_size) + 1)) / C
    floor = iteration.num_running_tokens // 2
    low = (profile.t_fwd(C) / 2 + per_other_token * floor) * C * M * (1 - 1e-9)
    round_trip = swap_round_trip(info, profile)
    remaining = _remaining(info)
    if len(remaining) == 1:
        bound = low / (C * M)
    elif best_ttl_waste(remaining, C, M, low) < low:
        # best_ttl_waste with D_low in place of the discard waste: the TTL beats any discard >= D_low.
        bound = info.expected_s + 1e9  # until the next jump, or the history changes (both wake it)
    else:
        return None
    return PreserveGuard(expected_s=bound, swap_expected_s=round_trip, swap_iteration_s=round_trip,
                         min_running_tokens=floor)


def memory_ample(iteration: IterationInfo) -> bool:
    """The device pool has room for every queued need with the paused KV kept where it is: then no
    other request could use the memory a swap or discard would free, so holding it wastes nothing
    (the waste equations price held memory as if someone were waiting for it), while the round trip
    costs real time where copies do not overlap the forward pass (on a CPU, `copy_stream.py`) and
    delays the resume wherever its swap-in is not hidden."""
    return iteration.spare_device_tokens is not None and iteration.spare_device_tokens >= 0


def without_discards(plan: KVPlan) -> KVPlan:
    """The plan with every DISCARD turned into PRESERVE (`AMPLE_NO_DISCARD`, while `memory_ample`): the
    memory a discard frees is wanted by nobody, and its recompute is never free, while a swap within
    the budget overlaps the forward pass (on a GPU) and leaves the room ready for the next burst."""
    return KVPlan(tuple(replace(d, action=KVAction.PRESERVE) if d.action is KVAction.DISCARD else d
                        for d in plan))


def resume_imminent(expected_s: float, profile: Profile, step_s: float, host_tokens: int,
                    copy_steps: int = 1) -> bool:
    """Proactive swap-in: the expected remaining pause is below the time to copy
    `host_tokens` back plus one step, so a swap-in started now is done when the result arrives. The
    step is a full one (`step_s`, `Scheduler.step_lead_s`: the longest the scheduler may run before it
    can act again, from measured steps and at least a full token budget's forward time), not the
    last batch's: a resume due within the next step is missed if the swap-in waits for the step after
    it (on a CPU, with 50-800 ms steps, the last batch's lead brought 63 of 96 resumes back in time, a
    full step's 88). The mean, not the soonest, remaining time: acting on the soonest past call that
    outlasted this one holds the KV of every heavy-tailed pause on the device (the six-augment mix
    recomputed 23% of its forward time that way in simulation, against 0.6%). `copy_steps`: steps the
    per-step swap budget needs for this copy and those queued ahead of it (`Scheduler._prefetch_candidates`)."""
    return expected_s < profile.t_swap(host_tokens, "in") + copy_steps * step_s


# -- policies -------------------------------------------------------------------------------------

class Policy:
    """A named way to hold paused requests' KV. Subclasses implement `plan`.

    Class attributes the scheduler reads:

    - ``keeps_arrival_time``: a resumed request keeps its original arrival time in the FCFS queues;
      False means it is requeued at the tail (arrival = resume time), like a brand-new request.
    - ``chunked_recompute``: recompute a discarded context ``S - B_i`` tokens per iteration
      (`recompute_chunk_size`); False recomputes it all in one iteration.
    - ``swap_synchronous``: swaps are whole-context and block the iteration (the paper's Swap baseline);
      False means swaps are budgeted per iteration and overlap the forward pass.
    - ``lazy_discard``: a discarded context's blocks stay content-addressed and reusable until evicted
      (the prefix cache of today's servers); False frees them for good (the paper's baselines, vLLM 0.2).
    - ``preemption``: how KV forced off the device under memory pressure leaves it (`reclaim`):
      "recompute" (freed, recomputed later: the paper's baselines, vLLM) or "swap" (copied to the host
      when that wastes less than recomputing). Overridable per instance, for the ablation that
      separates this from the pause-time plan (`make_policy("swap+swap-preemption")`).
    - ``priority``: the order of the scheduler's queues (waiting, swapped, running; also who gives way
      under memory pressure), one of `PRIORITIES`. "arrival": the request's arrival
      time (the paper's three FCFS queues; with ``keeps_arrival_time`` a resumed turn keeps its
      program's, without it the resume time). "program-arrival": the program's first arrival, whatever
      ``keeps_arrival_time`` says. "las": least attained service, the tokens the program has had
      computed before this turn was queued (Autellix), ties by program arrival. In this engine a resumed
      generation is the same request, so a request is a program.
    - ``expected_waste``: decide by expected waste over the remaining-time distribution, with re-queue
      delays (`expected_waste_plan`), instead of Eq. 2 at the mean. Only the
      min-waste policies read it.
    - ``ample_preserve``: preserve every paused request while the device pool has room for all queued
      work (`memory_ample`); the waste rule decides only under memory pressure (the goal: with ample
      memory `infercept` is never worse than `prefix-cache`). ``"no-discard"`` (`AMPLE_NO_DISCARD`,
      ``+ample-no-discard``): while memory is ample only what the waste rule would discard is preserved,
      and its swaps within the budget stay (`without_discards`): a recompute is never free, a budgeted
      swap on a GPU is, and it frees the room before pressure comes instead of leaving kept KV for the
      reclaim path to take back. ``"by-copy-overlap"`` (`BY_COPY_OVERLAP`, the default's): everything
      kept where a copy stalls the forward pass (`Profile.copies_overlap` false: a CPU, where a swap
      stalls its step), no discard only where it overlaps (a GPU). Measured on the H100 model
      (benchmarks/README.md, "Beyond the paper"): keeping everything cost the six-augment mix 3-12%, no
      discard costs it nothing; both halve `approval@10`'s latency. Only the min-waste policies read it.
    - ``prefetch``: proactive swap-in: a paused request whose KV is on the host starts
      coming back within the swap-in budget once its resume looks imminent (`resume_imminent`, on an
      estimate from a hint or the tool's history: `DurationEstimator.predicted`), and the
      plan keeps what came back on the device while it still does. Only the min-waste policies read it.
    - ``context_cost``: the wastes count the attention a recompute spends over the context it rebuilds
      (`Profile.t_attention`, when the profile models it): chunk i of n attends to i/n of the context,
      so recomputing C tokens costs ~C^2 more than ``n * T_fwd(C/n)`` says. Without it the policy sees
      the profile without attention, as the paper's equations do. Only matters for long contexts.
    - ``deferred_swap``: a paused context the waste rule would discard because this iteration's swap
      budget is spent is kept for the iterations its swap needs, when that wastes less (`defer_swap`;
      beyond the paper, which weighs a discard only against preserving for the whole pause). Only the
      min-waste policies read it.
    - ``admission``: admission under overload: while the device pool thrashes, new
      programs start only within an AIMD cap on the active ones (`admission.AdmissionController`, one
      per scheduler); turns of active programs are never held back. Any policy may add it.
    """

    name: ClassVar[str] = ""
    keeps_arrival_time: ClassVar[bool] = True
    chunked_recompute: ClassVar[bool] = False
    swap_synchronous: ClassVar[bool] = False
    lazy_discard: bool = False
    preemption: str = "recompute"
    priority: str = "arrival"
    expected_waste: bool = False
    prefetch: bool = False
    context_cost: bool = False
    deferred_swap: bool = False
    admission: bool = False
    ample_preserve: bool | str = False  # or AMPLE_NO_DISCARD, BY_COPY_OVERLAP

    def __init__(self, *, lazy_discard: bool | None = None, preemption: str | None = None,
                 priority: str | None = None, expected_waste: bool | None = None, prefetch: bool | None = None,
                 context_cost: bool | None = None, deferred_swap: bool | None = None,
                 admission: bool | None = None, ample_preserve: bool | str | None = None):
        if lazy_discard is not None:
            self.lazy_discard = lazy_discard  # per-instance override, e.g. for ablations
        if preemption is not None:
            if preemption not in PREEMPTIONS:
                raise ValueError(f"preemption must be one of {', '.join(PREEMPTIONS)}, not {preemption!r}")
            self.preemption = preemption
        if priority is not None:
            if priority not in PRIORITIES:
                raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
            self.priority = priority
        if expected_waste is not None:
            self.expected_waste = expected_waste
        if prefetch is not None:
            self.prefetch = prefetch
        if context_cost is not None:
            self.context_cost = context_cost
        if deferred_swap is not None:
            self.deferred_swap = deferred_swap
        if admission is not None:
            self.admission = admission
        if ample_preserve is not None:
            if ample_preserve not in (True, False, BY_COPY_OVERLAP, AMPLE_NO_DISCARD):
                raise ValueError(f"ample_preserve must be True, False, {BY_COPY_OVERLAP!r} or "
                                 f"{AMPLE_NO_DISCARD!r}, not {ample_preserve!r}")
            self.ample_preserve = ample_preserve

    def seen(self, profile: Profile) -> Profile:
        """The profile the wastes are computed with: with attention only under `context_cost`."""
        return profile if self.context_cost else profile.without_attention

    def plan(self, paused: Sequence[PausedInfo], iteration: IterationInfo, profile: Profile) -> KVPlan:
        raise NotImplementedError

    def preserve_guard(self, info: PausedInfo, iteration: IterationInfo, profile: Profile) -> PreserveGuard | None:
        """For a request this policy's plan just preserved in `iteration`: bounds within which every later plan
        preserves it too (`PreserveGuard`), or None if it must be planned again every iteration. The
        bounds must be sound, not tight: a guard that ends early only costs a plan; one that ends late
        would change decisions (tests replay traces with and without guards and compare every one)."""
        return None

    def reclaim(self, info: PausedInfo, iteration: IterationInfo, profile: Profile) -> KVAction:
        """A running request needs device blocks and this request's KV must leave the device now: the
        newest paused holder, or, when no paused KV is left, the newest running request (preemption;
        its `info` then has no expected time away). DISCARD (recompute later) or SWAP_OUT (whole device
        part, if the host pool has room), by `preemption`: with "swap", min-waste under pressure (an
        extension of the paper, whose fallback under pressure is vLLM's discard and preemption by
        recompute): swapped when a synchronous copy wastes less than chunked recomputation."""
        if self.preemption == "swap" and cheaper_to_swap_than_discard(info, iteration, self.seen(profile)):
            return KVAction.SWAP_OUT
        return KVAction.DISCARD

    @property
    def label(self) -> str:
        """The name `make_policy` takes to build this policy again: the registered name and the parts
        that differ from its defaults."""
        cls, parts = type(self), []
        if self.preemption != cls.preemption:
            parts.append(f"{self.preemption}-preemption")
        if self.priority != cls.priority:
            parts.append(f"{self.priority}-priority")
        if self.expected_waste != cls.expected_waste:
            parts.append("expected-waste" if self.expected_waste else "mean-waste")
        if self.prefetch != cls.prefetch:
            parts.append("prefetch" if self.prefetch else "no-prefetch")
        if self.context_cost != cls.context_cost:
            parts.append("context-cost" if self.context_cost else "no-context-cost")
        if self.deferred_swap != cls.deferred_swap:
            parts.append("deferred-swap" if self.deferred_swap else "no-deferred-swap")
        if self.admission != cls.admission:
            parts.append("admission" if self.admission else "no-admission")
        if self.ample_preserve != cls.ample_preserve:
            parts.append("ample-no-discard" if self.ample_preserve == AMPLE_NO_DISCARD
                         else "ample-preserve" if self.ample_preserve else "no-ample-preserve")
        return "+".join([self.name, *parts])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.label!r})"

    def _score_all(self, paused, iteration, profile) -> list[_Scored]:
        profile = self.seen(profile)
        return [score(p, iteration, profile, chunked=self.chunked_recompute) for p in _holding_device(paused)]


class DiscardPolicy(Policy):
    """The paper's vLLM baseline: drop the KV at once, requeue at the tail, recompute in one go."""

    name = "discard"
    keeps_arrival_time = False

    def plan(self, paused, iteration, profile):
        return _in_input_order(paused, {s.info.request_id: _drop(s)
                                        for s in self._score_all(paused, iteration, profile)})


class ImprovedDiscardPolicy(DiscardPolicy):
    """ImprovedDiscard (§3.2; Figure 3 step 2): discard, but keep the original arrival time."""

    name = "improved-discard"
    keeps_arrival_time = True


class ChunkedDiscardPolicy(ImprovedDiscardPolicy):
    """Figure 3 step 3: ImprovedDiscard plus recomputation chunking (§4.2)."""

    name = "chunked-discard"
    chunked_recompute = True


class BudgetedSwapPolicy(ChunkedDiscardPolicy):
    """Figure 3 step 4: swap out within the per-iteration budget, discard once the limit is reached.

    No waste model yet, so the order is: swaps already in progress first (finish what was started),
    then by original arrival time.
    """

    name = "budgeted-swap"

    def plan(self, paused, iteration, profile):
        ordered = sorted(self._score_all(paused, iteration, profile), key=_swap_fcfs_key)
        decisions, rest = _swap_in_order(ordered, swap_room(iteration), profile)
        decisions.update({s.info.request_id: _drop(s) for s in rest})
        return _in_input_order(paused, decisions)


class HeuristicPreservePolicy(BudgetedSwapPolicy):
    """Figure 3 step 5: preserve short (automated) interceptions; budgeted swap, then discard, for long
    (interactive) ones.

    The paper splits by interception type; here "long" means an expected remaining time of at least
    ``long_threshold_s`` (default 2 s: between the automated tools of Table 1, at most 0.69 s on average,
    and the human or model-plus-human ones, 17 s or more).
    """

    name = "heuristic-preserve"

    def __init__(self, *, long_threshold_s: float = 2.0, **parts):
        super().__init__(**parts)
        self.long_threshold_s = long_threshold_s

    def plan(self, paused, iteration, profile):
        scored = self._score_all(paused, iteration, profile)
        short = [s for s in scored if s.info.expected_s < self.long_threshold_s]
        long = sorted((s for s in scored if s.info.expected_s >= self.long_threshold_s), key=_swap_fcfs_key)
        decisions, rest = _swap_in_order(long, swap_room(iteration), profile)
        decisions.update({s.info.request_id: _drop(s) for s in rest})
        decisions.update({s.info.request_id: s.decide(KVAction.PRESERVE) for s in short})
        return _in_input_order(paused, decisions)

    def preserve_guard(self, info, iteration, profile):
        # Short interceptions are preserved, whatever the iteration, until they look long.
        return None if info.kv_state == "partial" else PreserveGuard(expected_s=self.long_threshold_s)


class InferCeptPaperPolicy(Policy):
    """Figure 3 step 6, the paper's full system: chunked recompute, budgeted pipelined swap, min-waste
    (§4.3), with this project's swap-preemption. Kept without the policy parts beyond the paper, so the
    comparison with `infercept` can always be rerun."""

    name = "infercept-paper"
    chunked_recompute = True
    lazy_discard = True
    # Min-waste under pressure too: a request preserved because its interception looked short, or a
    # running request preempted for room, is swapped out rather than discarded when that wastes less.
    preemption = "swap"

    def plan(self, paused, iteration, profile):
        ample = bool(self.ample_preserve) and memory_ample(iteration)
        if ample and self._keeps_all_while_ample(profile):
            return _in_input_order(paused, {p.request_id: KVDecision(p.request_id, KVAction.PRESERVE)
                                            for p in _holding_device(paused)})
        plan = self._waste_plan(paused, iteration, profile)
        return without_discards(plan) if ample else plan

    def _keeps_all_while_ample(self, profile: Profile) -> bool:
        """With memory ample: keep every paused request (True), or only what the rule would discard."""
        if self.ample_preserve == BY_COPY_OVERLAP:
            return not profile.copies_overlap
        return self.ample_preserve is True

    def _waste_plan(self, paused, iteration, profile) -> KVPlan:
        """The waste rule's plan (min-waste or expected waste), keeping prefetched KV whose resume is near."""
        profile = self.seen(profile)
        held: dict[str, KVDecision] = {}
        if self.prefetch:
            # Prefetched KV whose resume still looks imminent stays: swapping it out again would undo
            # the prefetch for nothing.
            step_s = iteration.step_lead_s or profile.t_fwd(iteration.num_batched_tokens)
            for p in _holding_device(paused):
                if p.prefetched and resume_imminent(p.expected_s, profile, step_s, p.num_tokens):
                    held[p.request_id] = KVDecision(p.request_id, KVAction.PRESERVE)
        plan = (expected_waste_plan if self.expected_waste else min_waste_plan)(
            [p for p in paused if p.request_id not in held], iteration, profile, self.deferred_swap)
        if not held:
            return plan
        held.update((d.request_id, d) for d in plan)
        return _in_input_order(paused, held)

    def preserve_guard(self, info, iteration, profile):
        """With ``expected_waste``: `expected_waste_guard`. Otherwise: preserve beats chunked discard
        (Eq. 4) whatever the recompute chunk while
        ``T_int < T_fwd(C) / 2 + b · C_other`` with ``b = min over n of n · T_fwd(C / n) / C``; the
        guard takes half of this iteration's ``C_other`` as a floor (so the running batch may shrink to
        half before the request is planned again). No swap is worth it while both the expected time and
        the iteration stay below the round trip (`worth_swapping`). The factor below 1 keeps the bound
        strict under float rounding."""
        if self._keeps_all_while_ample(profile) and memory_ample(iteration):
            return PreserveGuard(while_ample=True)  # `plan` keeps every paused request while memory is ample
        if self.prefetch and info.prefetched:
            return None  # planned every iteration while it may be kept for its resume
        if self.expected_waste:
            return expected_waste_guard(info, iteration, profile)
        if info.kv_state == "partial":
            return None  # a swap in progress: planned every iteration until it completes
        C = info.num_device_tokens
        per_other_token = min(n * profile.t_fwd(C / n) for n in range(1, num_chunks(C, profile.block_size) + 1)) / C
        floor = iteration.num_running_tokens // 2
        round_trip = swap_round_trip(info, profile)
        return PreserveGuard(expected_s=(profile.t_fwd(C) / 2 + per_other_token * floor) * (1 - 1e-9),
                             swap_expected_s=round_trip, swap_iteration_s=round_trip, min_running_tokens=floor)


class InferCeptPolicy(InferCeptPaperPolicy):
    """The default: the paper's policy with the policy parts beyond the paper that the GPU-scale
    simulation supports (benchmarks/README.md, "Beyond the paper": never worse than `infercept-paper` beyond
    seed-to-seed noise there, more resumes finding their KV on the device): expected-waste decisions
    and proactive swap-in; and while the device pool has room for all queued work, no swap or discard
    where copies stall the forward pass (a CPU; from the real server, benchmarks/README.md, "Ample
    memory"), no discard where they overlap it (a GPU; `approval@10` twice as fast, the mix unchanged);
    and deferred swaps (`defer_swap`: the long-context workload 1.06x the sustainable programs/s, its
    recompute share of forward time at 0.1 programs/s from 9.5% to 1.4%, every other workload
    unchanged). Least attained service is not among them: it raised latency on every loaded workload
    measured."""

    name = "infercept"
    expected_waste = True
    prefetch = True
    ample_preserve = BY_COPY_OVERLAP
    deferred_swap = True


class PreservePolicy(Policy):
    """Preserve (§3.2): keep every paused request's KV on the device."""

    name = "preserve"

    def plan(self, paused, iteration, profile):
        return _in_input_order(paused, {s.info.request_id: s.decide(KVAction.PRESERVE)
                                        for s in self._score_all(paused, iteration, profile)})

    def preserve_guard(self, info, iteration, profile):
        return PreserveGuard()  # always


class SwapPolicy(Policy):
    """Swap (§3.2): synchronously copy the whole context to the host at interception.

    No per-iteration budget (the copy blocks the iteration instead); only the host pool limits it, and
    a request that does not fit there is discarded.
    """

    name = "swap"
    swap_synchronous = True

    def plan(self, paused, iteration, profile):
        room = iteration.free_host_tokens
        decisions = {}
        for s in sorted(self._score_all(paused, iteration, profile), key=_swap_fcfs_key):
            tokens = s.info.num_device_tokens
            if room is None or tokens <= room:
                decisions[s.info.request_id] = s.decide(KVAction.SWAP_OUT, tokens)
                room = None if room is None else room - tokens
            else:
                decisions[s.info.request_id] = _drop(s)
        return _in_input_order(paused, decisions)


class PrefixCachePolicy(DiscardPolicy):
    """Today's vLLM V1 / SGLang: the tool call ends the request, its blocks stay in the
    prefix cache until evicted, and the next request reuses what survived (chunked prefill for the rest).
    """

    name = "prefix-cache"
    keeps_arrival_time = False
    chunked_recompute = True
    lazy_discard = True


def _swap_fcfs_key(s: _Scored):
    return (s.info.kv_state != "partial", s.info.arrival_time, s.info.request_id)


POLICIES: dict[str, type[Policy]] = {
    "discard": DiscardPolicy,
    "vllm": DiscardPolicy,  # Figure 3's name for the same baseline
    "improved-discard": ImprovedDiscardPolicy,
    "chunked-discard": ChunkedDiscardPolicy,
    "budgeted-swap": BudgetedSwapPolicy,
    "heuristic-preserve": HeuristicPreservePolicy,
    "infercept": InferCeptPolicy,
    "infercept-paper": InferCeptPaperPolicy,
    "preserve": PreservePolicy,
    "swap": SwapPolicy,
    "prefix-cache": PrefixCachePolicy,
}

# Paper Figure 3 (§5.2): each step adds one technique to the one before it.
FIGURE3_ABLATION = ("vllm", "improved-discard", "chunked-discard", "budgeted-swap", "heuristic-preserve",
                    "infercept-paper")

# The parts a policy name may add after "+", each switching one thing (`Policy` attributes).
VARIANTS = tuple(f"{p}-preemption" for p in PREEMPTIONS) + tuple(f"{p}-priority" for p in PRIORITIES) + (
    "expected-waste", "mean-waste", "prefetch", "no-prefetch", "context-cost", "no-context-cost", "deferred-swap",
    "no-deferred-swap", "admission", "no-admission", "ample-preserve", "no-ample-preserve", "ample-no-discard")


def _variant(part: str) -> tuple[str, object]:
    if part.endswith("-preemption") and part.removesuffix("-preemption") in PREEMPTIONS:
        return "preemption", part.removesuffix("-preemption")
    if part.endswith("-priority") and part.removesuffix("-priority") in PRIORITIES:
        return "priority", part.removesuffix("-priority")
    if part in ("expected-waste", "mean-waste"):
        return "expected_waste", part == "expected-waste"
    if part in ("prefetch", "no-prefetch"):
        return "prefetch", part == "prefetch"
    if part in ("context-cost", "no-context-cost"):
        return "context_cost", part == "context-cost"
    if part in ("deferred-swap", "no-deferred-swap"):
        return "deferred_swap", part == "deferred-swap"
    if part in ("admission", "no-admission"):
        return "admission", part == "admission"
    if part in ("ample-preserve", "no-ample-preserve"):
        return "ample_preserve", part == "ample-preserve"
    if part == "ample-no-discard":
        return "ample_preserve", AMPLE_NO_DISCARD
    raise ValueError(f"unknown policy variant {part!r}; use {', '.join('+' + v for v in VARIANTS)}")


def make_policy(name: str, **kwargs) -> Policy:
    """The policy registered under ``name``, optionally with parts switched after ``+``: another
    preemption rule (``"infercept+recompute-preemption"``, ``"swap+swap-preemption"``: the ablation that
    credits the pause-time plan and the preemption rule separately), another queue order
    (``"infercept-paper+las-priority"``), expected-waste decisions (``"infercept-paper+expected-waste"``),
    admission under overload (``"infercept-paper+admission"``); several may be chained. ValueError naming the choices if unknown."""
    base, *parts = name.split("+")
    for part in parts:
        key, value = _variant(part)
        kwargs[key] = value
    try:
        cls = POLICIES[base]
    except KeyError:
        raise ValueError(f"unknown policy {base!r}; choose one of {', '.join(sorted(POLICIES))} "
                         f"(optionally +recompute-preemption or +swap-preemption, +las-priority, "
                         f"+program-arrival-priority, +expected-waste, +prefetch, +context-cost, +deferred-swap, "
                         f"+admission, +ample-preserve, +ample-no-discard)") from None
    return cls(**kwargs)
