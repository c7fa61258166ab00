"""Block accounting for the device and host KV pools (mechanism: it never chooses victims).

Every request that holds KV has a block table: the ids of the blocks holding its tokens, in order
(token `i` lives in block `table[i // block_size]`, offset `i % block_size`). Blocks carry reference
counts so that identical prefixes can share blocks. Callers ask `can_*` before they act; acting
without room raises, since it means the caller's plan is wrong.

Invariants, checked by `check_integrity()`:
  * free + referenced == total, in each pool; no block is both free and referenced;
  * a block's reference count equals the number of tables that list it.
"""
from __future__ import annotations

from collections import Counter, deque


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    """Free list and reference counts of one pool (device or host)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def take(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def release(self, ids: list[int]) -> None:
        for b in ids:
            assert self.ref_counts[b] > 0, f"block {b} released more often than referenced"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)

    def check(self, tables: dict[str, list[int]], name: str) -> None:
        refs = Counter(b for table in tables.values() for b in table)
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), f"{name}: a block is twice in the free list"
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == refs.get(b, 0), (
                f"{name}: block {b} has ref count {self.ref_counts[b]} but {refs.get(b, 0)} tables list it")
            assert (b in free) == (self.ref_counts[b] == 0), f"{name}: block {b} free/referenced mismatch"


class BlockManager:
    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int):
        self.block_size = block_size
        self.device = BlockPool(num_blocks)
        self.host = BlockPool(num_host_blocks)
        self.tables: dict[str, list[int]] = {}  # request id -> device block ids
        self.host_tables: dict[str, list[int]] = {}  # request id -> host block ids

    # -- sizes ---------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens in total."""
        return max(self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())), 0)

    # -- device pool -----------------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self.device.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; returns the whole table."""
        table = self.tables.setdefault(request_id, [])
        table += self.device.take(self.num_new_blocks(request_id, num_tokens))
        return table

    def free(self, request_id: str) -> None:
        """Release everything the request holds, in both pools. Safe to call twice."""
        self.device.release(self.tables.pop(request_id, []))
        self.host.release(self.host_tables.pop(request_id, []))

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    # -- host pool (swap) --------------------------------------------------------------------------
    # A request's logical blocks are split: the first len(host_tables[r]) live on the host, the rest
    # on the device. Swap-out moves device blocks from the front of the device table to the end of
    # the host table; swap-in moves host blocks from the end of the host table to the front of the
    # device table. Either way the two tables stay one contiguous sequence.
    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    def num_host_blocks_of(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, ()))

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= self.host.num_free

    def swap_out(self, request_id: str, num_blocks: int) -> list[tuple[int, int]]:
        """Move the request's first `num_blocks` device blocks to the host; returns (device, host) pairs
        for the copy. The device blocks are free again once the caller has copied them."""
        table = self.tables.get(request_id, [])
        num_blocks = min(num_blocks, len(table))
        host_ids = self.host.take(num_blocks)
        moved, self.tables[request_id] = table[:num_blocks], table[num_blocks:]
        self.host_tables.setdefault(request_id, []).extend(host_ids)
        self.device.release(moved)
        return list(zip(moved, host_ids))

    def can_swap_in(self, num_blocks: int) -> bool:
        return num_blocks <= self.device.num_free

    def swap_in(self, request_id: str, num_blocks: int) -> list[tuple[int, int]]:
        """Move the request's last `num_blocks` host blocks back to the device; (host, device) pairs."""
        host_table = self.host_tables.get(request_id, [])
        num_blocks = min(num_blocks, len(host_table))
        device_ids = self.device.take(num_blocks)
        split = len(host_table) - num_blocks
        moved, self.host_tables[request_id] = host_table[split:], host_table[:split]
        self.tables[request_id] = device_ids + self.tables.get(request_id, [])
        self.host.release(moved)
        if not self.host_tables[request_id]:
            del self.host_tables[request_id]
        return list(zip(moved, device_ids))

    # -- invariants ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.device.check(self.tables, "device")
        self.host.check(self.host_tables, "host")

    def num_used_blocks(self) -> int:
        return self.device.num_blocks - self.device.num_free
