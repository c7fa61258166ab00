"""Prefix caching: content-addressed blocks shared across requests, LRU eviction, lazy discard.

1. A hypothesis state machine drives BlockManager through admit (with prefix reuse) / compute /
   grow / swap-out / swap-in / free (cached or wiped) sequences. It keeps its own record of what each
   device block holds and checks, after every step, `check_integrity()` and that every block the cache
   can hand out holds exactly the content its hash names, however blocks were evicted and reused.
2. The real model (fp32, greedy): requests with a common prefix share blocks and generate exactly what
   transformers generates, and what the engine generates with caching off; a paused session whose
   blocks were partly evicted recomputes only the evicted part and still continues token for token.
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import hf_greedy
from infercept.engine import Engine, SamplingParams
from infercept.engine.block_manager import BlockManager, chain_hashes
from infercept.engine.kv_cache import GIB, KVCache
from infercept.engine.request import InterceptParams

REQUEST_IDS = [f"r{i}" for i in range(5)]
# A small alphabet so that random contexts often share prefixes.
CONTEXTS = st.lists(st.integers(0, 2), min_size=1, max_size=28)


# -- 1. block accounting with sharing and eviction -------------------------------------------------------

class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[str, list[int]] = {}  # active request -> its context
        self.computed: dict[str, int] = {}  # active request -> tokens with KV
        self.content: dict[int, object] = {}  # device block -> hash of what was written there
        self.host_content: dict[int, object] = {}

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(2, 16), num_host_blocks=st.integers(0, 8), block_size=st.sampled_from([1, 2, 4]))
    def create(self, num_blocks, num_host_blocks, block_size):
        self.bm = BlockManager(num_blocks, num_host_blocks, block_size)

    def _hashes(self, rid: str) -> list[int]:
        return chain_hashes(self.tokens[rid], self.bm.block_size, [])

    def _on_host(self, rid: str) -> bool:
        return self.bm.num_host_blocks_of(rid) > 0

    @precondition(lambda self: self.bm is not None)
    @rule(rid=st.sampled_from(REQUEST_IDS), tokens=CONTEXTS)
    def admit(self, rid, tokens):
        bm = self.bm
        if rid in self.tokens:
            return
        hashes = chain_hashes(tokens, bm.block_size, [])
        hit = bm.match_prefix(hashes[:(len(tokens) - 1) // bm.block_size])
        for i, b in enumerate(hit):  # the cache hands out exactly the content asked for
            assert self.content.get(b) == hashes[i]
        free_before, evictions_before = bm.num_free_blocks, bm.device.counters.evictions
        if not bm.can_allocate(rid, len(tokens), hit):
            return
        table = bm.allocate(rid, len(tokens), hit)
        assert table[:len(hit)] == hit
        assert bm.num_free_blocks <= free_before
        assert bm.device.counters.evictions >= evictions_before
        self.tokens[rid] = list(tokens)
        self.computed[rid] = len(hit) * bm.block_size

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        """A forward pass writes the uncomputed tokens, then the full blocks are registered."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        bm = self.bm
        if self._on_host(rid):
            return
        table, bs, tokens = bm.block_table(rid), bm.block_size, self.tokens[rid]
        hashes = self._hashes(rid)
        for i in range(self.computed[rid] // bs, bm.blocks_for(len(tokens))):
            b = table[i]
            # Writing into a block someone else reads, or that the cache still names, would corrupt it.
            assert bm.device.ref_counts[b] == 1 and bm.device.block_hash[b] is None, f"write into shared block {b}"
            self.content[b] = hashes[i] if i < len(hashes) else ("partial", rid, len(tokens))
        self.computed[rid] = len(tokens)
        bm.register_blocks(rid, hashes)
        for i, h in enumerate(hashes):
            if bm.device.block_hash[table[i]] is not None:
                assert bm.device.block_hash[table[i]] == h

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self._on_host(rid) or self.computed[rid] < len(self.tokens[rid]):
            return
        n = len(self.tokens[rid]) + len(more)
        if self.bm.can_allocate(rid, n):
            self.bm.allocate(rid, n)
            self.tokens[rid] += more

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data(), k=st.integers(1, 4))
    def swap_out(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        bm = self.bm
        if self.computed[rid] < len(self.tokens[rid]) or not bm.can_swap_out(k):
            return
        for device_block, host_block in bm.swap_out(rid, k):
            self.host_content[host_block] = self.content[device_block]

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data(), k=st.integers(1, 4))
    def swap_in(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        bm = self.bm
        k = min(k, bm.num_host_blocks_of(rid))
        if not k or not bm.can_swap_in(k):
            return
        for host_block, device_block in bm.swap_in(rid, k):
            self.content[device_block] = self.host_content.pop(host_block)
        bm.copies_done()  # the step boundary: the host blocks read are free again

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data(), keep_cached=st.booleans())
    def free(self, data, keep_cached):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        held = set(self.bm.block_table(rid))
        self.bm.free(rid, keep_cached=keep_cached)
        del self.tokens[rid], self.computed[rid]
        if not keep_cached:  # wiped blocks are forgotten unless another table still holds them
            assert all(self.bm.device.block_hash[b] is None for b in held if self.bm.device.ref_counts[b] == 0)

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        self.bm.check_integrity()
        for h, holders in self.bm.device.cached.items():
            for b in holders:
                assert self.content.get(b) == h, f"block {b} is cached under a hash that is not its content"
        for rid in self.tokens:  # what a request made findable stays findable while it holds it
            if not self._on_host(rid):
                registered = self._hashes(rid)[:self.bm.num_registered(rid)]
                assert len(self.bm.match_prefix(registered)) == len(registered), f"{rid}'s blocks are lost"
        c = self.bm.device.counters
        assert 0 <= c.hits <= c.queried


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCache = PrefixCacheMachine.TestCase


