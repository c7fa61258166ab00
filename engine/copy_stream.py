"""Ordering of swap copies against the forward pass (mechanism, no decisions).

On CUDA the swap copies of a step run on their own stream, so they overlap the forward passes instead
of queueing behind them on the compute stream. Events keep the two streams honest:

    compute  ── fwd N-1 ──●─── fwd N (no pending block) ─────── ◆ fwd N+1 (reads a swapped-in block) ──
                          │ event                               ▲ waits
    copy                  └──▶ swap-out / swap-in of step N ──●─┘ event

- A copy starts after every forward pass queued before it: that covers the pass that last wrote a
  swapped-out block, and the last pass that used a block a swap-in now overwrites.
- A forward pass waits for the copies only if it touches a device block a queued copy reads or
  writes (a block swapped in for it, or a block freed by a swap-out and handed to it already).
- All copies share one stream and run in the order issued, so a swap-in into a block that a swap-out
  of the same step just freed, or a swap-out into a host block a swap-in just read, needs no event.

On the CPU every copy is synchronous and this class does nothing. On CUDA it times each wait of a
forward pass for the copies (`waited_seconds`): what swaps cost a step beyond what the copy stream hides.

Nothing queued here may make the host wait: a host list turned into a device tensor with
`torch.tensor(..., device=...)` synchronizes the stream it is made on, and on the copy stream that means
waiting for the forward pass the copies were ordered after, then for the copies themselves, before the
next pass is even queued (an H100 measured 2-4% of a swap's copy time hidden behind a forward pass that
way, 2026-11-27). Index lists go up through pinned memory instead (`to_device`).
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list or tensor on `device`: on CUDA through pinned memory without waiting for the copy
    (the pinned staging memory is not reused before the copy is done: torch's host allocator records it)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Device blocks that copies queued since the last wait read or write; `_last_copy` is recorded
        # after the newest of them (the stream is FIFO, so it completes after all of them).
        self._pending_blocks: set[int] = set()
        self._last_copy: torch.cuda.Event | None = None
        # Each wait of a forward pass for the copies, as timing events around it on the compute stream:
        # the time between them is the time the pass stood still (`waited_seconds`).
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def copying(self, device_blocks: Iterable[int]):
        """Queue the copies made inside on the copy stream, after the forward passes queued so far."""
        if self.stream is None:
            yield
            return
        forwards_queued = torch.cuda.Event()
        forwards_queued.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(forwards_queued)
        # Tensors allocated inside (index and staging buffers) belong to the copy stream, so the caching
        # allocator reuses their memory only for later work on that same stream.
        with torch.cuda.stream(self.stream):
            yield
        self._last_copy = torch.cuda.Event()
        self._last_copy.record(self.stream)
        self._pending_blocks.update(device_blocks)

    def before_forward(self, device_blocks: Iterable[int]) -> None:
        """Make the forward pass queued next wait for the copies that touch any of `device_blocks`."""
        if not self._pending_blocks:
            return
        if self._last_copy.query():
            self._pending_blocks.clear()  # all finished: nothing to wait for
        elif not self._pending_blocks.isdisjoint(device_blocks):
            compute = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(self._last_copy)
            after.record(compute)
            self._waits.append((before, after))
            self._pending_blocks.clear()  # every later forward pass queues behind this one

    def waited_seconds(self) -> float:
        """Seconds forward passes stood waiting for copies, over the waits that have ended since the last
        call (a step's, once its sampled ids are on the host). No host sync: a wait still under way is
        counted by a later call."""
        total = 0.0
        while self._waits and self._waits[0][1].query():
            before, after = self._waits.pop(0)
            total += before.elapsed_time(after) / 1e3
        return total

    def synchronize(self) -> None:
        """Block the host until every queued copy has finished."""
        if self._last_copy is not None:
            self._last_copy.synchronize()
        self._pending_blocks.clear()
