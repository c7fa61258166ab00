"""The KV pools: tensors only, no decisions (mechanism).

    device pool  kv[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    host pool    kv[num_host_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]

Block `b` of the device pool is `kv[:, :, b]`: every layer's K and V for `block_size` consecutive
tokens of one request (the attention kernel wants each layer's blocks side by side). The device pool
has one block more than the block manager hands out, the scratch block: padded rows of a CUDA-graph
batch (`cuda_graphs.py`) write their K/V there and read it back, so they never touch a request's.
The host pool is block-major instead, so a host block, and a run of consecutive host blocks, is one
contiguous range of pinned memory: one asynchronous DMA copy each way. Swapping moves whole blocks between the pools
by block id; which blocks, and when, is the scheduler's business. How the copies are ordered against
the forward pass is `copy_stream.py`'s.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .block_manager import consecutive_runs
from .config import available_host_memory_bytes
from .copy_stream import CopyStream, to_device
from .models.spec import ModelSpec

GIB = 1024 ** 3


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return available_host_memory_bytes()


def num_blocks_for(gib: float, block_bytes: int) -> int:
    return max(int(gib * GIB) // block_bytes, 0)


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat cache slots of positions [start, end) of a sequence whose blocks are `block_table`:
    position p is token p % block_size of block block_table[p // block_size]."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def gather_blocks(device_kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` of a [2, L, num_blocks, bs, Hkv, D] pool as one [n, 2, L, bs, Hkv, D] tensor, a block's
    bytes contiguous as the host pool holds them: one pass, writing through a permuted view (a gather
    then a `contiguous()` moved the bytes twice)."""
    staged = torch.empty((len(ids), *device_kv.shape[:2], *device_kv.shape[3:]), dtype=device_kv.dtype,
                         device=device_kv.device)
    torch.index_select(device_kv, 2, ids, out=staged.movedim(0, 2))
    return staged


def paired_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of each run of pairs consecutive on both sides.

    On a CPU the two pools are the same DRAM: each run is copied in place, one strided copy. A gather
    into a staging buffer first (as on CUDA, where it makes one transfer of scattered blocks) only adds
    two fresh allocations per swap, whose pages fault in on every call once they pass the allocator's
    mmap threshold: 300 blocks of SmolLM2 took 330 ms that way, 16 ms in place (AMD EPYC, 2026-11-25)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


@dataclass
class StagedBlocks:
    """A swap-out's blocks gathered on the device, [n, 2, L, bs, Hkv, D], and the host blocks they go to."""

    blocks: torch.Tensor
    host_ids: list[int]


class KVCache:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int,
                 num_blocks: int, num_host_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.scratch_block = num_blocks  # past the blocks the block manager owns; see the module docstring
        shape = (2, spec.num_layers, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled: padded attention reads stale slots (masked out), and 0 * NaN would still be NaN.
        self.device_kv = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_host_blocks, 2, spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim)
        # Pinned on CUDA: only page-locked memory lets a device<->host copy run asynchronously.
        self.host_kv = torch.zeros(host_shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.copy_stream = CopyStream(device)
        slots = (num_blocks + 1) * block_size
        # Per-layer flat views [slots, num_kv_heads, head_dim], as the attention kernel expects.
        self.layer_views = [
            (self.device_kv[0, i].view(slots, spec.num_kv_heads, spec.head_dim),
             self.device_kv[1, i].view(slots, spec.num_kv_heads, spec.head_dim))
            for i in range(spec.num_layers)
        ]

    @staticmethod
    def block_bytes(spec: ModelSpec, dtype: torch.dtype, block_size: int) -> int:
        return spec.kv_bytes_per_token(dtype) * block_size

    def copy_blocks_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for each (device_id, host_id). Asynchronous on CUDA."""
        self.send_blocks_out(self.stage_blocks_out(pairs))

    def stage_blocks_out(self, pairs: list[tuple[int, int]]) -> StagedBlocks | None:
        """A swap-out's first half, queued before the next forward pass: on CUDA its blocks gathered into
        a staging buffer on the compute stream, so the pass may reuse them at once without waiting for
        the transfer to the host (`copy_stream.py`), which `send_blocks_out` queues; on a CPU the whole
        copy (None is returned)."""
        if not pairs:
            return None
        if self.device_kv.device.type == "cpu":
            for d, h, n in paired_runs(pairs):
                self.host_kv[h:h + n].copy_(self.device_kv[:, :, d:d + n].movedim(2, 0))
            return None
        device_ids = [d for d, _ in pairs]
        # A block on its way in (a swap-in still in flight, evicted again) is gathered once it has arrived.
        self.copy_stream.before_forward(device_ids)
        return StagedBlocks(gather_blocks(self.device_kv, to_device(device_ids, self.device_kv.device)),
                            [h for _, h in pairs])

    def send_blocks_out(self, staged: StagedBlocks | None, after: torch.cuda.Event | None = None) -> None:
        """A swap-out's second half on CUDA: the staging buffer to its host blocks on the copy stream, after
        `after` (`CopyStream.copying`)."""
        if staged is None:
            return
        with self.copy_stream.copying(after=after):
            # The copy stream reads it after this function returns: the allocator must not hand its
            # memory to the compute stream before that.
            staged.blocks.record_stream(torch.cuda.current_stream(staged.blocks.device))
            for i, first, n in consecutive_runs(staged.host_ids):
                self.host_kv[first:first + n].copy_(staged.blocks[i:i + n], non_blocking=True)

    def copy_blocks_in(self, pairs: list[tuple[int, int]], after: torch.cuda.Event | None = None) -> None:
        """Host block -> device block, for each (host_id, device_id). Asynchronous on CUDA, on the copy
        stream after `after` (`CopyStream.copying`)."""
        if not pairs:
            return
        if self.device_kv.device.type == "cpu":
            for h, d, n in paired_runs(pairs):
                self.device_kv[:, :, d:d + n].copy_(self.host_kv[h:h + n].movedim(0, 2))
            return
        device_ids = [d for _, d in pairs]
        with self.copy_stream.copying(device_ids, after=after):
            staged = torch.empty((len(pairs), *self.host_kv.shape[1:]), dtype=self.host_kv.dtype,
                                 device=self.device_kv.device)  # [n, 2, L, bs, Hkv, D]
            for i, first, n in consecutive_runs([h for h, _ in pairs]):
                staged[i:i + n].copy_(self.host_kv[first:first + n], non_blocking=True)
            dst = to_device(device_ids, self.device_kv.device)
            self.device_kv.index_copy_(2, dst, staged.movedim(0, 2))

    def wait_for_copies(self, device_blocks: Iterable[int]) -> None:
        """Call before queueing a forward pass that reads or writes `device_blocks`."""
        self.copy_stream.before_forward(device_blocks)