def test_lru_evicts_leaf_blocks_of_the_oldest_context_first():
    bm = BlockManager(6, 0, 2)
    a, b = [1, 1, 2, 2, 3], [4, 4, 5, 5]  # 3 blocks (2 full) and 2 full blocks
    for rid, tokens in (("a", a), ("b", b)):
        bm.allocate(rid, len(tokens))
        bm.register_blocks(rid, chain_hashes(tokens, 2, []))
    bm.free("a")
    bm.free("b")
    assert bm.device.num_cached == 4 and bm.num_free_blocks == 6
    bm.allocate("c", 2)  # one block: the unused sixth one, no eviction
    bm.allocate("d", 4)  # two blocks: a's partial leaf (uncached), then a's deepest full block
    assert bm.device.counters.evictions == 1
    assert len(bm.match_prefix(chain_hashes(a, 2, []))) == 1  # a keeps its first block
    assert len(bm.match_prefix(chain_hashes(b, 2, []))) == 2  # b, freed later, keeps everything
    bm.check_integrity()


def test_content_computed_twice_stays_findable_when_one_copy_is_evicted():
    """A generation repeating an earlier one computes blocks the cache already holds (the prefix match
    covers prompts only): evicting the earlier copy must not hide the later one, still in use."""
    bm = BlockManager(4, 0, 2)
    tokens = [1, 1, 2, 2]
    hashes = chain_hashes(tokens, 2, [])
    bm.allocate("a", 4)
    bm.register_blocks("a", hashes)
    bm.free("a")  # cached, evictable
    bm.allocate("b", 4)  # computes the same content without a prefix match
    bm.register_blocks("b", hashes)
    b_blocks = bm.block_table("b")
    assert bm.device.num_cached == 2  # a's copies were redundant and lost their hash
    bm.allocate("c", 4)  # takes a's two blocks
    assert bm.device.counters.evictions == 0
    assert bm.match_prefix(hashes) == b_blocks
    bm.check_integrity()


# -- 2. the real model ------------------------------------------------------------------------------------

BLOCK_SIZE = 16
SYSTEM = ("You are a helpful assistant for a travel agency. You answer questions about cities, weather, "
          "trains and hotels, and you always answer briefly and politely. ")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(model_dir: str, policy: str = "infercept", num_blocks: int = 64, **kw) -> Engine:
    from test_interception import FP32_BYTES_PER_TOKEN, make_profile

    block_bytes = FP32_BYTES_PER_TOKEN * BLOCK_SIZE
    return Engine(model_dir, dtype="float32", kv_cache_gb=(num_blocks + 0.5) * block_bytes / GIB, host_kv_gb=0.01,
                  max_num_batched_tokens=32, policy=policy, progress=False,
                  profile=make_profile(FP32_BYTES_PER_TOKEN), **kw)


def run_all(engine: Engine, prompts: list[list[int]], n: int) -> list:
    ids = [engine.add_request(p, greedy(n)) for p in prompts]
    last = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            last[o.request_id] = o
        engine.block_manager.check_integrity()
    return [last[i] for i in ids]


@pytest.fixture(scope="module")
def cache_on(default_model_dir):
    return make_engine(default_model_dir)


