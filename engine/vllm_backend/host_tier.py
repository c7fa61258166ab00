"""The host tier of the vLLM backend: `HostTierConnector`, a vLLM V1 KV connector that swaps paused
sessions' KV blocks between vLLM's device pool and a host pool.

vLLM V1 has no swap, and its offloading connectors are write-through caches keyed by block hash that
never see a paused session. This one is driven by `InterceptScheduler` (scheduler.py), which owns the
decisions: vLLM loads it by name (backend.py's `host_tier_config` is the `kv_transfer_config`) once in
the scheduler's process and once in each worker, and the scheduler calls the scheduler-side instance (`vllm.v1.core.sched.Scheduler.connector`)
directly.

Scheduler side (bookkeeping only, no tensors): a free list of host blocks and, per session, the host
blocks holding its first tokens. `swap_out` records device->host block pairs for this step; the
scheduler frees the device blocks at once. That is safe because the copy runs first thing in this step's
execution (`handle_preemptions`, before vLLM zeroes newly allocated blocks or runs the forward), and
workers run steps in order. When the session is admitted again, vLLM asks `get_num_new_matched_tokens`:
the host holds its context past the prefix-cache hit, loaded synchronously (`start_load_kv`, before the
forward) into the blocks vLLM allocated. Host blocks of a load are reusable only from the next step on
(this step's swap-outs are copied before its loads).

Worker side: `register_kv_caches` allocates the host pool, one tensor per layer shaped like the layer's
device cache with `host_blocks` blocks (pinned when CUDA is there), and copies by block index with
plain torch indexing: the same code on CPU and GPU.

The host pool's size is `kv_connector_extra_config["host_bytes"]`; both sides turn it into blocks the same
way, from the KV cache config (`bytes_per_block`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("infercept.host_tier")

# vLLM's connector hooks this class overrides, and the block-table call it makes: tests/test_vllm_scheduler.py
# checks their signatures, and that vLLM's model runner still calls `handle_preemptions` before it zeroes
# new blocks and `start_load_kv` after (the order the swap-out relies on).
OVERRIDDEN = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
              "register_kv_caches", "handle_preemptions", "start_load_kv")
KV_CACHE_MANAGER_CALLED = ("get_block_ids",)

def bytes_per_block(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes one block of every layer takes: what a host block holds."""
    return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
               for group in kv_cache_config.kv_cache_groups)


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies, as (device block, host block) pairs in the order they must run."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _HostCopy:
    blocks: list[int]  # host block i holds the session's token block i
    num_tokens: int  # tokens whose KV the host blocks hold (from the first)


class HostTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        per_block = bytes_per_block(kv_cache_config)
        self.num_host_blocks = int(extra.get("host_bytes", 0)) // per_block if per_block else 0
        # scheduler side
        self.free_host: list[int] = list(range(self.num_host_blocks - 1, -1, -1))  # pop() takes the lowest
        self.copies: dict[str, _HostCopy] = {}
        self._out: list[tuple[int, int]] = []
        self._in: list[tuple[int, int]] = []
        self._hits: dict[str, int] = {}  # asked about this step -> the prefix-cache hit vLLM reported
        self._loading: list[str] = []  # admitted with a host load this step
        self._released: list[int] = []  # host blocks of this step's loads: free from the next step
        self.counters = {"swapped_out_tokens": 0, "swapped_in_tokens": 0}
        # worker side
        self.host: dict[str, torch.Tensor] = {}
        self.device: dict[str, torch.Tensor] = {}
        self.block_dim: dict[str, int] = {}

    # This connector hands nothing to another instance: a dropped copy is a recompute, never a loss.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- scheduler side: called by InterceptScheduler ---------------------------------------------------
    @property
    def free_host_tokens(self) -> int:
        return len(self.free_host) * self.block_size

    def host_tokens(self, request_id: str) -> int:
        copy = self.copies.get(request_id)
        return copy.num_tokens if copy else 0

    def swap_out(self, request_id: str, device_blocks: list[int], num_tokens: int) -> bool:
        """Copy the session's KV blocks for tokens [host tokens, num_tokens) to the host this step (its
        first blocks may be there already: a swap continued over several steps). False if the host
        pool has no room; nothing is recorded then."""
        copy = self.copies.setdefault(request_id, _HostCopy([], 0))
        first, last = len(copy.blocks), -(-num_tokens // self.block_size)
        if last - first > len(self.free_host):
            if not copy.blocks:
                del self.copies[request_id]
            return False
        for index in range(first, last):
            host = self.free_host.pop()
            copy.blocks.append(host)
            self._out.append((device_blocks[index], host))
        self.counters["swapped_out_tokens"] += num_tokens - copy.num_tokens
        copy.num_tokens = num_tokens
        return True

    def drop(self, request_id: str) -> None:
        """Forget the session's host copy (it ended, or its device KV is used instead)."""
        copy = self.copies.pop(request_id, None)
        if copy is not None:
            self._released.extend(copy.blocks)

    # -- scheduler side: vLLM's hooks -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the host holds past the prefix-cache hit (`num_computed_tokens`, block-aligned), loaded
        before this step's forward."""
        copy = self.copies.get(request.request_id)
        if copy is None or request.num_computed_tokens:  # only on admission with nothing computed
            return 0, False
        # The last token must be computed (vLLM samples from it): a context the host holds whole is
        # loaded but its last token.
        external = max(min(copy.num_tokens, request.num_tokens - 1) - num_computed_tokens, 0)
        self._hits[request.request_id] = num_computed_tokens
        return external, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        copy = self.copies[request.request_id]
        device = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        hit = self._hits.pop(request.request_id)  # block-aligned whenever vLLM takes an external load
        end = hit + num_external_tokens
        for index in range(hit // self.block_size, -(-end // self.block_size)):
            self._in.append((device[index], copy.blocks[index]))
        self.counters["swapped_in_tokens"] += num_external_tokens
        self._loading.append(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> HostTierMetadata:
        meta = HostTierMetadata(swap_out=self._out, swap_in=self._in)
        self._out, self._in = [], []
        self.free_host.extend(self._released)  # loads of an earlier step: done before this step's copies
        self._released = []
        for request_id in self._loading:  # loaded this step: the device holds it now
            self.drop(request_id)
        self._loading.clear()
        self._hits.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.drop(request.request_id)
        return False, None

    # -- worker side ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        pin = torch.cuda.is_available()
        for name, cache in kv_caches.items():
            dims = [d for d, n in enumerate(cache.shape) if n == num_blocks]
            if not dims:
                raise RuntimeError(f"HostTierConnector: no dimension of {num_blocks} blocks in layer {name}'s KV "
                                   f"cache {tuple(cache.shape)}")
            dim = dims[0]
            shape = list(cache.shape)
            shape[dim] = self.num_host_blocks
            self.device[name], self.block_dim[name] = cache, dim
            self.host[name] = torch.zeros(shape, dtype=cache.dtype, device="cpu", pin_memory=pin)
        logger.info("host tier: %d blocks over %d layers", self.num_host_blocks, len(kv_caches))

    def handle_preemptions(self, kv_connector_metadata: HostTierMetadata) -> None:
        """Swap-outs, before anything this step writes into the freed device blocks."""
        self._copy(kv_connector_metadata.swap_out, to_host=True)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Swap-ins, before the forward that reads them (synchronous)."""
        self._copy(self._get_connector_metadata().swap_in, to_host=False)

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        for name, cache in self.device.items():
            dim, host = self.block_dim[name], self.host[name]
            device_index = torch.tensor([d for d, _ in pairs], device=cache.device)
            host_index = torch.tensor([h for _, h in pairs])
            if to_host:
                host.index_copy_(dim, host_index, cache.index_select(dim, device_index).to("cpu"))
            else:
                cache.index_copy_(dim, device_index, host.index_select(dim, host_index).to(cache.device))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
