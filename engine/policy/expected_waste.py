"""The min-waste rule with durations as distributions: expected wastes over the remaining-time
samples (`PausedInfo.remaining_s`), with re-queue delays (`Policy.expected_waste`).

The paper scores preserve with the expected remaining time, Eq. 2 at T_int = E[R]. Waste is linear in
R, so that is already the expectation of Eq. 2 over R; what a distribution adds is the option to stop
waiting. The policy re-plans whenever the estimate could change (at the latest when the elapsed time
passes one of the tool's past durations), so "preserve now" really means "preserve for a while, then
decide again". Among the TTLs "preserve until the k-th shortest past call would have returned, then
discard" (Continuum's pin-with-TTL), the expected waste is

    W(τ) = C·M·E[min(R, τ)] + P(R > τ)·W_discard

with τ = 0 the discard now and τ = max(R) Eq. 2 at E[R]. Preserve now iff some τ > 0 beats τ = 0. A
tool that returns in 0.1 s nine times in ten and in 60 s otherwise has a mean residual of 6 s (the
paper discards a context whose Eq. 4 is below 6 s of its memory); its best TTL is 0.1 s, after which
the conditional distribution is the 60 s mode alone and the context goes.

Re-queueing delay (Continuum): a discarded context resumes only after its recompute, (n - 1) more
iterations than a preserved one, and a swapped one after the part of its swap-in that no iteration
hides. The program waits that long; it is charged like memory held idle for that time
(delay x C x M), so the units stay byte·s.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

from .budget import recompute_chunk_size, swap_room, swap_round_trip, worth_swapping
from .min_waste import _holding_device, _in_input_order, _preserve_or_drop, _Scored, _swap_in_order
from .plan import IterationInfo, KVPlan, PausedInfo, PreserveGuard
from .profile import Profile
from .waste import num_chunks, waste_chunk_discard, waste_swap


def resume_delay_discard(C: int, iteration: IterationInfo, profile: Profile) -> float:
    """Seconds a discarded context's resume waits for its recompute beyond a preserved one: the chunks
    before the last (`recompute_chunk_size`), each an iteration at the saturation point."""
    n = num_chunks(C, recompute_chunk_size(profile, iteration.num_batched_tokens))
    if n <= 1:
        return 0.0
    # With attention modeled (`Policy.context_cost`): that of every chunk but the last (over all of C).
    attention = profile.t_recompute_attention(C, n) - profile.t_attention(C / n, C) if profile.has_attention else 0.0
    return (n - 1) * profile.t_fwd(profile.saturation_point) + attention


def least_resume_delay_discard(C: int, profile: Profile) -> float:
    """The least `resume_delay_discard` of any iteration: a recompute chunk is at most S tokens
    (`recompute_chunk_size`), so there are at least ceil(C / S) of them."""
    n = num_chunks(C, max(profile.saturation_point, profile.block_size))
    return (n - 1) * profile.t_fwd(profile.saturation_point) if n > 1 else 0.0


def resume_delay_swap(C: int, profile: Profile, iteration_s: float) -> float:
    """Seconds a swapped-out context's resume waits for its swap-in beyond the iteration it overlaps."""
    return max(profile.t_swap(C, "in") - iteration_s, 0.0)


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
        waste = (prefix + (N - k) * tau) / N * C * M + (N - k) / N * discard_waste
        if waste < best:
            best = waste
    return best


def score_expected(info: PausedInfo, iteration: IterationInfo, profile: Profile) -> _Scored:
    """Expected waste of preserving (best TTL, see above) and of discarding (Eq. 4 + re-queue delay)."""
    C, M = info.num_device_tokens, profile.bytes_per_token
    chunk = recompute_chunk_size(profile, iteration.num_batched_tokens)
    discard = (waste_chunk_discard(C, iteration.num_running_tokens, M, profile.t_fwd, chunk,
                                   profile.t_recompute_attention(C, num_chunks(C, chunk)))
               + resume_delay_discard(C, iteration, profile) * C * M)
    return _Scored(info, best_ttl_waste(info.remaining_sorted, C, M, discard), discard)


