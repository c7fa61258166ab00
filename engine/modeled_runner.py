"""A runner with no model: executes a `SchedulerOutput` by advancing a virtual clock.

The same scheduler that drives the real `ModelRunner` drives this one; only the mechanism differs.
An iteration costs what the profile says it costs:

    seconds = T_fwd(num_batched_tokens) + T_attn + wait + T_host

``T_attn`` is the sum of `Profile.t_attention` over the iteration's chunks (each over its context up to
its last token); 0 unless the profile models attention (long contexts; `Profile.t_attention`).

``wait`` is the time the forward pass stands still for copies, charged as the engine's copy ordering
(`copy_stream.py`) makes it wait:

- where copies overlap the forward pass (a GPU's copy stream, `Profile.copies_overlap`), a step's
  copies queue on one copy stream behind the ones still running from earlier steps and take
  ``T_swap(out) + T_swap(in)``; the pass waits only if it reads a block a swap-in still in flight
  writes, and then until the step's copies that write it end, not for copies queued after them. A
  swap-out never makes it wait: its blocks are gathered on the compute stream before the pass
  (device memory at device speed: not charged) and leave for the host from there. The scheduler runs
  a request whose KV comes back in a step from the next one on (`Scheduler`), so within the
  per-iteration budget (paper §4.1) the copies hide behind the pass;
- in a coarse simulation (`coarse`: a step stands for several real ones, `simulation.py`) copies
  budgeted per real iteration hide behind the real passes the step stands for: only the part that
  outlasts the step's pass shows, ``max(0, T_swap(out) + T_swap(in) - T_fwd - T_attn)``;
- where they do not (a CPU, where host and device pools are the same DRAM and a copy is a memcpy
  before the pass), and for the synchronous `swap` baseline (copies first, compute after, paper
  Eq. 3), the whole copy time is added.

Copies move whole blocks, so their cost is counted in blocks x block_size tokens.

``T_host`` is the host's time in a step that the device's work does not hide (`HostCost`; 0 unless
given): the real engine plans a step, stages its inputs and applies its samples while the device idles.
On an H100 (2026-11-28) that was 0.6-1.1 ms of a 7-14 ms step, up to 3 ms in steps that queued copies,
and the simulations leaving it out predicted infercept's latency 41% below the engine's. With asynchronous
scheduling (`HostCost.overlapped`) that work runs during the pass before, and only what outlasts a pass shows.

"Sampling" returns a fixed token id for every chunk that reaches its request's end: the scheduler only
needs *a* token to count output and check stops (max_tokens). Pure Python: no torch here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .outputs import RunnerOutput, SampledToken, SchedulerOutput
from .policy import Profile

SAMPLED_TOKEN_ID = 100


class VirtualClock:
    """Simulated seconds. Callable, so it can stand in for `time.monotonic` as the scheduler's clock."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    __call__ = now

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"time runs forward: advance({dt})")
        self._now += dt
        return self._now

    def advance_to(self, t: float) -> float:
        """Jump to `t` if it is in the future (idle time until the next event)."""
        self._now = max(self._now, t)
        return self._now


@dataclass(frozen=True)
class HostCost:
    """The host's time in a step beyond the device's, as a line fitted to an engine's step log
    (`benchmarks/gpu/host_cost.py`): `fixed_s` a step, `per_sequence_s` a scheduled sequence, and
    `swap_step_s` more in a step that queues swap copies."""

    fixed_s: float = 0.0
    per_sequence_s: float = 0.0
    swap_step_s: float = 0.0
    # Asynchronous scheduling: the host's work for a step runs while the step before computes, so a step
    # is charged only what outlasts the device's time (each step stands for the one before it here).
    overlapped: bool = False

    def seconds(self, output: SchedulerOutput) -> float:
        if not output.chunks and not output.swap_in and not output.swap_out:
            return 0.0
        swaps = self.swap_step_s if output.swap_in or output.swap_out else 0.0
        return max(self.fixed_s + self.per_sequence_s * len(output.chunks) + swaps, 0.0)


