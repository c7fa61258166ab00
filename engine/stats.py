"""Accounting: what each iteration recomputed, swapped and held idle; cumulative counters for metrics."""
from __future__ import annotations

from dataclasses import dataclass

from .outputs import SchedulerOutput


@dataclass
class EngineStats:
    bytes_per_token: int
    num_steps: int = 0
    forward_seconds: float = 0.0
    num_computed_tokens: int = 0  # every token a forward pass processed
    num_recomputed_tokens: int = 0  # of those, tokens whose KV had been computed before
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_discarded_tokens: int = 0
    num_preemptions: int = 0
    num_preemptions_by_swap: int = 0
    # Held-but-idle KV: bytes paused requests keep on the device x seconds they keep them.
    memory_waste_byte_seconds: float = 0.0
    last_paused_device_tokens: int = 0

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        self.num_steps += 1
        self.forward_seconds += seconds
        self.num_computed_tokens += out.num_batched_tokens
        self.num_recomputed_tokens += out.num_recomputed_tokens
        self.num_swapped_out_blocks += len(out.swap_out)
        self.num_swapped_in_blocks += len(out.swap_in)
        self.num_discarded_tokens += out.num_discarded_tokens
        self.num_preemptions += out.num_preempted
        self.num_preemptions_by_swap += out.num_preempted_by_swap
        self.memory_waste_byte_seconds += out.num_paused_device_tokens * self.bytes_per_token * seconds
        self.last_paused_device_tokens = out.num_paused_device_tokens

    @property
    def recompute_share(self) -> float:
        """Share of computed tokens that were recomputation (a proxy for forward time spent on it)."""
        return self.num_recomputed_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0
