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
execution (`handle_preemptions`, before the loads and the forward), and workers run steps in order.
vLLM's newer model runner (vllm/v1/worker/gpu/) zeroes new blocks and applies copy-on-write copies
before `handle_preemptions`: neither happens on a KV cache this connector accepts (`unsupported_kv_cache`).
When the session is admitted again, vLLM asks `get_num_new_matched_tokens`: the host holds its context
past the prefix-cache hit, loaded synchronously (`start_load_kv`: vLLM runs a synchronous load before
the forward) into the blocks vLLM allocated. Host blocks of a load are reusable only from the next step
on (this step's swap-outs are copied before its loads). Proactive swap-in loads the same way, in a step
vLLM has not scheduled the session in: the scheduler allocates its blocks once vLLM has scheduled the
step and adds the copy to the step's metadata (`swap_in_now`).

Worker side: `register_kv_caches` takes vLLM's per-layer views, `[B, H, N, C]` with the blocks in dim 0
(`vllm.v1.worker.utils.allocate_kv_cache`; B is a multiple of vLLM's blocks when the attention backend
splits them into kernel blocks, viewed back with `group_kernel_blocks`), and allocates the host pool, one
tensor per layer shaped like the layer's view with `host_blocks` blocks (pinned on CUDA). A step's copies
gather or scatter the device blocks by index on the device and copy the host side by runs of consecutive
host blocks (`host_runs`): the same code on CPU and GPU. On CUDA they run on a stream of their own,
asynchronously into and out of the pinned pool, ordered against vLLM's compute stream by events: each
step's copies start after the work queued before them (the forward that wrote a swapped-out block, the
zeroing of a block a load fills) and the compute stream waits for them before anything queued after (the
forward reads loaded blocks and may write freed ones). On a CPU they are synchronous.

The host pool's size is `kv_connector_extra_config["host_bytes"]`; both sides turn it into blocks the same
way, from the KV cache config (`bytes_per_block`).

