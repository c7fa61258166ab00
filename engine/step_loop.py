"""The step sequence the engine and its simulation share (mechanism).

`Engine` (the real model, wall time) and `SimulatedEngine` (a `ModeledRunner` on a virtual clock) differ
in what runs a step and in what follows a sampled token (the engine's output stage, the simulation's
scripted turns), not in the order of things around them, which the statistics depend on: plan and
schedule, charge the paused KV held idle up to the plan and hold what the plan leaves, run, apply the
samples, record the step, hold the KV this step's pauses left. A resume and an abort change the paused
KV too and are charged the same way. This class is that order, once; each engine passes its runner and
its own part of the update.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .outputs import RunnerOutput, SchedulerOutput
from .scheduler import Scheduler
from .stats import EngineStats

T = TypeVar("T")


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner, stats: EngineStats):
        """runner: anything with `run(SchedulerOutput, while_running, defer_samples) -> RunnerOutput`
        (`ModelRunner`, which may return its samples still on their way; `ModeledRunner`)."""
        self.scheduler = scheduler
        self.runner = runner
        self.stats = stats

    def step(self, update: Callable[[SchedulerOutput, RunnerOutput], T],
             seconds: Callable[[], float], while_running: Callable[[], None] | None = None,
             defer_samples: bool = False) -> tuple[SchedulerOutput, T]:
        """One step; `update` applies the runner's samples (after `Scheduler.update`'s bookkeeping is the
        caller's to run inside it), `seconds()`, asked once it returns, is the step's time for the stats.
        `while_running`: host work the runner runs once the step's pass is launched, while it computes
        (the engine's output stage of the step before). `defer_samples`: the runner returns the samples
        still on their way to the host (`ModelRunner.run`; the engine's asynchronous scheduling)."""
        clock = self.scheduler.clock
        self.stats.hold(clock())  # the paused KV held idle since the last change
        planning = time.perf_counter()
        out = self.scheduler.schedule()
        self.stats.schedule_host_seconds += time.perf_counter() - planning
        self.stats.hold(clock(), out.num_paused_device_tokens)  # after the plan
        result = update(out, self.runner.run(out, while_running, defer_samples=defer_samples))
        self.stats.record(out, seconds())
        self.hold_paused_kv()  # this step's pauses
        return out, result

    def resume(self, request_id: str, token_ids: list[int], result_at: float | None = None) -> dict[str, int]:
        """Resume a paused request with `token_ids` appended; returns where its KV was at that moment
        (`Scheduler.kv_location`), counted in the stats."""
        location = self.scheduler.kv_location(request_id)
        self.stats.count_resume(location["device"], location["host"])
        self.scheduler.resume(request_id, token_ids, result_at)
        self.hold_paused_kv()
        return location

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.hold_paused_kv()

    def hold_paused_kv(self) -> None:
        """The paused requests' device KV changed (a pause, resume or abort): charge the idle memory held
        until now, then hold the new amount (`EngineStats.hold`)."""
        self.stats.hold(self.scheduler.clock(), self.scheduler.paused_device_tokens())