def test_kv_bytes_match_the_profile_constant(cache_on):
    from test_interception import FP32_BYTES_PER_TOKEN

    assert KVCache.block_bytes(cache_on.spec, cache_on.config.dtype, BLOCK_SIZE) == FP32_BYTES_PER_TOKEN * BLOCK_SIZE


def test_common_prefix_is_shared_and_token_exact(default_model_dir, cache_on, tokenizer, hf_model_fp32):
    prompts = [tokenizer.encode(SYSTEM + q) for q in ("Q: Is Rome warm in May?\nA:", "Q: Trains from Paris?\nA:",
                                                      "Q: Hotels in Oslo?\nA:")]
    n = 6
    first = run_all(cache_on, prompts[:1], n)[0]
    assert first.num_cached_tokens == 0
    hits_before = cache_on.block_manager.device.counters.hits
    later = run_all(cache_on, prompts[1:], n)  # admitted together: both reuse the first one's blocks
    shared = (len(tokenizer.encode(SYSTEM)) // BLOCK_SIZE) * BLOCK_SIZE
    for out in later:
        assert out.num_cached_tokens >= shared > 0
    assert cache_on.block_manager.device.counters.hits > hits_before
    outputs = [first] + later
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf_model_fp32, prompt, n)

    cache_off = make_engine(default_model_dir, enable_prefix_caching=False)
    plain = run_all(cache_off, prompts, n)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert cache_off.block_manager.device.num_cached == 0 and cache_off.block_manager.device.counters.queried == 0


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(cache_on, tokenizer):
    """vLLM's `cache_salt`: the same prompt under another salt computes everything again; under its own
    salt (or none, as before) it reuses the blocks, and the tokens are the same either way."""
    prompt = tokenizer.encode("Ferries from Naples sail to Capri, Ischia and Procida all year, and to Sicily, "
                              "Sardinia and the Aeolian islands in summer. Which one is the fastest?")  # no other test's
    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE

    def run(salt):
        rid = cache_on.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt))
        outs = {}
        while cache_on.has_unfinished_requests():
            outs.update((o.request_id, o) for o in cache_on.step())
        return outs[rid]

    first = run("tenant-a")
    assert [run(s).num_cached_tokens for s in ("tenant-a", "tenant-b", None, "tenant-b")] == [full, 0, 0, full]
    assert run(None).num_cached_tokens == full and run("tenant-a").token_ids == first.token_ids


def test_paused_session_resumes_after_partial_eviction(default_model_dir, tokenizer, hf_model_fp32):
    """prefix-cache policy: the paused context is dropped lazily; another request evicts its deepest
    blocks; the resume recomputes only those and continues exactly as a fresh run would."""
    engine = make_engine(default_model_dir, policy="prefix-cache", num_blocks=12)
    bm = engine.block_manager
    prompt = tokenizer.encode(SYSTEM + "Q: What should I pack for a weekend in Bergen in October?\nA:")
    a = engine.add_request(prompt, greedy(4), intercept=InterceptParams(pause_on_stop=True))
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()  # the last step plans the fresh pause and outputs nothing
    assert out[-1].paused
    context = prompt + out[-1].token_ids
    computed_before = len(context) - 1  # KV at the pause (the last sampled token has none), dropped since
    assert engine.scheduler.requests[a].num_computed_tokens == 0  # lazily discarded at the tool call

    # Another request that needs every never-used block and two of a's (freed, still cached).
    unused = bm.device.num_blocks - bm.blocks_for(computed_before)
    other = tokenizer.encode("Tell me a long story about a dragon who learns to cook pasta in Naples. " * 8)
    other = other[:(unused + 2) * BLOCK_SIZE - 1]
    run_all(engine, [other], 1)
    location = engine.kv_location(a)
    assert location["device"] == location["host"] == 0 and location["discarded"] == len(context)
    assert 0 < location["cached"] < computed_before  # partly evicted, deepest blocks first
    assert location["cached"] % BLOCK_SIZE == 0

    appended = tokenizer.encode(" Bring a raincoat.", add_special_tokens=False)
    recomputed_before = engine.stats.num_recomputed_tokens
    engine.resume(a, appended, greedy(5))
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o
        bm.check_integrity()
    assert last.paused and last.num_cached_tokens == location["cached"]
    assert engine.stats.num_recomputed_tokens - recomputed_before == computed_before - location["cached"]
    assert last.token_ids == hf_greedy(hf_model_fp32, context + appended, 5)
    engine.abort(a)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.device.num_blocks
