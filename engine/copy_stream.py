"""Ordering of swap copies against the forward pass (mechanism, no decisions).

On CUDA the swap copies of a step run on their own stream, so they overlap the forward passes instead
of queueing behind them on the compute stream. Events keep the two streams honest:

    compute  ── fwd N-1 ──● gather ●── fwd N (no block swapped in for it) ── ◆ fwd N+1 (reads them) ──
                          │        │                                         ▲ waits if not done yet
    copy                  └────────┴──▶ swap-out to host, swap-in of step N ─●┘ event

- A swap-out first gathers its blocks into a staging buffer on the compute stream, after the pass that
  last wrote them and before the next pass, which may then write the freed blocks at once (a device
  copy at device speed: tens of microseconds for a step's worth of blocks); the slow transfer to the
  host reads the staging buffer on the copy stream.
- A copy starts after every forward pass and gather queued before it: that covers the last pass that
  used a block a swap-in now overwrites, and the gather of a block a swap-out of the same step freed.
  The runner queues a step's copies once its pass is launched, where the pass touches none of the
  blocks they write, ordered after a `mark` recorded before the pass: they start on the copy stream as
  if queued before it, and the host's queueing (0.45 ms for 64 blocks each way on an H100, 2026-11-28)
  overlaps the pass instead of delaying it.
- A forward pass waits for the copies only if it touches a device block a queued swap-in writes. The
  scheduler runs a request whose KV comes back from the next step on (`Scheduler`), so the pass of the
  step that queued the copy never does, and the next one only if the copy outlasted a pass.
- It waits for the batch of copies that writes that block (one event each), not for those queued
  after it: the next step's own copies, queued just before its pass. One event after the newest copies
  made such a pass wait for its step's swap-outs and swap-ins too (on an H100, 2026-11-28, every copy
  wait of the engine trace fell in a step that had queued copies: 560 waits of 2.8 ms on average).
- All copies share one stream and run in the order issued, so a swap-out into a host block a swap-in
  just read needs no event.

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
        # Each batch of copies queued with device blocks it writes, as the event recorded after it and
        # those blocks, until a pass waited for it or it was seen to have ended. The stream runs in
        # order, so a batch has ended once a later one has. `_last_copy`: after the newest batch.
        self._in_flight: list[tuple[torch.cuda.Event, frozenset[int]]] = []
        self._last_copy: torch.cuda.Event | None = None
        # Each wait of a forward pass for the copies, as timing events around it on the compute stream:
        # the time between them is the time the pass stood still (`waited_seconds`).
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def mark(self) -> torch.cuda.Event | None:
        """The work queued so far on the compute stream, for copies queued later to start after it and
        not after what is queued meanwhile (`copying`'s `after`). None on a CPU."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def copying(self, device_blocks_written: Iterable[int] = (), after: torch.cuda.Event | None = None):
        """Queue the copies made inside on the copy stream, after the work queued so far on the compute
        stream, or after `after` (a `mark`) where given: then they run beside the work queued since,
        which must not touch what they read or write. `device_blocks_written`: the device blocks they
        write, which no forward pass may touch before they are done."""
        if self.stream is None:
            yield
            return
        self.stream.wait_event(after if after is not None else self.mark())
        # Tensors allocated inside (index and staging buffers) belong to the copy stream, so the caching
        # allocator reuses their memory only for later work on that same stream.
        with torch.cuda.stream(self.stream):
            yield
        self._last_copy = torch.cuda.Event()
        self._last_copy.record(self.stream)
        blocks = frozenset(device_blocks_written)
        if blocks:
            self._in_flight.append((self._last_copy, blocks))

    def before_forward(self, device_blocks: Iterable[int]) -> None:
        """Make the forward pass queued next wait for the copies that write any of `device_blocks`, and
        only for those: not for a batch queued after the last of them (the step's own copies, queued
        just before its pass and never read by it, `Scheduler`)."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.pop(0)
        if not self._in_flight:
            return
        writer = {block: i for i, (_, blocks) in enumerate(self._in_flight) for block in blocks}
        last_read = max((writer[b] for b in device_blocks if b in writer), default=-1)
        if last_read < 0:
            return
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(self._in_flight[last_read][0])
        after.record(compute)
        self._waits.append((before, after))
        del self._in_flight[:last_read + 1]  # every later forward pass queues behind this one

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
        self._in_flight.clear()
