"""Accounting: what each iteration recomputed, swapped and held idle; cumulative counters for metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import SchedulerOutput

# Where a resumed request found its KV (`resume_kv_place`), the keys of `EngineStats.resumes_by_kv`.
RESUME_KV_PLACES = ("device", "host", "recompute")


def resume_kv_place(device: int, host: int) -> str:
    """Where a paused request's computed KV was when its resume came: all of it on the device (the turn
    starts at once), some on the host (copied back first), or none (discarded: recomputed past whatever
    the prefix cache still holds). The share of `device` is what proactive swap-in aims to raise."""
    return "host" if host else "device" if device else "recompute"


@dataclass
class EngineStats:
    bytes_per_token: int
    num_steps: int = 0
    forward_seconds: float = 0.0
    num_computed_tokens: int = 0  # every token a forward pass processed
    num_recomputed_tokens: int = 0  # of those, tokens whose KV had been computed before
    # Step seconds spent on recomputation, modeled: each step's time split over its tokens pro rata (a
    # recomputed prefill token costs what any other token of its step costs; attention's growth with
    # context length and the fixed per-step cost are not apportioned).
    recompute_seconds: float = 0.0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_discarded_tokens: int = 0
    num_preemptions: int = 0
    num_preemptions_by_swap: int = 0
    # Held-but-idle KV: bytes paused requests keep on the device x the seconds they keep them, over the
    # engine's clock, between steps as well as during them (the paper's Eqs. 1-4 integrate over the
    # whole interception, not just over the iterations that happen to run meanwhile).
    memory_waste_byte_seconds: float = 0.0
    paused_device_tokens: int = 0  # held since `held_since`
    held_since: float | None = None
    # Admission under overload (Policy.admission), as of the last step: the cap on active programs
    # (None: uncapped, or no admission part), and the new programs it held back.
    admission_cap: int | None = None
    num_held_back: int = 0
    num_thrashed_tokens: int = 0  # cumulative: KV computed or copied again (SchedulerOutput)
    # Host seconds the scheduler took to plan the steps, wall clock in a simulation too: on a GPU, where
    # a step's forward pass is a few ms, the plan's Python is a share of the step no profile models.
    schedule_host_seconds: float = 0.0
    # Seconds forward passes waited for swap copies on a GPU (`CopyStream.waited_seconds`; 0 on a CPU,
    # where a copy is part of the step); in a simulation the waits the modeled runner charges.
    copy_wait_seconds: float = 0.0
    # Seconds of the steps from each forward pass to its sampled ids (`ModelRunner.device_seconds`: the
    # device's own time on CUDA, the model's wall time on a CPU; in a simulation the modeled passes). The
    # steps' time less this is the host's share: planning, inputs, the output stage, copy waits.
    device_seconds: float = 0.0
    resumes_by_kv: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESUME_KV_PLACES, 0))

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        self.num_steps += 1
        self.forward_seconds += seconds
        self.num_computed_tokens += out.num_batched_tokens
        self.num_recomputed_tokens += out.num_recomputed_tokens
        if out.num_batched_tokens:
            self.recompute_seconds += seconds * out.num_recomputed_tokens / out.num_batched_tokens
        self.num_swapped_out_blocks += len(out.swap_out)
        self.num_swapped_in_blocks += len(out.swap_in)
        self.num_discarded_tokens += out.num_discarded_tokens
        self.num_preemptions += out.num_preempted
        self.num_preemptions_by_swap += out.num_preempted_by_swap
        self.num_thrashed_tokens += out.num_thrashed_tokens
        self.admission_cap = out.admission_cap
        self.num_held_back = out.num_held_back

    def count_resume(self, device: int, host: int) -> None:
        """A paused request resumed with `device` / `host` tokens of its computed KV in place."""
        self.resumes_by_kv[resume_kv_place(device, host)] += 1

    @property
    def resumes_on_device_share(self) -> float:
        """Share of resumes that found all their KV on the device (0 before the first resume)."""
        total = sum(self.resumes_by_kv.values())
        return self.resumes_by_kv["device"] / total if total else 0.0

    def hold(self, now: float, paused_device_tokens: int | None = None) -> None:
        """Charge the paused device KV held since the last call up to `now`; from `now` on, paused
        requests hold `paused_device_tokens` (None: as many as before). Call whenever that changes."""
        self.memory_waste_byte_seconds = self.memory_waste_until(now)
        self.held_since = now
        if paused_device_tokens is not None:
            self.paused_device_tokens = paused_device_tokens

    def memory_waste_until(self, now: float) -> float:
        """Held-but-idle byte-seconds up to `now` (what `hold(now)` would make the total)."""
        if self.held_since is None:
            return self.memory_waste_byte_seconds
        return self.memory_waste_byte_seconds + self.paused_device_tokens * self.bytes_per_token * (
            now - self.held_since)

    @property
    def recompute_token_share(self) -> float:
        """Share of computed tokens that were recomputation (not of time: see `recompute_time_share`)."""
        return self.num_recomputed_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0

    @property
    def recompute_time_share(self) -> float:
        """Share of step time spent recomputing, as modeled by `recompute_seconds`."""
        return self.recompute_seconds / self.forward_seconds if self.forward_seconds else 0.0
