"""Block accounting for the device and host KV pools (mechanism: it never chooses victims).

Every request that holds KV has a block table: the ids of the blocks holding its tokens, in order
(token `i` lives in block `table[i // block_size]`, offset `i % block_size`). Blocks carry reference
counts so that identical prefixes share blocks. Callers ask `can_*` before they act; acting without
room raises, since it means the caller's plan is wrong.

Prefix caching (device pool): a full block whose KV is computed gets a content hash chained from its
parent block's hash and its own token ids (`chain_hashes`), registered in `cached` (hash -> the
blocks holding that content). A request admitted later reuses the longest chain of registered blocks
(`match_prefix`) and computes only the rest. A block whose last reference goes keeps its hash and stays in the free queue as an
*evictable* cached block: reusable by content until `take` hands it out again, which evicts it. The free
queue is LRU: blocks are taken from its front, and a freed table is appended leaf first, so the
deepest blocks of the least recently used contexts are evicted first and shared parents last.
Content is computed twice when it was not in a prompt's matched prefix (a generation repeating an earlier
one, two requests computing the same prompt at once): each copy stays addressable, so that evicting
one never hides the content another still holds, and an unreferenced copy that a fresh one duplicates
goes to the front of the free queue.

Invariants, checked by `check_integrity()`:
  * free + referenced == total, in each pool; no block is both free and referenced;
  * a block's reference count equals the number of tables that list it;
  * `cached` lists exactly the blocks that carry a hash, each under its own.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    pass


def chain_hashes(token_ids: Sequence[int], block_size: int, known: list[int], salt: str | None = None) -> list[int]:
    """Hashes of every full block of `token_ids`, extending `known` (the hashes of its first blocks,
    computed before: a context only grows at its end, so they never change). Each hash covers the
    block's tokens and, through its parent's hash, everything before; the first block's covers `salt`
    too (a request's `cache_salt`: contexts of different salts share no block). Python's tuple hash is 64-bit:
    a collision between two different prefixes is astronomically unlikely (vLLM accepts the same)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else salt
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class CacheCounters:
    """Prefix-cache accounting, in blocks."""

    queried: int = 0  # full blocks looked up at admission
    hits: int = 0  # of those, found cached and reused
    evictions: int = 0  # cached blocks handed out again (their content lost)

    @property
    def misses(self) -> int:
        return self.queried - self.hits


class BlockPool:
    """Free queue and reference counts of one pool; with `caching`, content hashes of full blocks."""

    def __init__(self, num_blocks: int, caching: bool = False):
        self.num_blocks = num_blocks
        self.caching = caching
        self.ref_counts = [0] * num_blocks
        # Unreferenced blocks in eviction order (front first). An OrderedDict so that a cache hit can
        # take a block out of the middle in O(1).
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}  # content hash -> the blocks holding it, oldest first
        self.counters = CacheCounters()

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        """Blocks addressable by content, referenced or evictable."""
        return sum(map(len, self.cached.values()))

    def take(self, n: int) -> list[int]:
        """`n` blocks for new content: evicts the least recently used cached ones it hands out."""
        if n > len(self.free_ids):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self.free_ids)} free")
        ids = []
        for _ in range(n):
            b, _ = self.free_ids.popitem(last=False)
            if self.block_hash[b] is not None:
                self._uncache(b)
                self.counters.evictions += 1
            self.ref_counts[b] = 1
            ids.append(b)
        return ids

    def share(self, ids: Sequence[int]) -> None:
        """One more reference to each of `ids` (cached blocks a new table reuses)."""
        for b in ids:
            if self.ref_counts[b] == 0:
                del self.free_ids[b]
            self.ref_counts[b] += 1

    def release(self, ids: Sequence[int], keep_cached: bool = True) -> None:
        """Drop one reference to each of `ids`, the table's first block first. Blocks left unreferenced
        join the free queue leaf first; without `keep_cached` they lose their hash and go to its front,
        to be reused before any cached block."""
        for b in reversed(ids):
            assert self.ref_counts[b] > 0, f"block {b} released more often than referenced"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids[b] = None
                if not keep_cached and self.block_hash[b] is not None:
                    self._uncache(b)
                    self.free_ids.move_to_end(b, last=False)

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full, computed block addressable by content. Unreferenced blocks holding the same
        content are redundant now: they lose their hash and are the first to be reused."""
        if not self.caching or self.block_hash[block_id] is not None:
            return
        for b in [b for b in self.cached.get(block_hash, ()) if self.ref_counts[b] == 0]:
            self._uncache(b)
            self.free_ids.move_to_end(b, last=False)
        self.cached.setdefault(block_hash, {})[block_id] = None
        self.block_hash[block_id] = block_hash

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (no side effects); of copies of one block,
        a referenced one, which sharing takes no block from the free queue for."""
        ids = []
        for h in hashes:
            holders = self.cached.get(h)
            if not holders:
                break
            ids.append(next((b for b in holders if self.ref_counts[b]), next(iter(holders))))
        return ids

    def _uncache(self, b: int) -> None:
        h = self.block_hash[b]
        del self.cached[h][b]
        if not self.cached[h]:
            del self.cached[h]
        self.block_hash[b] = None

    def check(self, tables: dict[str, list[int]], name: str) -> None:
        refs = Counter(b for table in tables.values() for b in table)
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == refs.get(b, 0), (
                f"{name}: block {b} has ref count {self.ref_counts[b]} but {refs.get(b, 0)} tables list it")
            assert (b in self.free_ids) == (self.ref_counts[b] == 0), f"{name}: block {b} free/referenced mismatch"
        assert all(holders and all(self.block_hash[b] == h for b in holders)
                   for h, holders in self.cached.items()), f"{name}: cache map out of sync"
        assert sum(h is not None for h in self.block_hash) == self.num_cached, f"{name}: stray block hash"


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into `ids`, first id, length) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, block, 1))
    return runs


