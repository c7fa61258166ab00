"""GPU memory waste of each way to hold a paused request's KV (paper §3.2 and §4.2, Eqs. 1-4).

Waste is memory × time: bytes of device memory that sit idle (not producing tokens) times the
seconds they sit idle, so every function returns byte·seconds. ``M`` cancels when two wastes of the
same request are compared, but it is kept so the numbers mean something on their own (metrics,
benchmarks). ``t_fwd`` and ``t_swap`` are callables, normally `Profile.t_fwd` and `Profile.t_swap`.

Lazy discard (prefix caching): a discarded context's blocks stay cached until the allocator evicts
them, so the recompute a discard actually costs is only the evicted part, between zero and the
full ``C``. The waste model keeps charging the full recompute on purpose. Survival depends on how many
blocks are allocated before the resume, and the policy discards mostly under memory pressure, exactly
when the evictable blocks are taken first; counting a survival probability would tilt decisions
toward discarding in the cases where that is least safe. So the model is an upper bound on discard's
waste, decisions are the paper's, and lazy discard only makes the outcome of a discard cheaper
(measured as `infercept_prefix_cache_hit_blocks` and a lower recompute share).

Notation: ``C`` context tokens of the paused request, ``C_other`` tokens held by the other running
requests, ``C_batch`` tokens held by the whole batch, ``T_int`` interception time, ``n`` recompute chunks.
"""
from __future__ import annotations

import math
from typing import Callable

TimeOfTokens = Callable[[float], float]  # tokens -> seconds


def waste_preserve(t_int: float, C: int, M: int) -> float:
    """Eq. 2: ``WastePreserve = T_int × C × M``.

    The request keeps its ``C·M`` bytes on the device for the whole interception. ``t_int`` is what the
    caller expects that time to be; the policy passes the expected *remaining* time (see
    `estimator.DurationEstimator`), because memory already held is spent whatever we decide now.
    """
    return t_int * C * M


def waste_discard(C: int, C_other: int, M: int, t_fwd: TimeOfTokens) -> float:
    """Eq. 1: ``WasteDiscard = T_fwd(C)·C·M + T_fwd(C)·C_other·M``.

    Recomputing all ``C`` tokens in one iteration takes ``T_fwd(C)``: the recomputed KV occupies memory
    without producing a token (first term), and the other running requests' memory waits for the longer
    iteration (second term). Used by `discard` and `improved-discard`.
    """
    t = t_fwd(C)
    return t * C * M + t * C_other * M


def num_chunks(C: int, chunk_size: int) -> int:
    """``n = ceil(C / chunk_size)``: iterations needed to recompute ``C`` tokens in chunks."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return math.ceil(C / chunk_size) if C > 0 else 0


def waste_chunk_discard(C: int, C_other: int, M: int, t_fwd: TimeOfTokens, chunk_size: int,
                        t_attention: float = 0.0) -> float:
    """Eq. 4: ``WasteChunkDiscard = T_fwd(C)·C·M / 2 + n·T_fwd(C/n)·C_other·M``, ``n = ceil(C/chunk)``.

    Recomputing one chunk per iteration holds, on average, half the context while recomputation is in
    progress (first term: half of Eq. 1's). Each of the ``n`` iterations grows by the chunk's forward time,
    during which the other requests' memory waits (second term). The chunk size is ``S`` minus the running
    batch's query tokens (paper §4.2; `budget.recompute_chunk_size`).

    ``T_fwd(C/n)`` is evaluated as written in the paper, i.e. the profile's full iteration time for
    ``C/n`` tokens, not the difference ``T_fwd(B + C/n) - T_fwd(B)``. This is the conservative reading:
    it charges recomputation for every iteration it occupies, which keeps short interceptions (QA, ALFWorld)
    on the preserve side, as the paper reports in §5.1.

    ``t_attention``: seconds the recompute's attention over the growing context adds in all
    (`Profile.t_recompute_attention`; the paper's ``T_fwd`` leaves it out), added to both durations.
    """
    n = num_chunks(C, chunk_size)
    if n == 0:
        return 0.0
    return (t_fwd(C) + t_attention) * C * M / 2 + (n * t_fwd(C / n) + t_attention) * C_other * M


def waste_swap(C: int, C_batch: int, M: int, t_swap: TimeOfTokens) -> float:
    """Eq. 3: ``WasteSwap = 2 × T_swap(C) × C_batch × M``.

    Synchronous swap: the swapped memory and the rest of the batch both wait while ``C`` tokens are
    copied out, and again when they are copied back in, hence the factor 2. Budgeted, pipelined swap
    (paper §4.1) hides the copy behind the forward pass and costs no waste, which is why the min-waste
    policy does not compute this; it is here for the synchronous `swap` baseline and for reports.
    """
    return 2 * t_swap(C) * C_batch * M