def expected_swap_waste(info: PausedInfo, profile: Profile, iteration_s: float, running_tokens: int) -> float:
    """A budgeted swap costs no waste while it overlaps iterations (paper §4.1), except when the call
    returns before the KV could be back (the resume waits out the rest of the round trip) and the
    swap-in that no iteration hides: ``C·M·(E[max(0, T_rt - max(R, T_iter))] + delay_in)``. Where copies
    do not overlap the forward pass (`Profile.copies_overlap` false: a CPU, or a GPU engine whose copies
    stall), the batch also stands still while they run, out and back in: Eq. 3 (`waste_swap`) over the
    `running_tokens` and this context (benchmarks/README.md, "H100 simulations on the measured profile",
    measures what pricing them as hidden cost)."""
    C = info.num_device_tokens
    round_trip = swap_round_trip(info, profile)
    remaining = info.remaining_sorted
    # Ascending: only the samples shorter than the round trip add (the rest add 0.0, which leaves the sum).
    early = sum(max(round_trip - max(r, iteration_s), 0.0)
                for r in itertools.takewhile(lambda r: r < round_trip, remaining)) / len(remaining)
    waste = (early + resume_delay_swap(info.num_tokens, profile, iteration_s)) * C * profile.bytes_per_token
    if not profile.copies_overlap:
        waste += waste_swap(C, running_tokens + C, profile.bytes_per_token, profile.t_swap)
    return waste


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
                and expected_swap_waste(s.info, profile, iteration_s, iteration.num_running_tokens) <= s.min_waste)

    decisions, rest = _swap_in_order(ordered, swap_room(iteration), profile, eligible=eligible)
    decisions.update(_preserve_or_drop(rest, decisions, iteration, profile, eligible if deferred_swap else None))
    return _in_input_order(paused, decisions)


def expected_waste_guard(info: PausedInfo, iteration: IterationInfo, profile: Profile) -> PreserveGuard | None:
    """`PreserveGuard` for `expected_waste_plan`. Discard's expected waste is at least
    ``D_low = (T_fwd(C)/2 + b·floor + d)·C·M`` (the cheapest chunking, half this iteration's running KV
    as the floor, as `InferCeptPolicy.preserve_guard`, and the least re-queue delay d of any iteration,
    `least_resume_delay_discard`; without d, most holders of long contexts on a GPU profile got no
    guard and were planned every step). One remaining-time
    point r: preserve beats discard while ``C·M·r < D_low``, a bound on the expected time. Several
    samples: between two jumps of the estimate (`DurationEstimator.next_jump`, where the scheduler wakes
    anyway) the surviving samples stay the same and all shrink with the clock, so every TTL's waste
    falls (τ shrinks with them) and a preserve that beats ``D_low`` now still does until the jump.
    Swaps need `worth_swapping`, so none while the expected time and the iteration stay below the round
    trip (the expected time only falls between jumps). For a holder whose KV is all on the device (a
    half-swapped one waits for swap room: `PreserveGuard.until_swap_room`)."""
    C, M = info.num_device_tokens, profile.bytes_per_token
    per_other_token = profile.cheapest_recompute_s(C) / C
    floor = iteration.num_running_tokens // 2
    low = (profile.t_fwd(C) / 2 + per_other_token * floor + least_resume_delay_discard(C, profile)) * C * M * (1 - 1e-9)
    round_trip = swap_round_trip(info, profile)
    remaining = info.remaining_sorted
    if len(remaining) == 1:
        bound = low / (C * M)
    elif best_ttl_waste(remaining, C, M, low) < low:
        # best_ttl_waste with D_low in place of the discard waste: the TTL beats any discard >= D_low.
        bound = info.expected_s + 1e9  # until the next jump, or the history changes (both wake it)
    else:
        return None
    return PreserveGuard(expected_s=bound, swap_expected_s=round_trip, swap_iteration_s=round_trip,
                         min_running_tokens=floor)
