"""Sustainable load: the highest request rate whose normalized latency stays within an SLO.

Shared by the simulation (`policy_sim.py`, median latency per rate) and the real-server sweep
(`sweep.py`, mean latency per rate), so both report the same quantity the same way.
"""
from __future__ import annotations

import math


def sustainable_rate(latency_by_rate: dict[float, float], slo: float) -> tuple[float, bool]:
    """Walk the rates upwards until the latency first exceeds `slo`; the sustainable rate is where the
    straight line between the last rate within the SLO and that first rate above it crosses the SLO.

    Returns (rate, crossed). `crossed` is False when no measured rate exceeded the SLO: the rate is then
    the highest one measured, a lower bound. When even the lowest rate exceeds the SLO the answer is 0.
    A rate after the first crossing that happens to dip back under the SLO does not count: a system that
    is overloaded at a lower rate is not sustainable at a higher one.
    """
    prev = None
    for rate in sorted(latency_by_rate):
        latency = latency_by_rate[rate]
        if not latency <= slo:  # NaN (nothing completed) counts as over the SLO
            if prev is None:
                return 0.0, True
            r0, l0 = prev
            if not math.isfinite(latency):
                return r0, True
            return r0 + (rate - r0) * (slo - l0) / (latency - l0), True
        prev = (rate, latency)
    return (prev[0] if prev else 0.0), False


def ratio_text(a: float, b: float) -> str:
    """`a / b` as "1.23x", or "–" when it is undefined."""
    if b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return "–"
    return f"{a / b:.2f}x"