Models whose KV cache is not one group of full attention (hybrid and sliding-window models under vLLM's
hybrid KV cache manager, MLA, Mamba) are refused at start (`unsupported_kv_cache`), here and in
`InterceptScheduler`: `--policy prefix-cache` (stock vLLM) serves them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs, group_kernel_blocks, iter_layer_specs

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
    """Bytes one block of every layer takes: what a host block holds. Each layer's page
    (`KVCacheSpec.page_size_bytes`); a `UniformTypeKVCacheSpecs` group's page is already the sum over its
    layers."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += spec.page_size_bytes * (1 if isinstance(spec, UniformTypeKVCacheSpecs) else len(group.layer_names))
    return total


def unsupported_kv_cache(kv_cache_config: "KVCacheConfig") -> str | None:
    """Why the InferCept policies cannot run on this KV cache, or None. They keep, copy and free a
    session's KV as one list of blocks covering its tokens from the first: one KV cache group, every layer
    plain full attention (`FullAttentionSpec`; a sliding-window layer counts when vLLM allocates it as full
    attention, as it does with the hybrid KV cache manager off, which our connector turns off), in one
    precision (vLLM zeroes new blocks of a mixed-precision cache, and its newer model runner does so before
    the swap-outs of the step have read them)."""
    groups = kv_cache_config.kv_cache_groups
    specs = [spec for group in groups for spec in iter_layer_specs(group.kv_cache_spec)]
    if not groups:
        return "no KV cache"
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(spec).__name__ for spec in specs}))
        return (f"{len(groups)} KV cache groups ({kinds}: a hybrid or sliding-window model under vLLM's hybrid KV "
                "cache manager)")
    others = sorted({type(spec).__name__ for spec in specs if type(spec) is not FullAttentionSpec})
    if others:
        return f"a KV cache of {', '.join(others)} (MLA, Mamba, ...), not plain full attention"
    if kv_cache_config.needs_kv_cache_zeroing:
        return "a KV cache of mixed precisions"
    return None


def refusal(kv_cache_config: "KVCacheConfig", who: str) -> str | None:
    """The start-up error for a KV cache the InferCept policies cannot serve (None: they can)."""
    why = unsupported_kv_cache(kv_cache_config)
    if why is None:
        return None
    return (f"{who} cannot serve this model on vLLM: it has {why}, and the policy needs one KV cache group of "
            "full attention. Serve it with --policy prefix-cache (stock vLLM, its own scheduler and prefix "
            "caching).")


def host_runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive host blocks in a step's list of pairs: (position of the run's first pair, its
    first host block, its length). Each run is one contiguous slice of every layer's host pool, so one
    copy (one DMA on CUDA) instead of one per block."""
    runs: list[list[int]] = []
    for at, block in enumerate(host_blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1][2] += 1
        else:
            runs.append([at, block, 1])
    return [(at, first, n) for at, first, n in runs]


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on `device`; on CUDA copied from pinned memory without a host sync."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long, device=device)
    return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


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
        if (error := refusal(kv_cache_config, "the host tier (HostTierConnector)")) is not None:
            raise ValueError(error)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("the host tier (HostTierConnector) maps a session's tokens to vLLM's blocks one block "
                             "of block_size tokens after the other: decode context parallelism (which shards each "
                             "block's tokens over ranks) is not supported; run without it, or --host-kv-gb 0")
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
        self.device: dict[str, torch.Tensor] = {}  # each layer's KV cache, vLLM's blocks in dim 0
        self._stream = None  # CUDA: the copies' own stream

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

    def swap_in_now(self, meta: "HostTierMetadata", request_id: str, device_blocks: list[int], start: int) -> None:
        """Proactive swap-in of a paused session that vLLM has not scheduled: add the copy of its host KV
        from token `start` (block-aligned: before it, the prefix cache holds it) into `device_blocks`
        to this step's metadata, after vLLM built it (`meta`), and drop the host copy: its blocks are
        reusable from the next step's swap-outs on, which run after this step's loads."""
        copy = self.copies[request_id]
        meta.swap_in += self._load_pairs(copy, device_blocks, start, copy.num_tokens)
        self.counters["swapped_in_tokens"] += copy.num_tokens - start
        self.drop(request_id)

    def _load_pairs(self, copy: _HostCopy, device_blocks: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """(device block, host block) pairs that load tokens [start, end) of a host copy."""
        return [(device_blocks[i], copy.blocks[i]) for i in range(start // self.block_size, -(-end // self.block_size))]

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
        self._in += self._load_pairs(copy, device, hit, hit + num_external_tokens)
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
        """vLLM's per-layer KV caches: views `[B, H, N, C]` with the blocks in dim 0 (B = num_blocks, or a
        multiple when the attention backend splits vLLM's blocks into kernel blocks; each block's kernel
        blocks are consecutive: `group_kernel_blocks` views them as one). A layer that reuses another
        layer's cache (the same view) is copied once."""
        num_blocks = self._kv_cache_config.num_blocks
        seen: set[tuple] = set()
        for name, cache in kv_caches.items():
            if cache.dim() < 2 or cache.shape[0] % num_blocks:
                raise RuntimeError(f"HostTierConnector: layer {name}'s KV cache {tuple(cache.shape)} does not have "
                                   f"vLLM's {num_blocks} blocks (or kernel blocks of them) in dim 0, the layout "
                                   "vLLM's model runners allocate (allocate_kv_cache)")
            view = group_kernel_blocks(cache, num_blocks)
            key = (view.data_ptr(), tuple(view.shape), view.stride(), view.dtype)
            if key in seen:
                continue
            seen.add(key)
            self.device[name] = view
            self.host[name] = torch.zeros((self.num_host_blocks, *view.shape[1:]), dtype=view.dtype, device="cpu",
                                          pin_memory=view.device.type == "cuda")
            if view.device.type == "cuda" and self._stream is None:
                self._stream = torch.cuda.Stream(view.device)
        logger.info("host tier: %d blocks over %d layers", self.num_host_blocks, len(self.device))

    def handle_preemptions(self, kv_connector_metadata: HostTierMetadata) -> None:
        """Swap-outs, before anything this step writes into the freed device blocks."""
        self._copy(kv_connector_metadata.swap_out, to_host=True)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Swap-ins, before the forward that reads them (vLLM calls this before the forward in a step
        with a synchronous load, as every step with a swap-in is)."""
        self._copy(self._get_connector_metadata().swap_in, to_host=False)

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """One step's copies, in order. On CUDA on the connector's stream: after everything queued on the
        compute stream so far, and before anything queued on it afterwards."""
        if not pairs:
            return
        if self._stream is None:
            self._copy_blocks(pairs, to_host, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):  # index and staging tensors belong to this stream
            self._copy_blocks(pairs, to_host, non_blocking=True)
        compute.wait_stream(self._stream)

    def _copy_blocks(self, pairs: list[tuple[int, int]], to_host: bool, non_blocking: bool) -> None:
        """Layer by layer: device blocks gathered (or scattered) by index on the device, host blocks
        copied by runs of consecutive blocks. `non_blocking`: CUDA, into or out of the pinned pool."""
        runs = host_runs([h for _, h in pairs])
        device_ids = [d for d, _ in pairs]
        index: torch.Tensor | None = None
        for name, cache in self.device.items():
            host = self.host[name]
            if index is None:
                index = _index(device_ids, cache.device)
            if to_host:
                blocks = cache.index_select(0, index)
                for at, first, n in runs:
                    host[first:first + n].copy_(blocks[at:at + n], non_blocking=non_blocking)
            else:
                blocks = torch.empty((len(pairs), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
                for at, first, n in runs:
                    blocks[at:at + n].copy_(host[first:first + n], non_blocking=non_blocking)
                cache.index_copy_(0, index, blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