@dataclass(frozen=True)
class IterationCost:
    """Where one modeled iteration's time went."""

    seconds: float  # what the clock advanced: t_fwd + t_stall + t_host
    t_fwd: float  # forward pass of num_batched_tokens, attention included
    t_copy: float  # copy time of this iteration's swaps (whole blocks)
    t_stall: float  # time the forward pass waited for copies (this iteration's or earlier ones')
    num_batched_tokens: int
    num_swap_out_tokens: int
    num_swap_in_tokens: int
    t_host: float = 0.0  # the host's time the device's work does not hide (`HostCost`)


class ModeledRunner:
    """`run(SchedulerOutput) -> RunnerOutput` like `ModelRunner`, with the cost taken from a `Profile`."""

    def __init__(self, profile: Profile, clock: VirtualClock, block_size: int | None = None,
                 swap_synchronous: bool = False, coarse: bool = False, token_id: int = SAMPLED_TOKEN_ID,
                 host_cost: HostCost | None = None):
        self.profile = profile
        self.host_cost = host_cost
        self.clock = clock
        self.block_size = block_size or profile.block_size
        self.copies_stall = swap_synchronous or not profile.copies_overlap
        self.coarse = coarse
        self.token_id = token_id
        self.last: IterationCost | None = None  # cost of the latest `run`
        # The copy stream: when the copies queued so far end, and each step's copies still in flight that
        # swap in, as when they end and the device blocks they write (dropped once ended or waited for).
        self._copies_end = 0.0
        self._in_flight: list[tuple[float, set[int]]] = []

    def cost(self, output: SchedulerOutput) -> IterationCost:
        """The iteration's cost, its copies queued on the modeled copy stream as of the clock's now."""
        n = output.num_batched_tokens
        t_fwd = self.profile.t_fwd(n) if n else 0.0
        if self.profile.has_attention:
            t_fwd += sum(self.profile.t_attention(len(c.token_ids), c.start_pos + len(c.token_ids))
                         for c in output.chunks)
        out_tokens = len(output.swap_out) * self.block_size
        in_tokens = len(output.swap_in) * self.block_size
        t_copy = self.profile.t_swap(out_tokens, "out") + self.profile.t_swap(in_tokens, "in")
        if self.copies_stall:
            t_stall = t_copy
        elif self.coarse:
            t_stall = max(0.0, t_copy - t_fwd)
        else:
            t_stall = self._queue_copies(output, t_copy)
        t_host = self.host_cost.seconds(output) if self.host_cost is not None else 0.0
        if self.host_cost is not None and self.host_cost.overlapped:
            t_host = max(0.0, t_host - t_fwd - t_stall)
        return IterationCost(t_fwd + t_stall + t_host, t_fwd, t_copy, t_stall, n, out_tokens, in_tokens, t_host)

    def _queue_copies(self, output: SchedulerOutput, t_copy: float) -> float:
        """Queue the step's copies behind those still running; the seconds its pass waits for them."""
        now = self.clock.now()
        self._in_flight = [(end, blocks) for end, blocks in self._in_flight if end > now]
        if t_copy:
            self._copies_end = max(now, self._copies_end) + t_copy
            if output.swap_in:
                self._in_flight.append((self._copies_end, {device for _, device in output.swap_in}))
        waits_until = max((end for end, blocks in self._in_flight
                           if any(not blocks.isdisjoint(c.block_table) for c in output.chunks)), default=None)
        if waits_until is None:
            return 0.0
        self._in_flight = [(end, blocks) for end, blocks in self._in_flight if end > waits_until]
        return waits_until - now

    def run(self, output: SchedulerOutput, while_running: Callable[[], None] | None = None,
            defer_samples: bool = False) -> RunnerOutput:
        """`defer_samples` changes nothing: a modeled step's samples are known at once."""
        self.last = self.cost(output)
        if while_running is not None:
            while_running()
        self.clock.advance(self.last.seconds)
        token = SampledToken(self.token_id)
        return RunnerOutput(sampled={c.request_id: token for c in output.chunks if c.sample})
