"""The KV pools: tensors only, no decisions (mechanism).

    device pool  kv[2, num_layers, num_blocks,      block_size, num_kv_heads, head_dim]
    host pool    kv[2, num_layers, num_host_blocks, block_size, num_kv_heads, head_dim]

Block `b` of a pool is `kv[:, :, b]`: every layer's K and V for `block_size` consecutive tokens of one
request. Swapping moves whole blocks between the pools by block id; which blocks, and when, is the
scheduler's business.
"""
from __future__ import annotations

import torch

from .models.spec import ModelSpec

GIB = 1024 ** 3


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_blocks_for(gib: float, block_bytes: int) -> int:
    return max(int(gib * GIB) // block_bytes, 0)


class KVCache:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int,
                 num_blocks: int, num_host_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        shape = (2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled: padded attention reads stale slots (masked out), and 0 * NaN would still be NaN.
        self.device_kv = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (2, spec.num_layers, num_host_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Pinned host memory lets device<->host copies run asynchronously on CUDA.
        pin = device.type == "cuda"
        self.host_kv = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        slots = num_blocks * block_size
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
        """Device block -> host block, for each (device_id, host_id)."""
        if pairs:
            src = torch.tensor([d for d, _ in pairs], device=self.device_kv.device)
            dst = torch.tensor([h for _, h in pairs])
            # Blocking: the gathered blocks are scattered into the host pool on the CPU right away.
            self.host_kv[:, :, dst] = self.device_kv[:, :, src].to("cpu")

    def copy_blocks_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for each (host_id, device_id)."""
        if pairs:
            src = torch.tensor([h for h, _ in pairs])
            dst = torch.tensor([d for _, d in pairs], device=self.device_kv.device)
            self.device_kv[:, :, dst] = self.host_kv[:, :, src].to(self.device_kv.device, non_blocking=True)