class HostBlockPool:
    """The host pool's free blocks, handed out as consecutive ids where they can be: on a GPU each run
    of consecutive host blocks is one transfer call, whose host-side cost (tens of microseconds) is paid
    per run, not per byte. The free blocks are kept as runs (coalesced when freed); `take` fits a request
    into the smallest run that holds it, else spans the longest runs. Host blocks hold no shared or
    cached content: each is taken once, or free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_free = num_blocks
        self._taken = bytearray(num_blocks)
        self._runs: dict[int, int] = {}  # first block -> length, of each free run
        self._run_before: dict[int, int] = {}  # the block after a free run -> its first block
        if num_blocks:
            self._add(0, num_blocks)

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} host blocks, {self.num_free} free")
        fits = [(length, first) for first, length in self._runs.items() if length >= n]
        chosen = [min(fits)[::-1]] if fits else sorted(self._runs.items(), key=lambda run: -run[1])
        ids: list[int] = []
        for first, length in chosen:
            if len(ids) == n:
                break
            used = min(length, n - len(ids))
            self._remove(first)
            if used < length:
                self._add(first + used, length - used)
            ids += range(first, first + used)
        ids.sort()
        for b in ids:
            self._taken[b] = 1
        self.num_free -= n
        return ids

    def release(self, ids: Sequence[int]) -> None:
        for b in ids:
            assert self._taken[b], f"host block {b} released but not taken"
            self._taken[b] = 0
        for _, first, length in consecutive_runs(sorted(ids)):
            before = self._run_before.get(first)  # a free run that ends where this one begins
            if before is not None:
                length += self._runs[before]
                self._remove(before)
                first = before
            after = self._runs.get(first + length)
            if after is not None:
                self._remove(first + length)
                length += after
            self._add(first, length)
        self.num_free += len(ids)

    def _add(self, first: int, length: int) -> None:
        self._runs[first] = length
        self._run_before[first + length] = first

    def _remove(self, first: int) -> None:
        del self._run_before[first + self._runs.pop(first)]

    def check(self, tables: dict[str, list[int]], name: str) -> None:
        refs = Counter(b for table in tables.values() for b in table)
        free = bytearray(self.num_blocks)
        for first, length in self._runs.items():
            free[first:first + length] = b"\x01" * length
            assert first + length not in self._runs, f"{name}: free runs not coalesced at {first + length}"
        for b in range(self.num_blocks):
            assert refs.get(b, 0) == self._taken[b] != free[b], (
                f"{name}: block {b}: taken {self._taken[b]}, in a free run {free[b]}, {refs.get(b, 0)} tables list it")
        assert self.num_free == sum(self._runs.values()), f"{name}: free count out of sync"


class BlockManager:
    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.device = BlockPool(num_blocks, caching=enable_caching)
        self.host = HostBlockPool(num_host_blocks)
        self.tables: dict[str, list[int]] = {}  # request id -> device block ids
        self.host_tables: dict[str, list[int]] = {}  # request id -> host block ids
        self._registered: dict[str, int] = {}  # request id -> leading table blocks already registered
        # Host blocks this step's swap-ins read: a step's swap-outs are copied before its swap-ins
        # (SchedulerOutput), so a swap-out handed one of them would overwrite it before it was read.
        # They are freed by `copies_done()`, once the step ran.
        self._host_being_read: list[int] = []

    @property
    def enable_caching(self) -> bool:
        return self.device.caching

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
    def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = (), reserve: int = 0) -> bool:
        """Room to grow the request to `num_tokens`, starting an empty table with the `cached` blocks
        (`match_prefix`), and still leave `reserve` blocks free; reusing an evictable cached block
        takes it out of the free queue."""
        new = self.num_new_blocks(request_id, num_tokens) - len(cached)
        return new + sum(self.device.ref_counts[b] == 0 for b in cached) + reserve <= self.device.num_free

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; returns the whole table. `cached`
        (only for a request without blocks) are reused blocks that start the table."""
        table = self.tables.setdefault(request_id, [])
        if cached:
            assert not table, "cached blocks can only start a table"
            self.device.share(cached)
            table += cached
            self._registered[request_id] = len(cached)
        table += self.device.take(self.num_new_blocks(request_id, num_tokens))
        return table

    def free(self, request_id: str, keep_cached: bool = True) -> None:
        """Release everything the request holds, in both pools. Safe to call twice. With `keep_cached`
        its registered blocks stay reusable by content until evicted; without, they are wiped."""
        self.device.release(self.tables.pop(request_id, []), keep_cached)
        self.host.release(self.host_tables.pop(request_id, []))
        self._registered.pop(request_id, None)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    # -- prefix caching ------------------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Cached device blocks holding the longest prefix of a context whose full blocks hash to
        `hashes`. Nothing is reserved: pass the result to `can_allocate` / `allocate` in the same step."""
        return self.device.match(hashes) if self.enable_caching else []

    def record_lookup(self, num_queried: int, num_hits: int) -> None:
        self.device.counters.queried += num_queried
        self.device.counters.hits += num_hits

    def num_registered(self, request_id: str) -> int:
        """Leading blocks of the request that are addressable by content (`register_blocks`)."""
        return self._registered.get(request_id, 0)

    def register_blocks(self, request_id: str, hashes: Sequence[int]) -> None:
        """Make the request's computed full blocks (`hashes` = their content hashes, in order)
        addressable by content. Only while its whole context is on the device."""
        if not self.enable_caching or request_id in self.host_tables:
            return
        table = self.tables.get(request_id, [])
        done = self._registered.get(request_id, 0)
        for i in range(done, min(len(hashes), len(table))):
            self.device.register(table[i], hashes[i])
        self._registered[request_id] = max(done, min(len(hashes), len(table)))

    # -- host pool (swap) --------------------------------------------------------------------------
    # A request's logical blocks are split: the first len(host_tables[r]) live on the host, the rest
    # on the device. Swap-out moves device blocks from the front of the device table to the end of
    # the host table; swap-in moves host blocks from the end of the host table to the front of the
    # device table. Either way the two tables stay one contiguous sequence. A swapped-out device block
    # keeps its hash: until evicted, other requests with the same prefix still reuse it.
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
        self._registered[request_id] = 0  # its table starts elsewhere now; re-registered once back
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
        self._host_being_read += moved
        if not self.host_tables[request_id]:
            del self.host_tables[request_id]
        return list(zip(moved, device_ids))

    def copies_done(self) -> None:
        """The step's block copies ran: the host blocks its swap-ins read are free again."""
        self.host.release(self._host_being_read)
        self._host_being_read = []

    # -- invariants ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.device.check(self.tables, "device")
        self.host.check({**self.host_tables, "(being read)": self._host_being_read}, "host")

    def num_used_blocks(self) -> int:
        return self.device.num_blocks - self.device.num_free
