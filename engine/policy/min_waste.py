"""The paper's min-waste rule: each paused request's waste, and the per-iteration plan built from it.

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

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .budget import iteration_swap_limit, recompute_chunk_size, swap_amount, swap_room, worth_swapping
from .plan import IterationInfo, KVAction, KVDecision, KVPlan, PausedInfo
from .profile import Profile
from .waste import num_chunks, waste_chunk_discard, waste_discard, waste_preserve, waste_swap


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



def without_discards(plan: KVPlan) -> KVPlan:
    """The plan with every DISCARD turned into PRESERVE (`AMPLE_NO_DISCARD`, while `memory_ample`): the
    memory a discard frees is wanted by nobody, and its recompute is never free, while a swap within
    the budget overlaps the forward pass (on a GPU) and leaves the room ready for the next burst."""
    return KVPlan(tuple(replace(d, action=KVAction.PRESERVE) if d.action is KVAction.DISCARD else d
                        for d in plan))
