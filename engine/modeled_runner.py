"""A runner with no model: executes a `SchedulerOutput` by advancing a virtual clock.

The same scheduler that drives the real `ModelRunner` drives this one; only the mechanism differs.
An iteration costs what the profile says it costs:

    seconds = T_fwd(num_batched_tokens) + T_attn + stall
    stall   = T_swap(swapped-out tokens) + T_swap(swapped-in tokens)            synchronous swap
            = max(0, T_swap(out) + T_swap(in) - T_fwd - T_attn)                pipelined swap

``T_attn`` is the sum of `Profile.t_attention` over the iteration's chunks (each over its context up to
its last token); 0 unless the profile models attention (long contexts; `Profile.t_attention`).

Pipelined (budgeted) swaps run on a copy stream beside the forward pass (paper §4.1), so only the part
of the copy that outlasts the forward pass shows up; within the per-iteration budget that part is zero
unless this iteration is shorter than the one the budget was sized for. The synchronous `swap`
baseline copies first and computes after, so its whole copy time is added (paper Eq. 3). Copies move
whole blocks, so their cost is counted in blocks x block_size tokens.

"Sampling" returns a fixed token id for every chunk that reaches its request's end: the scheduler only
needs *a* token to count output and check stops (max_tokens). Pure Python: no torch here.
"""
from __future__ import annotations

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
class IterationCost:
    """Where one modeled iteration's time went."""

    seconds: float  # what the clock advanced: t_fwd + t_stall
    t_fwd: float  # forward pass of num_batched_tokens, attention included
    t_copy: float  # copy time of this iteration's swaps (whole blocks)
    t_stall: float  # copy time not hidden behind the forward pass
    num_batched_tokens: int
    num_swap_out_tokens: int
    num_swap_in_tokens: int


class ModeledRunner:
    """`run(SchedulerOutput) -> RunnerOutput` like `ModelRunner`, with the cost taken from a `Profile`."""

    def __init__(self, profile: Profile, clock: VirtualClock, block_size: int | None = None,
                 swap_synchronous: bool = False, token_id: int = SAMPLED_TOKEN_ID):
        self.profile = profile
        self.clock = clock
        self.block_size = block_size or profile.block_size
        self.swap_synchronous = swap_synchronous
        self.token_id = token_id
        self.last: IterationCost | None = None  # cost of the latest `run`

    def cost(self, output: SchedulerOutput) -> IterationCost:
        n = output.num_batched_tokens
        t_fwd = self.profile.t_fwd(n) if n else 0.0
        if self.profile.has_attention:
            t_fwd += sum(self.profile.t_attention(len(c.token_ids), c.start_pos + len(c.token_ids))
                         for c in output.chunks)
        out_tokens = len(output.swap_out) * self.block_size
        in_tokens = len(output.swap_in) * self.block_size
        t_copy = self.profile.t_swap(out_tokens, "out") + self.profile.t_swap(in_tokens, "in")
        t_stall = t_copy if self.swap_synchronous else max(0.0, t_copy - t_fwd)
        return IterationCost(t_fwd + t_stall, t_fwd, t_copy, t_stall, n, out_tokens, in_tokens)

    def run(self, output: SchedulerOutput) -> RunnerOutput:
        self.last = self.cost(output)
        self.clock.advance(self.last.seconds)
        token = SampledToken(self.token_id)
        return RunnerOutput(sampled={c.request_id: token for c in output.chunks if c.sample})
