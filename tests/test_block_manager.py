"""Property-based tests of block accounting and of the scheduler on top of it (no model needed).

1. A hypothesis state machine drives BlockManager with random allocate / append / swap-out /
   swap-in / free / abort steps and checks it against a plain model of "request -> number of tokens".
2. Random request mixes run through the real Scheduler with a fake runner and a pool small enough to
   force preemption (by recompute, or by swap to a host pool under the `infercept` policy), plus
   random aborts (between steps and while a step "runs"). The fake runner keeps a simulated KV store
   (slot -> (request, position, token)), copies it block by block when the scheduler swaps, and checks,
   for every chunk, that all the context the chunk attends to is still in the request's blocks, i.e.
   no block is handed to another request while in use, swapped KV comes back intact, and recompute
   after preemption starts from scratch.
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from infercept.engine.block_manager import BlockManager, OutOfBlocksError, consecutive_runs
from infercept.engine.config import SchedulerConfig
from infercept.engine.outputs import RunnerOutput, SampledToken, SchedulerOutput
from infercept.engine.request import Request, RequestStatus
from infercept.engine.sampling_params import SamplingParams
from infercept.engine.scheduler import Scheduler

REQUEST_IDS = [f"r{i}" for i in range(6)]


# -- 1. BlockManager state machine -----------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[str, int] = {}  # model: request id -> tokens it holds room for

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(1, 24), num_host_blocks=st.integers(0, 12),
          block_size=st.sampled_from([1, 2, 4, 16]))
    def create(self, num_blocks, num_host_blocks, block_size):
        self.bm = BlockManager(num_blocks, num_host_blocks, block_size)

    def _swapped(self, rid: str) -> bool:
        """Requests with blocks on the host are paused: they neither grow nor get new blocks."""
        return self.bm.num_host_blocks_of(rid) > 0

    def _expected_new(self, rid: str, n: int) -> int:
        have = self.bm.blocks_for(self.tokens[rid]) if rid in self.tokens else 0
        return max(self.bm.blocks_for(n) - have, 0)

    @precondition(lambda self: self.bm is not None)
    @rule(rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 120))
    def allocate(self, rid, n):
        bm = self.bm
        if self._swapped(rid):
            return
        new = self._expected_new(rid, n)
        assert bm.num_new_blocks(rid, n) == new
        free_before = bm.num_free_blocks
        table_before = list(bm.block_table(rid))
        if bm.can_allocate(rid, n):
            assert new <= free_before
            table = bm.allocate(rid, n)
            self.tokens[rid] = max(self.tokens.get(rid, 0), n)
            assert table[:len(table_before)] == table_before  # growing never moves existing blocks
            assert len(table) == bm.blocks_for(self.tokens[rid])
            assert bm.num_free_blocks == free_before - new
        else:
            assert new > free_before
            with pytest.raises(OutOfBlocksError):
                bm.allocate(rid, n)
            assert bm.block_table(rid) == table_before
            assert bm.num_free_blocks == free_before

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data())
    def append_one(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self._swapped(rid):
            return
        n = self.tokens[rid] + 1
        if self.bm.can_allocate(rid, n):
            self.bm.allocate(rid, n)
            self.tokens[rid] = n
        else:  # only possible when the new token starts a new block
            assert n % self.bm.block_size == 1 % self.bm.block_size and self.bm.num_free_blocks == 0

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def swap_out(self, data, k):
        """Move the first k device blocks of a request to the host (if the host has room)."""
        bm = self.bm
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        device_before, host_before = list(bm.block_table(rid)), list(bm.host_tables.get(rid, []))
        k = min(k, len(device_before))
        if not bm.can_swap_out(k):
            assert k > bm.num_free_host_blocks
            return
        free_before, host_free_before = bm.num_free_blocks, bm.num_free_host_blocks
        pairs = bm.swap_out(rid, k)
        assert [d for d, _ in pairs] == device_before[:k]
        assert bm.block_table(rid) == device_before[k:]
        assert bm.host_tables.get(rid, []) == host_before + [h for _, h in pairs]
        assert bm.num_free_blocks == free_before + k
        assert bm.num_free_host_blocks == host_free_before - k

    @precondition(lambda self: self.bm is not None and self.bm.host_tables)
    @rule(data=st.data(), k=st.integers(1, 6))
    def swap_in(self, data, k):
        """Move the last k host blocks of a request back to the front of its device table."""
        bm = self.bm
        rid = data.draw(st.sampled_from(sorted(bm.host_tables)))
        device_before, host_before = list(bm.block_table(rid)), list(bm.host_tables[rid])
        k = min(k, len(host_before))
        if not bm.can_swap_in(k):
            assert k > bm.num_free_blocks
            return
        host_free_before = bm.num_free_host_blocks
        pairs = bm.swap_in(rid, k)
        assert bm.num_free_host_blocks == host_free_before  # until the step's copies ran
        bm.copies_done()
        assert bm.num_free_host_blocks == host_free_before + k
        assert [h for h, _ in pairs] == host_before[len(host_before) - k:]
        assert bm.block_table(rid) == [d for _, d in pairs] + device_before
        assert bm.host_tables.get(rid, []) == host_before[:len(host_before) - k]

    @precondition(lambda self: self.bm is not None)
    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        held = len(self.bm.block_table(rid))
        held_host = self.bm.num_host_blocks_of(rid)
        free_before, host_free_before = self.bm.num_free_blocks, self.bm.num_free_host_blocks
        self.bm.free(rid)
        self.tokens.pop(rid, None)
        assert self.bm.block_table(rid) == [] and self.bm.num_host_blocks_of(rid) == 0
        assert self.bm.num_free_blocks == free_before + held
        assert self.bm.num_free_host_blocks == host_free_before + held_host

    @precondition(lambda self: self.bm is not None)
    @rule(rid=st.sampled_from(REQUEST_IDS))
    def abort(self, rid):
        """Abort frees, and whatever else frees the same request afterwards is a no-op."""
        self.bm.free(rid)
        self.tokens.pop(rid, None)
        free_after_first = self.bm.num_free_blocks
        self.bm.free(rid)
        assert self.bm.num_free_blocks == free_after_first

    @invariant()
    def integrity(self):
        if self.bm is None:
            return
        bm = self.bm
        bm.check_integrity()
        assert bm.num_free_blocks + bm.num_used_blocks() == bm.device.num_blocks
        owned = [b for r in self.tokens for b in bm.block_table(r)]
        assert len(owned) == len(set(owned)) == bm.num_used_blocks()  # no sharing without prefix caching
        assert all(0 <= b < bm.device.num_blocks for b in owned)
        on_host = [b for r in self.tokens for b in bm.host_tables.get(r, [])]
        assert len(on_host) == len(set(on_host)) == bm.host.num_blocks - bm.num_free_host_blocks
        assert set(bm.host_tables) <= set(self.tokens)
        for rid, n in self.tokens.items():
            # host part + device part is still exactly the request's logical table
            assert bm.num_host_blocks_of(rid) + len(bm.block_table(rid)) == bm.blocks_for(n)

    def teardown(self):
        if self.bm is None:
            return
        for rid in REQUEST_IDS:
            self.bm.free(rid)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.bm.device.num_blocks
        assert self.bm.num_free_host_blocks == self.bm.host.num_blocks
        assert self.bm.num_used_blocks() == 0 and not self.bm.tables and not self.bm.host_tables


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


# -- 2. Scheduler with a fake runner --------------------------------------------------------------------

SAMPLED = 5  # every sampled token; also declared end-of-sequence, so ignore_eos must be honoured


class FakeRunner:
    """Checks what a real runner relies on, then 'samples' token 5 for every chunk with sample=True."""

    def __init__(self, scheduler: Scheduler, block_size: int):
        self.scheduler = scheduler
        self.block_size = block_size
        # slot -> (position, the context up to it): what a KV entry depends on, so two requests with the
        # same prefix may read each other's entries and nothing else.
        self.kv: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.host_kv: dict[int, tuple[int, tuple[int, ...]]] = {}  # the same, for host slots

    def copy_blocks(self, pairs, src: dict, dst: dict) -> None:
        for a, b in pairs:
            for i in range(self.block_size):
                entry = src.get(a * self.block_size + i)
                if entry is None:
                    dst.pop(b * self.block_size + i, None)
                else:
                    dst[b * self.block_size + i] = entry

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        sched = self.scheduler
        config = sched.config
        self.copy_blocks(out.swap_out, self.kv, self.host_kv)  # in the order a real runner copies
        self.copy_blocks(out.swap_in, self.host_kv, self.kv)
        # The paper's discard baseline recomputes a discarded context in one iteration, whatever the budget.
        assert out.num_batched_tokens <= config.max_num_batched_tokens or any(
            sched.requests[c.request_id].recompute_all for c in out.chunks)
        assert len(out.chunks) <= config.max_num_seqs
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        sampled = {}
        for c in out.chunks:
            request = sched.requests[c.request_id]
            assert request.status is RequestStatus.RUNNING
            assert c.token_ids, "empty chunk"
            assert c.start_pos == request.num_computed_tokens
            end = c.start_pos + len(c.token_ids)
            assert end <= request.num_tokens
            assert c.token_ids == request.token_ids[c.start_pos:end]
            assert len(c.block_table) >= -(-end // self.block_size)
            assert c.sample == (end == request.num_tokens)
            assert c.num_output_tokens == request.num_output_tokens
            for pos in range(c.start_pos):  # the context must still be where it was written
                assert self.kv.get(self.slot(c.block_table, pos)) == (pos, tuple(request.token_ids[:pos + 1])), (
                    f"{c.request_id}: KV of position {pos} lost")
            pool = sched.blocks.device
            for i in range(c.start_pos // self.block_size, -(-end // self.block_size)):
                b = c.block_table[i]  # written this step: nobody else may read it, the cache may not name it
                assert pool.ref_counts[b] == 1 and pool.block_hash[b] is None, f"{c.request_id} writes shared block {b}"
            for pos in range(c.start_pos, end):
                self.kv[self.slot(c.block_table, pos)] = (pos, tuple(request.token_ids[:pos + 1]))
            if c.sample:
                sampled[c.request_id] = SampledToken(SAMPLED)
        return RunnerOutput(sampled=sampled)


def check_scheduler_state(sched: Scheduler, bm: BlockManager) -> None:
    bm.check_integrity()
    assert bm.num_free_blocks + len({b for t in bm.tables.values() for b in t}) == bm.device.num_blocks
    assert set(sched.requests) == {r.request_id for r in sched.running + sched.waiting + sched.swapped} | set(sched.paused)
    ids = [r.request_id for r in sched.running + sched.waiting + sched.swapped] + list(sched.paused)
    assert len(ids) == len(set(ids))
    for r in sched.swapped:  # preempted by swap: its KV on the host, maybe partly back already
        assert r.status is RequestStatus.SWAPPED and bm.num_host_blocks_of(r.request_id) > 0
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(bm.block_table(r.request_id)) >= bm.blocks_for(r.num_computed_tokens)
    for r in sched.paused.values():
        assert r.status is RequestStatus.INTERCEPTED
    # Active programs (scheduled once, not finished) and the new ones waiting, as admission counts them.
    assert sched._started <= set(sched.requests)
    assert sched._num_waiting_new == sum(r.request_id not in sched._started for r in sched.waiting)
    for r in sched.waiting:
        assert r.status is RequestStatus.WAITING
        assert r.num_computed_tokens == 0 and bm.block_table(r.request_id) == []
    for lst in (sched.running, sched.waiting, sched.swapped):  # each in queue order (arrival by default)
        assert [r.priority for r in lst] == sorted(r.priority for r in lst)


BLOCK_SIZE = 4


@st.composite
def workloads(draw):
    num_blocks = draw(st.integers(2, 8))
    capacity = num_blocks * BLOCK_SIZE
    n = draw(st.integers(1, 8))
    # Prompts of one family share their first `shared` tokens: the prefix cache lets them share blocks.
    num_families, shared = draw(st.integers(1, 3)), draw(st.integers(0, 2 * BLOCK_SIZE))
    requests = []
    for i in range(n):
        # Every request fits the pool on its own (prompt + all outputs); together they usually don't.
        max_tokens = draw(st.integers(1, min(12, capacity - 1)))
        prompt_len = draw(st.integers(1, capacity - max_tokens))
        arrive_step = draw(st.integers(0, 10))
        requests.append((prompt_len, max_tokens, arrive_step, i % num_families))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1), st.booleans()), max_size=3))
    budget = draw(st.integers(1, 24))
    max_num_seqs = draw(st.integers(1, 6))
    caching = draw(st.booleans())
    swap_preemption = draw(st.booleans())
    return num_blocks, requests, aborts, budget, max_num_seqs, shared, caching, swap_preemption


def cheap_copy_profile():
    """A profile whose host copies cost next to nothing (a CPU): `infercept` then swaps, not recomputes."""
    from infercept.engine.policy import Profile

    return Profile(model="toy", device="cpu", dtype="bfloat16", bytes_per_token=100, block_size=BLOCK_SIZE,
                   t_fwd_samples=((1, 0.01), (64, 0.02)), d2h_bytes_per_s=1e10, h2d_bytes_per_s=1e10,
                   saturation_point=64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_with_fake_runner(workload):
    from infercept.engine.policy import make_policy

    num_blocks, specs, aborts, budget, max_num_seqs, shared, caching, swap_preemption = workload
    bm = BlockManager(num_blocks, 2 * num_blocks if swap_preemption else 0, BLOCK_SIZE, enable_caching=caching)
    policy = dict(policy=make_policy("infercept"), profile=cheap_copy_profile()) if swap_preemption else {}
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=1 << 20), bm, **policy)
    runner = FakeRunner(sched, BLOCK_SIZE)
    requests = {}
    for i, (prompt_len, max_tokens, _, family) in enumerate(specs):
        prompt = [100 + (family * 1000 + j if j < shared else i * 1000 + j) for j in range(prompt_len)]
        requests[f"q{i}"] = Request(f"q{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True),
                                    eos_token_ids=frozenset({SAMPLED}), arrival_time=float(i))
    aborted: set[str] = set()
    abort_at = {}
    for step, idx, during in aborts:
        abort_at.setdefault(step, []).append((f"q{idx}", during))

    finished: dict[str, Request] = {}
    step = 0
    while step < 5000:
        for i, (_, _, arrive, _) in enumerate(specs):
            if arrive == step:
                sched.add(requests[f"q{i}"])
        if step > max(spec[2] for spec in specs) and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_scheduler_state(sched, bm)
        runner_out = runner.run(out)  # also for a step of copies only
        for rid, during in abort_at.get(step, []):
            if during and sched.abort(rid) is not None:  # aborted while the step ran: update skips it
                aborted.add(rid)
        for r in sched.update(out, runner_out):
            if r.status.finished:
                finished[r.request_id] = r
        for rid, during in abort_at.get(step, []):
            if not during and sched.abort(rid) is not None:
                aborted.add(rid)
        check_scheduler_state(sched, bm)
        step += 1
    assert not sched.has_unfinished(), f"still unfinished after {step} steps: livelock"
    preempted = any(r.num_preemptions for r in requests.values())
    event(("preempted by swap" if swap_preemption else "preempted") if preempted else "no preemption")
    event("prefix reused" if bm.device.counters.hits else "no reuse")

    for rid, request in requests.items():
        if rid in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert rid not in finished
            continue
        assert finished[rid] is request
        assert request.status is RequestStatus.FINISHED_LENGTH and request.finish_reason == "length"
        assert request.output_token_ids == [SAMPLED] * request.sampling_params.max_tokens
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks and not bm.tables
    assert bm.num_free_host_blocks == bm.host.num_blocks and not bm.host_tables
    # Every id that ended is reported once to the runner.
    assert sched.schedule().chunks == []


@st.composite
def agent_workloads(draw):
    """Multi-turn requests: each turn ends in an interception (pause) of a few steps, then tool tokens
    are appended and the next turn generates; every policy, any host pool, budget and batch size."""
    num_blocks = draw(st.integers(4, 10))
    capacity = num_blocks * BLOCK_SIZE
    requests = []
    for i in range(draw(st.integers(1, 6))):
        turns = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 6)), min_size=1,
                              max_size=3))  # (max_tokens, tokens the tool returns, steps paused before)
        prompt_len = draw(st.integers(1, 8))
        # Every request fits the pool on its own (its whole context); together they usually don't.
        if prompt_len + sum(m + (a if j else 0) for j, (m, a, _) in enumerate(turns)) < capacity:
            requests.append((prompt_len, turns, draw(st.integers(0, 8))))
    policy = draw(st.sampled_from([None, "discard", "improved-discard", "chunked-discard", "budgeted-swap",
                                   "heuristic-preserve", "infercept", "infercept-paper", "preserve", "swap",
                                   "prefix-cache", "infercept-paper+las-priority", "prefix-cache+program-arrival-priority",
                                   "infercept-paper+las-priority+expected-waste+prefetch", "infercept-paper+admission",
                                   "infercept+admission", "discard+admission", "infercept-paper+las-priority+admission",
                                   "infercept-paper+ample-no-discard", "infercept-paper+deferred-swap",
                                   "infercept+deferred-swap"]))
    return (num_blocks, draw(st.integers(0, 2 * num_blocks)), requests, policy, draw(st.integers(1, 24)),
            draw(st.integers(1, 6)), draw(st.booleans()))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(agent_workloads())
def test_agents_under_every_policy_with_fake_runner(workload):
    """Pause, keep / swap / discard, resume, preempt, under every policy: no KV is ever lost (the fake
    runner checks every context position a chunk attends to), no livelock, every turn gets its tokens,
    and every block comes back."""
    from infercept.engine.policy import AdmissionController, make_policy
    from infercept.engine.request import InterceptParams

    num_blocks, host_blocks, specs, policy, budget, max_num_seqs, caching = workload
    bm = BlockManager(num_blocks, host_blocks, BLOCK_SIZE, enable_caching=caching)
    now = [0.0]
    policy_args = dict(policy=make_policy(policy), profile=cheap_copy_profile()) if policy else {}
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=1 << 20),
                      bm, clock=lambda: now[0], **policy_args)
    if sched.admission is not None:
        # Windows of a few steps and a cap that falls on any recompute, so that the cap binds within
        # these short runs: new programs are held back while resumed turns go on.
        sched.admission = AdmissionController(window_s=0.02, min_steps=2, thrash_high=0.01, thrash_low=0.005)
    runner = FakeRunner(sched, BLOCK_SIZE)
    requests, turns_left, resume_at = {}, {}, {}
    for i, (prompt_len, turns, _) in enumerate(specs):
        rid = f"q{i}"
        requests[rid] = Request(rid, [100 + i * 1000 + j for j in range(prompt_len)], greedy(turns[0][0]),
                                eos_token_ids=frozenset({SAMPLED}), arrival_time=float(i),
                                intercept=InterceptParams(pause_on_stop=True) if len(turns) > 1 else None)
        turns_left[rid] = list(turns[1:])
    finished, step = set(), 0
    while step < 5000:
        now[0] = step * 0.01
        for i, (_, _, arrive) in enumerate(specs):
            if arrive == step:
                sched.add(requests[f"q{i}"])
        for rid in [r for r, at in resume_at.items() if at == step]:
            del resume_at[rid]
            max_tokens, returned, _ = turns_left[rid].pop(0)
            request = requests[rid]
            request.sampling_params = greedy(max_tokens)
            if not turns_left[rid]:
                request.intercept = None  # the last turn finishes
            sched.resume(rid, [50 + k for k in range(returned)])
        if step > max((a for _, _, a in specs), default=0) and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_scheduler_state(sched, bm)
        if out.num_held_back:
            event("admission held a new program back")
        for r in sched.update(out, runner.run(out)):
            if r.status.finished:
                assert r.output_token_ids == [SAMPLED] * r.sampling_params.max_tokens
                finished.add(r.request_id)
            elif r.pending_stop is not None:  # a turn ended: the interception starts
                assert r.output_token_ids == [SAMPLED] * r.sampling_params.max_tokens
                sched.pause(r, [])
                resume_at[r.request_id] = step + 1 + turns_left[r.request_id][0][2]
        check_scheduler_state(sched, bm)
        step += 1
    assert not sched.has_unfinished(), f"still unfinished after {step} steps: livelock"
    assert finished == set(requests)
    event(f"policy {policy}")
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks and not bm.tables
    assert bm.num_free_host_blocks == bm.host.num_blocks and not bm.host_tables


def test_pool_pressure_preempts_newest_and_recomputes():
    """Deterministic example: two requests that cannot both grow; the newer is preempted, later
    recomputed (prompt + its outputs so far) and still ends with all its tokens."""
    bm = BlockManager(4, 0, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm)
    runner = FakeRunner(sched, BLOCK_SIZE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = Request("a", list(range(10, 18)), params, arrival_time=0.0)  # 8 prompt tokens: 2 blocks
    b = Request("b", list(range(20, 27)), params, arrival_time=1.0)  # 7 prompt tokens: 2 blocks
    sched.add(a)
    sched.add(b)
    max_preemptions = 0
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_scheduler_state(sched, bm)
        sched.update(out, runner.run(out) if out.chunks else RunnerOutput(sampled={}))
        check_scheduler_state(sched, bm)
        max_preemptions = max(max_preemptions, b.num_preemptions)
    assert not sched.has_unfinished()
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert a.output_token_ids == b.output_token_ids == [SAMPLED] * 6
    assert bm.num_free_blocks == 4


def test_host_blocks_are_handed_out_in_consecutive_runs():
    """On a GPU each run of consecutive host blocks is one transfer call, whose host-side cost (tens of
    microseconds) is paid per run: the host pool fits a swap-out into the smallest free run that holds
    it, spans the fewest, longest runs when none does, and joins freed neighbours into one run again
    (handed out from a free queue, the H100 trace's swaps averaged 2 blocks a run, 2026-11-27)."""
    bm = BlockManager(64, 40, BLOCK_SIZE)
    for rid in "abcd":  # host blocks 0-9, 10-19, 20-29, 30-39
        bm.allocate(rid, 10 * BLOCK_SIZE)
        assert consecutive_runs([h for _, h in bm.swap_out(rid, 10)]) == [(0, "abcd".index(rid) * 10, 10)]
    for rid in "bd":
        bm.free(rid)  # free runs: 10-19 and 30-39
    bm.allocate("e", 12 * BLOCK_SIZE)
    assert [h for _, h in bm.swap_out("e", 4)] == [10, 11, 12, 13]  # the smallest run that holds 4
    assert [h for _, h in bm.swap_out("e", 8)] == [30, 31, 32, 33, 34, 35, 36, 37]  # holds 8: not 14-19
    bm.allocate("f", 8 * BLOCK_SIZE)
    assert [h for _, h in bm.swap_out("f", 8)] == [14, 15, 16, 17, 18, 19, 38, 39]  # no run holds 8: two
    bm.check_integrity()
    for rid in "aefc":  # each freed run joins the free runs before and after it
        bm.swap_in(rid, bm.num_host_blocks_of(rid))
        bm.copies_done()
        bm.check_integrity()
    for rid in "acef":
        bm.free(rid)
    bm.allocate("g", 40 * BLOCK_SIZE)
    assert consecutive_runs([h for _, h in bm.swap_out("g", 40)]) == [(0, 0, 40)]


def test_abort_of_unknown_or_finished_request_is_a_noop():
    bm = BlockManager(4, 0, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), bm)
    assert sched.abort("nope") is None
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add(r)
    with pytest.raises(ValueError):
        sched.add(Request("x", [1], SamplingParams()))
    out = sched.schedule()
    sched.update(out, RunnerOutput(sampled={"x": SampledToken(7)}))
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert sched.abort("x") is None
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == 4
    assert sched.schedule().finished_request_ids == ["x"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def step_sampling_every_chunk(sched: Scheduler) -> SchedulerOutput:
    """One scheduler step whose 'runner' samples SAMPLED for every chunk that reaches its end (no KV
    contents are checked, so swaps need no copies); returns the step's output."""
    out = sched.schedule()
    sched.blocks.check_integrity()
    sampled = {c.request_id: SampledToken(SAMPLED) for c in out.chunks if c.sample}
    sched.update(out, RunnerOutput(sampled=sampled))
    return out


def test_resumed_request_swapping_in_keeps_its_fcfs_place():
    """Three queues, one FCFS order: a resumed request whose KV is coming back from the host (one block
    per step here) is owed the device room it needs. A newer waiting request is not admitted into
    that room, and a newer running request that needs a block is preempted rather than the older
    swapping-in request discarded."""
    bm = BlockManager(10, 10, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm)
    sched._swap_budget_tokens = lambda: BLOCK_SIZE  # a slow host link: one block back per step

    def step():
        return {c.request_id for c in step_sampling_every_chunk(sched).chunks}

    a = Request("a", list(range(100, 112)), greedy(8), arrival_time=0.0)  # 12 tokens: 3 blocks
    sched.add(a)
    step()
    sched.pause(a, [])
    bm.swap_out("a", 3)  # what a swapping policy does while it is paused
    c = Request("c", list(range(200, 221)), greedy(12), arrival_time=2.0)  # 21 tokens: 6 blocks, growing
    sched.add(c)
    step()
    sched.resume("a", [7, 7, 7, 7])
    b = Request("b", list(range(300, 307)), greedy(2), arrival_time=1.0)  # 7 tokens: 2 blocks
    sched.add(b)
    assert a.status is RequestStatus.SWAPPED and bm.num_free_blocks == 4

    a_back = b_first = None
    for i in range(60):
        ran = step()
        if a_back is None and a.status is RequestStatus.RUNNING:
            a_back = i
        if b_first is None and "b" in ran:
            b_first = i
        assert a.status is not RequestStatus.WAITING, "the older swapping-in request was discarded"
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert a_back is not None and b_first is not None and a_back <= b_first
    assert a.output_token_ids == [SAMPLED] * 8 and b.output_token_ids == [SAMPLED] * 2
    assert c.output_token_ids == [SAMPLED] * 12
    assert bm.num_free_blocks == 10 and bm.num_free_host_blocks == 10


def test_min_waste_swaps_a_preserved_request_out_for_room_instead_of_discarding():
    """infercept preserves a paused request whose call looks short; when a running request then needs
    its blocks and copying is cheaper than recomputing, the paused KV is swapped out, not discarded, and
    comes back on resume without recomputation. The profile makes a decode iteration (1 ms) shorter
    than the paused KV's round trip to the host (3.5 ms), so the fresh pause is preserved, and a
    recompute (106 ms for 17 tokens) far dearer than the copy."""
    from infercept.engine.policy import Profile, make_policy

    profile = Profile(model="toy", device="cpu", dtype="bfloat16", bytes_per_token=100, block_size=BLOCK_SIZE,
                      t_fwd_samples=((1, 0.001), (16, 0.1), (64, 0.4)), d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6,
                      saturation_point=64)
    bm = BlockManager(8, 8, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm,
                      policy=make_policy("infercept"), profile=profile, clock=lambda: 0.0)
    swapped_out = discarded = recomputed = 0

    def step():
        nonlocal swapped_out, discarded, recomputed
        out = step_sampling_every_chunk(sched)
        swapped_out += len(out.swap_out)
        discarded += out.num_discarded_tokens
        recomputed += out.num_recomputed_tokens

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = Request("a", list(range(100, 116)), params, arrival_time=0.0)
    sched.add(a)
    step()  # prefill 16 tokens
    step()  # one decode: 17 tokens of KV, 5 blocks
    sched.pause(a, [])
    step()  # the clock stands still: elapsed 0, expected 0, a 1 ms iteration -> preserve
    assert len(bm.block_table("a")) == 5 and swapped_out == 0
    b = Request("b", list(range(200, 219)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                arrival_time=1.0)  # 19 tokens + 8: needs 7 blocks of the 8
    sched.add(b)
    while b.status is not RequestStatus.FINISHED_LENGTH:
        step()
    assert swapped_out == 5 and discarded == 0 and bm.num_host_blocks_of("a") == 5
    sched.resume("a", [7])
    while sched.has_work():
        step()
    assert a.status is RequestStatus.FINISHED_LENGTH and recomputed == 0
    assert bm.num_free_blocks == 8 and bm.num_free_host_blocks == 8


def test_min_waste_sends_a_swapping_in_request_back_to_the_host_for_an_older_one():
    """A resumed request whose KV is coming back from the host one block per step is newer than a
    running request that keeps growing. When the older one needs the blocks, the newer one's device
    part goes back to the host under infercept (copies are cheap here), not discarded with its host
    part: nothing is recomputed and both finish."""
    from infercept.engine.policy import make_policy

    bm = BlockManager(8, 16, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm,
                      policy=make_policy("infercept"), profile=cheap_copy_profile(), clock=lambda: 0.0)
    sched._swap_budget_tokens = lambda: BLOCK_SIZE  # one block back per step
    discarded = recomputed = swapped_out = 0

    def step():
        nonlocal discarded, recomputed, swapped_out
        out = step_sampling_every_chunk(sched)
        discarded += out.num_discarded_tokens
        recomputed += out.num_recomputed_tokens
        swapped_out += len(out.swap_out)

    b = Request("b", list(range(200, 216)), greedy(4), arrival_time=1.0)  # 16 tokens: 4 blocks
    sched.add(b)
    step()
    sched.pause(b, [])
    bm.swap_out("b", 4)  # parked on the host while paused
    a = Request("a", list(range(100, 112)), greedy(16), arrival_time=0.0)  # 12 tokens growing to 28: 7 blocks
    sched.add(a)
    step()
    sched.resume("b", [7])
    for _ in range(80):
        step()
        assert b.status is not RequestStatus.WAITING, "the swapping-in request was discarded"
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert discarded == 0 and recomputed == 0 and swapped_out > 0
    assert a.output_token_ids == [SAMPLED] * 16 and b.output_token_ids == [SAMPLED] * 4
    assert bm.num_free_blocks == 8 and bm.num_free_host_blocks == 16


@pytest.mark.parametrize("policy, copies_overlap, runs_next_step", [
    ("infercept", True, True), ("infercept", False, False), ("swap", True, False)])
def test_a_request_whose_kv_a_step_brings_back_runs_from_the_next_step_where_copies_overlap(
        policy, copies_overlap, runs_next_step):
    """Where copies run beside the forward pass (a GPU's copy stream), a resumed request whose last host
    blocks a step copies back first runs in the next step, so that step's pass never waits for the copy;
    a request already running beside it is not held back. Where copies run before the pass (a CPU), and
    under the synchronous `swap` baseline (copies block the step by definition), it runs in the same step."""
    from infercept.engine.policy import make_policy

    bm = BlockManager(16, 16, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm,
                      policy=make_policy(policy), profile=cheap_copy_profile(), clock=lambda: 0.0,
                      copies_overlap=copies_overlap)
    b = Request("b", list(range(200, 216)), greedy(4), arrival_time=1.0)
    sched.add(b)
    step_sampling_every_chunk(sched)
    sched.pause(b, [])
    bm.swap_out("b", 4)  # parked on the host while paused
    a = Request("a", list(range(100, 104)), greedy(8), arrival_time=0.0)
    sched.add(a)
    step_sampling_every_chunk(sched)
    sched.resume("b", [7])
    out = step_sampling_every_chunk(sched)
    assert len(out.swap_in) == 4 and b.status is RequestStatus.RUNNING
    assert [c.request_id for c in out.chunks] == (["a"] if runs_next_step else ["a", "b"])
    out = step_sampling_every_chunk(sched)
    assert not out.swap_in and [c.request_id for c in out.chunks] == ["a", "b"]


def test_swapping_in_request_discarded_for_an_older_one_leaves_the_swap_in_loop_alone():
    """A half-swapped-in request that an older swapping-in one evicts by discard (the baselines' and,
    when copies are dear, min-waste's choice) moves to the waiting queue in the middle of the swap-in
    loop; the loop must skip it (a sweep of `--policy swap` failed every request with
    "list.remove(x): x not in list" here)."""
    bm = BlockManager(6, 16, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm)
    for rid, arrival, n in (("b", 1.0, 16), ("a", 0.0, 12)):  # 4 and 3 blocks, parked on the host while paused
        sched.add(Request(rid, list(range(100, 100 + n)), greedy(4), arrival_time=arrival))
        step_sampling_every_chunk(sched)
        sched.pause(sched.requests[rid], [])
        bm.swap_out(rid, len(bm.block_table(rid)))
    sched._swap_budget_tokens = lambda: BLOCK_SIZE  # b comes back one block per step
    sched.resume("b", [7])
    for _ in range(3):
        step_sampling_every_chunk(sched)
    assert len(bm.block_table("b")) == 3 and bm.num_host_blocks_of("b") == 1  # mostly swapped in
    del sched._swap_budget_tokens
    sched.resume("a", [7])
    # a (older) needs 3 blocks + 1 for its next chunk: b's device part makes way, discarded with its
    # host part (no policy), and the loop goes on with room left.
    out = step_sampling_every_chunk(sched)
    assert out.num_discarded_tokens > 0 and sched.requests["b"].status is RequestStatus.WAITING
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step_sampling_every_chunk(sched)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 6 and bm.num_free_host_blocks == 16


def test_cached_tokens_count_only_what_the_turn_reused():
    """A resumed request reports its kept KV as cached; if that KV is dropped before its first token (a
    swapping-in request discarded for an older one) and recomputed, the turn reused nothing and says
    so (it reported the dropped KV as reused, 41 cached of which 37 recomputed, in a simulated sweep)."""
    bm = BlockManager(6, 16, BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1 << 20), bm)
    for rid, arrival, n in (("b", 1.0, 16), ("a", 0.0, 12)):
        sched.add(Request(rid, list(range(100, 100 + n)), greedy(4), arrival_time=arrival))
        step_sampling_every_chunk(sched)
        sched.pause(sched.requests[rid], [])
        bm.swap_out(rid, len(bm.block_table(rid)))
    b = sched.requests["b"]
    sched._swap_budget_tokens = lambda: BLOCK_SIZE
    sched.resume("b", [7])
    assert b.num_cached_tokens == 16  # its 16 prompt tokens, on the host (the sampled token has no KV yet)
    for _ in range(3):
        step_sampling_every_chunk(sched)
    del sched._swap_budget_tokens
    sched.resume("a", [7])
    assert sched.requests["a"].num_cached_tokens == 12
    step_sampling_every_chunk(sched)
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0  # dropped before its first token
    while b.num_output_tokens == 0:
        out = step_sampling_every_chunk(sched)
    assert out.num_recomputed_tokens >= 16
    assert b.num_cached_tokens == 0
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step_sampling_every_chunk(sched)
    assert bm.num_free_blocks == 6 and bm.num_free_host_blocks == 16
