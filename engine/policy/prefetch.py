"""Proactive swap-in (`Policy.prefetch`): which paused requests' host KV to bring back now, soonest first.

Both schedulers ask it the same way (the native one, `engine/scheduler.py`, and the vLLM backend's,
`engine/vllm_backend/scheduler.py`); each owns the mechanism (which holders its paused-KV index hands over,
how a copy is made). A holder is a paused request with KV on the host whose remaining pause is predicted
(`DurationEstimator.predicted`). The copies share the per-step swap budget, soonest first and after the
swap-ins already queued (`ahead_tokens`): a request whose KV comes back behind others' needs as many steps
as the budget takes to copy everything ahead of it and its own, so its lead counts them.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

from .budget import resume_imminent
from .profile import Profile

R = TypeVar("R")


def copy_steps(tokens: int, per_step: int | None) -> int:
    """Steps a per-step swap budget of `per_step` tokens (None: unlimited) needs to copy `tokens`."""
    return 1 if not per_step else max(1, -(-tokens // per_step))


def key_time(now: float, expected_s: float, profile: Profile, host_tokens: int) -> float:
    """The earliest time a holder's copy back could be due: its predicted resume less the copy's time. A
    prediction falls as fast as the clock until its tool's history changes, so the key stays early."""
    return now + expected_s - profile.t_swap(host_tokens, "in")


def horizon(now: float, profile: Profile, step_s: float, per_step: int | None, ahead_tokens: int,
            all_host_tokens: int) -> float:
    """No holder keyed after this can be due now: none needs more steps than all host KV and the copies
    ahead take, or a longer copy than all of it. Holders ahead of an imminent one in `due`'s order are
    keyed before it too (their predicted resume is no later, their copy no longer than all)."""
    return (now + copy_steps(ahead_tokens + all_host_tokens, per_step) * step_s
            + profile.t_swap(all_host_tokens, "in"))


def due(holders: Sequence[tuple[R, int, float]], profile: Profile, step_s: float, per_step: int | None,
        ahead_tokens: int = 0) -> list[tuple[R, int]]:
    """Of `holders` ((request, host tokens, expected remaining pause); a request has `priority`, a tuple),
    those whose resume looks imminent (`resume_imminent`), soonest first (ties: queue order), with their
    host tokens. `step_s`: the scheduler's step lead (how long the next step may run before it can act
    again); `per_step`: the per-step swap budget in tokens (None: unlimited)."""
    out = []
    for request, host, expected in sorted(holders, key=lambda h: (h[2], h[0].priority)):
        ahead_tokens += host
        if resume_imminent(expected, profile, step_s, host, copy_steps(ahead_tokens, per_step)):
            out.append((request, host))
    return out
