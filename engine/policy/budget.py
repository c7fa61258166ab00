"""How much KV may move in one iteration, and when moving it pays: the swap limit ``N_i`` and its split
between swap-in and swap-out (paper §4.1), the recompute chunk (§4.2), swap amounts in whole blocks, the
swap round trip, ample device memory (nothing to free), and when a proactive swap-in must start. The
schedulers read these directly; the waste rules (`min_waste`, `expected_waste`) build on them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import IterationInfo, PausedInfo
from .profile import Profile


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



def memory_ample(iteration: IterationInfo) -> bool:
    """The device pool has room for every queued need with the paused KV kept where it is: then no
    other request could use the memory a swap or discard would free, so holding it wastes nothing
    (the waste equations price held memory as if someone were waiting for it), while the round trip
    costs real time where copies do not overlap the forward pass (on a CPU, `copy_stream.py`) and
    delays the resume wherever its swap-in is not hidden."""
    return iteration.spare_device_tokens is not None and iteration.spare_device_tokens >= 0


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
    per-step swap budget needs for this copy and those queued ahead of it (`prefetch.due`)."""
    return expected_s < profile.t_swap(host_tokens, "in") + copy_steps * step_s

