"""Scheduler cases for `InterceptScheduler`, run by the vLLM environment's python (no pytest there).

    <vllm python> tests/vllm_scheduler_cases.py MODEL_DIR   ->  one JSON object: case name -> "ok" or why not

In the style of vLLM's own tests/v1/core: a real `Scheduler` over a block pool of a given size, no model
runs; each step feeds `update_from_output` a sampled token per scheduled request. tests/test_vllm_scheduler.py
runs this once and turns every case into a test. MODEL_DIR is read for its config only.
"""
from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `engine`

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.request_queue import FCFSRequestQueue  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from engine.output_stage import Action, TurnOutput, TurnRule  # noqa: E402
from engine.policy import Profile  # noqa: E402
from engine.request import InterceptParams  # noqa: E402
from engine.sampling_params import SamplingParams as OurParams  # noqa: E402
from engine.vllm_backend import host_tier  # noqa: E402
from engine.vllm_backend import scheduler as ours  # noqa: E402
from engine.vllm_backend.params import TURN_RULE_KEY  # noqa: E402

BLOCK = 16
SAMPLED = 7  # the token every step "samples"
PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)
# A CPU-like profile: a token of recompute costs ~1 ms, so long pauses of long contexts are discarded.
PROFILE = Profile(model="test", device="cpu", dtype="float32", bytes_per_token=4096, block_size=BLOCK,
                  t_fwd_samples=((1, 0.02), (64, 0.05), (256, 0.2), (1024, 0.8)),
                  d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
MODEL = sys.argv[1] if len(sys.argv) > 1 else None


BYTES_PER_BLOCK = 2 * BLOCK * 4  # one layer, one KV head of size 1, float32: K and V


def configs(policy: str | None = "infercept", num_blocks: int = 64, host_bytes: int | None = None,
            max_num_seqs: int = 16, kv_groups: list | None = None, async_scheduling: bool | None = None):
    """vLLM's configuration (our connector's `kv_transfer_config` with a pool of `host_bytes`, if given) and
    a KV cache config of `num_blocks` blocks: `kv_groups`, or one group of one full-attention layer."""
    model = ModelConfig(model=MODEL, max_model_len=4096, dtype="float32", seed=0)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=4096,
                            is_encoder_decoder=False, enable_chunked_prefill=True, async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    transfer = None if host_bytes is None else KVTransferConfig(
        kv_connector="HostTierConnector", kv_connector_module_path="engine.vllm_backend.host_tier", kv_role="kv_both",
        kv_connector_extra_config={"host_bytes": host_bytes})  # as backend.host_tier_config
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=transfer,
                        additional_config=ours.scheduler_config(policy) if policy else {})
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_groups or [
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return config, kv


def make(policy: str | None = "infercept", num_blocks: int = 64, profile: Profile | None = PROFILE,
         cls=ours.InterceptScheduler, host_blocks: int | None = None, max_num_seqs: int = 16,
         kv_groups: list | None = None, async_scheduling: bool | None = None):
    """A scheduler over `num_blocks` device blocks; with `host_blocks`, our host-tier connector too, and a
    fake worker (`FakeWorker`) that runs its copies on real tensors."""
    config, kv = configs(policy, num_blocks, None if host_blocks is None else host_blocks * BYTES_PER_BLOCK,
                         max_num_seqs, kv_groups, async_scheduling)
    s = cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK, log_stats=True)
    if profile is not None and cls is not Scheduler:
        s._on_message({"op": "profile", "profile": profile.to_dict()})
    s.fake_worker = None if host_blocks is None else FakeWorker(config, kv, num_blocks)
    return s


class FakeWorker:
    """A worker without a model: the worker side of the host-tier connector on a real KV tensor, run in
    the order vLLM's model runners run it (swap-outs, zeroing of new blocks, loads: before the forward in
    a step with a synchronous load, after it otherwise), and a "forward" that writes each scheduled
    position's KV as a function of its token and position (`kv_value`), so a resumed session's KV can be
    checked position by position."""

    def __init__(self, config, kv, num_blocks: int):
        self.cache = torch.zeros(num_blocks, 2, BLOCK)  # [block, K/V, slot]: one head of size 1
        self.connector = host_tier.HostTierConnector(config, KVConnectorRole.WORKER, kv)
        self.connector.register_kv_caches({"layer": self.cache})

    def execute(self, s, out) -> None:
        meta = out.kv_connector_metadata
        self.connector.handle_preemptions(meta)
        for block in out.new_block_ids_to_zero or ():
            self.cache[block] = 0
        self.connector.bind_connector_metadata(meta)
        # vLLM loads before the forward only in a step the scheduler marked as having a synchronous load
        # (both runners: KVConnectorModelRunnerMixin._get_kv_connector_output, gpu/kv_connector.py).
        assert out.has_sync_kv_loads or not meta.swap_in, "a step with swap-ins that vLLM would load after its forward"
        if out.has_sync_kv_loads:
            self.connector.start_load_kv(None)
        for rid, n in out.num_scheduled_tokens.items():
            request, blocks = s.requests[rid], s.kv_cache_manager.get_block_ids(rid)[0]
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                self.cache[blocks[pos // BLOCK], :, pos % BLOCK] = kv_value(request.all_token_ids[pos], pos)
        if not out.has_sync_kv_loads:
            self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()


def kv_value(token: int, pos: int) -> float:
    return float(token * 1024 + pos)  # exact in float32 for the tokens and positions here


def kv_matches(s, rid: str) -> bool:
    """Every computed position of `rid` holds the KV its token and position would have."""
    request, blocks = s.requests[rid], s.kv_cache_manager.get_block_ids(rid)[0]
    cache = s.fake_worker.cache
    return all(float(cache[blocks[p // BLOCK], 0, p % BLOCK]) == kv_value(request.all_token_ids[p], p)
               for p in range(request.num_computed_tokens))


def request(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   block_hasher=HASHER, resumable=True)


def step(s):
    out = s.schedule()
    if getattr(s, "fake_worker", None) is not None:
        s.fake_worker.execute(s, out)
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[SAMPLED] for _ in ids])
    s.update_from_output(out, runner)
    return out


def run_until_paused(s, rid: str, limit: int = 50) -> None:
    for _ in range(limit):
        step(s)
        if s.requests[rid].status == PAUSED:
            return
    raise AssertionError(f"{rid} never paused")


def resume(s, rid: str, appended: list[int], max_tokens: int = 2):
    """The next chunk of a session: the last sampled token (vLLM drops it) and the tool's result."""
    s.add_request(request(rid, [SAMPLED, *appended], max_tokens))
    return step(s)


def free_blocks(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


# -- cases ------------------------------------------------------------------------------------------

def case_preserve_keeps_a_paused_sessions_blocks():
    s = make("preserve")
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    held = free_blocks(s)
    for _ in range(5):
        step(s)
    assert free_blocks(s) == held, "a preserved session's blocks moved"
    assert s.requests["a"].num_computed_tokens == 101
    out = resume(s, "a", prompt(20, 5000))
    assert out.num_scheduled_tokens["a"] == 21, f"resume computed {out.num_scheduled_tokens['a']} tokens, not 21"
    assert s.counters["discarded_tokens"] == 0


def case_discard_frees_and_resume_recomputes_only_past_the_prefix_hit():
    s = make("discard")
    start = free_blocks(s)
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    step(s)  # the plan runs before each step's scheduling
    assert free_blocks(s) == start, "a discarded session still holds blocks"
    assert s.requests["a"].num_computed_tokens == 0
    assert s.counters["discarded_tokens"] == 101
    out = resume(s, "a", prompt(20, 5000))
    # 101 tokens had KV; 6 full blocks (96 tokens) are still cached, so 122 - 96 tokens are computed.
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["a"].num_computed_tokens == 96, f"prefix hit of {new['a'].num_computed_tokens}, not 96"
    assert out.num_scheduled_tokens["a"] == 122 - 96
    assert s.counters["recomputed_tokens"] == 101 - 96


def case_a_resumed_discarded_session_has_the_same_tokens_as_a_preserved_one():
    contexts = {}
    for policy in ("preserve", "discard"):
        s = make(policy)
        s.add_request(request("a", prompt(50)))
        run_until_paused(s, "a")
        step(s)
        resume(s, "a", prompt(10, 5000), max_tokens=3)
        run_until_paused(s, "a")
        contexts[policy] = list(s.requests["a"].all_token_ids)
    assert contexts["discard"] == contexts["preserve"], "the context differs after a discard"
    assert len(contexts["preserve"]) == 50 + 2 + 10 + 3


def case_reclaim_takes_paused_kv_before_preempting_a_running_request():
    s = make("preserve", num_blocks=16)  # 256 tokens
    s.add_request(request("paused", prompt(120)))
    run_until_paused(s, "paused")
    s.add_request(request("running", prompt(100, 3000), max_tokens=60))
    for _ in range(70):  # its decode needs more blocks than are left beside the paused session's
        step(s)
    assert s.requests["running"].num_preemptions == 0, "a running request was preempted"
    assert s.counters["num_reclaims"] == 1 and s.counters["reclaimed_tokens"] == 121
    assert s.requests["paused"].num_computed_tokens == 0


def case_a_pool_of_paused_sessions_never_deadlocks():
    s = make("preserve", num_blocks=16)
    for i in range(3):
        s.add_request(request(f"p{i}", prompt(70, 1000 * (i + 1))))
    for _ in range(10):
        step(s)
    assert all(s.requests[f"p{i}"].status == PAUSED for i in range(3))
    s.add_request(request("new", prompt(100, 9000), max_tokens=3))
    for _ in range(10):
        step(s)
    assert "new" in s.requests and s.requests["new"].status == PAUSED, "a new request waited behind paused KV"
    assert s.counters["num_reclaims"] >= 1


def case_paused_sessions_hold_no_running_seat():
    """More paused sessions than max_num_seqs, their KV still on the device: new work and resumes still
    run (vLLM counts a session waiting for input as a running seat; the server hung after the 64th
    pause), and each paused session is reported to the model runner as preempted, so a runner that keeps
    a slot per request (vLLM's V2 runner) frees it too."""
    s = make("preserve", max_num_seqs=2)
    told = set()  # the ids sent to the model runner as preempted
    for i in range(5):
        s.add_request(request(f"p{i}", prompt(20, 1000 * (i + 1))))
        for _ in range(10):
            told |= step(s).preempted_req_ids or set()
            if s.requests[f"p{i}"].status == PAUSED:
                break
        assert s.requests[f"p{i}"].status == PAUSED, f"p{i} waited behind {i} paused sessions"
    told |= step(s).preempted_req_ids or set()
    assert told == {f"p{i}" for i in range(5)}, f"the model runner was told {sorted(told)} left its batch"
    assert all(s.requests[f"p{i}"].num_computed_tokens == 21 for i in range(5)), "a paused session lost its KV"
    out = resume(s, "p0", prompt(5, 9000))
    assert out.num_scheduled_tokens.get("p0") == 6, "the resume did not run"
    run_until_paused(s, "p0")
    s.add_request(request("new", prompt(30, 7000)))
    run_until_paused(s, "new")
    assert len(s.running) == 0 and s.get_num_unfinished_requests() == 0, "paused sessions count as unfinished work"


def case_paused_sessions_wait_outside_vllms_queues():
    """A paused session is parked outside vLLM's queues until its next chunk (vLLM would scan every one of
    them every step, skipping it); its resume and its end find it, the counts stay vLLM's, and an engine
    with only parked sessions takes no step (with a KV connector vLLM takes a request in no queue for a
    finished one awaiting cleanup: the engine would step without end, planning the fresh pauses away)."""
    s = make("infercept", host_blocks=64)
    for i in range(4):
        s.add_request(request(f"p{i}", prompt(20, 1000 * (i + 1))))
    for i in range(4):
        run_until_paused(s, f"p{i}")
    assert not s.has_requests(), "the engine core would step while only parked sessions are left"
    step(s)  # the plan: some may leave the device
    assert not s.waiting and not s.kv_holding_waiting and not s.deferred_waiting, "a paused session is queued"
    assert s.num_waiting_for_streaming_input == 0 and s.get_num_unfinished_requests() == 0
    assert s.get_request_counts() == (0, 0) and not s.has_requests()
    out = resume(s, "p1", prompt(5, 9000))
    assert "p1" in out.num_scheduled_tokens, "the resume did not run"
    run_until_paused(s, "p1")
    assert not s.waiting and not s.kv_holding_waiting
    s.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    assert "p2" not in s.requests and s.num_waiting_for_streaming_input == 0
    s.add_request(request("new", prompt(30, 7000)))
    run_until_paused(s, "new")
    assert s.get_num_unfinished_requests() == 0 and not s.has_requests()
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # (vLLM's shutdown)
    assert not s.requests and not s._parked and s.num_waiting_for_streaming_input == 0


def case_the_kv_report_carries_only_what_changed():
    """The per-step report to the worker names only the sessions whose KV moved, paused, resumed or
    ended since the last one (None: no longer paused): a step with thousands paused and nothing changed
    sends nothing, and the reports, merged as the backend merges them, are `state()`."""
    sent = []
    s = make("preserve")
    s.channel = SimpleNamespace(poll=lambda: False, send=sent.append)
    merged: dict = {}

    def merge():  # as the backend merges them (VllmBackend._on_message)
        for msg in sent:
            for rid, where in msg["paused"].items():
                if where is None:
                    merged.pop(rid, None)
                else:
                    merged[rid] = where
        sent.clear()
        return merged

    for i in range(3):
        s.add_request(request(f"p{i}", prompt(20, 1000 * (i + 1))))
    for i in range(3):
        run_until_paused(s, f"p{i}")
    step(s)
    assert merge() == s.state()["paused"] and len(merged) == 3
    step(s)
    assert not sent, f"a step that changed nothing sent {sent}"
    s._leave_device(s.pauses["p1"], reclaimed=False)
    step(s)
    assert [set(m["paused"]) for m in sent] == [{"p1"}], sent
    assert merge() == s.state()["paused"] and merged["p1"] == [0, 0, 21]
    resume(s, "p0", prompt(5, 9000), max_tokens=4)
    assert "p0" not in merge() and merged == s.state()["paused"]
    run_until_paused(s, "p0")
    step(s)
    assert merge() == s.state()["paused"] and merged["p0"] == [s.requests["p0"].num_computed_tokens, 0, 0]
    s.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    step(s)
    assert merge() == s.state()["paused"] == {"p0": merged["p0"], "p1": [0, 0, 21]}


def case_stock_vllm_deadlocks_on_the_same_pool():
    """The same pool under vLLM's own scheduler: the new request never runs (the upstream report); this
    is what the case above prevents, and shows that case can fail."""
    s = make(None, num_blocks=16, cls=Scheduler)
    for i in range(3):
        s.add_request(request(f"p{i}", prompt(70, 1000 * (i + 1))))
    for _ in range(10):
        step(s)
    s.add_request(request("new", prompt(100, 9000), max_tokens=3))
    for _ in range(10):
        step(s)
    assert s.requests["new"].num_computed_tokens == 0, "stock vLLM admitted it: the deadlock is gone upstream"


def case_infercept_discards_long_pauses_and_preserves_short_ones():
    s = make("infercept", num_blocks=32)  # the pool is wanted: ample-memory preserve does not hold
    s.add_request(request("short", prompt(200)))
    s.add_request(request("long", prompt(200, 4000)))
    run_until_paused(s, "short")
    run_until_paused(s, "long")
    s._on_message({"op": "pause", "id": "short", "tool": "calc", "expected_s": 0.001})
    s._on_message({"op": "pause", "id": "long", "tool": "human", "expected_s": 600.0})
    step(s)
    assert s.requests["short"].num_computed_tokens == 201, "the short pause was not preserved"
    assert s.requests["long"].num_computed_tokens == 0, "the long pause was not discarded"
    assert s.state()["paused"] == {"short": [201, 0, 0], "long": [0, 0, 201]}


def case_the_policy_runs_without_the_parts_only_the_native_engine_runs():
    """A name asking for admission or a queue order other than arrival is refused by the scheduler as by
    the start-up check; `infercept` runs whole, every part as its class has it."""
    for name, part in (("infercept+admission", "+admission"), ("swap+las-priority", "+las-priority"),
                       ("infercept-paper+admission", "+admission")):
        message = refused(lambda: make(name))
        assert part in message and "native engine" in message, message
    policy = make("infercept").intercept_policy
    assert (policy.prefetch, policy.admission, policy.priority) == (True, False, "arrival")
    assert policy.label == "infercept", policy.label
    assert (policy.expected_waste, policy.deferred_swap, policy.ample_preserve, policy.preemption) == \
        (True, True, "by-copy-overlap", "swap")


def paused_for_an_hour(policy: str, profile: Profile = PROFILE):
    """Session "long" (201 tokens of KV) paused on a tool the client says lasts an hour, no host tier,
    in a pool of 64 blocks (1,024 tokens): room for all queued work (its 13 blocks held, about 800 tokens
    free, one step's budget 256)."""
    s = make(policy, profile=profile)
    s.add_request(request("long", prompt(200)))
    run_until_paused(s, "long")
    s._on_message({"op": "pause", "id": "long", "tool": "human", "expected_s": 3600.0})
    return s


def case_ample_memory_keeps_paused_kv_on_a_cpu_until_the_pool_is_wanted():
    """`infercept` on a CPU (copies stall the forward pass; ample-preserve by copy overlap): an hour-long
    pause keeps its KV while vLLM's pool has room for all queued work, and is discarded (min-waste) the
    step a waiting request needs the room; without the part it is discarded at once."""
    s = paused_for_an_hour("infercept")
    for _ in range(3):
        step(s)
    assert s.requests["long"].num_computed_tokens == 201, "discarded while the pool had room for everything"
    s.add_request(request("big", prompt(600, 20000), max_tokens=1))  # 600 + 256 > ~800 free: the room is wanted
    step(s)
    assert s.requests["long"].num_computed_tokens == 0, "kept once a waiting request wanted the room"
    assert s.state()["paused"]["long"] == [0, 0, 201]
    s = paused_for_an_hour("infercept+no-ample-preserve")
    step(s)
    assert s.requests["long"].num_computed_tokens == 0, "min-waste kept an hour-long pause"


def case_ample_no_discard_keeps_what_min_waste_would_discard_while_the_pool_has_room():
    """On a GPU (copies overlap the forward pass) `+ample-no-discard` turns min-waste's discards into
    preserves while the pool has room, as `infercept` does there; `infercept-paper` discards."""
    gpu = Profile.from_dict(PROFILE.to_dict() | {"device": "cuda"})
    for policy, kept in (("infercept-paper+ample-no-discard", True), ("infercept", True), ("infercept-paper", False)):
        s = paused_for_an_hour(policy, gpu)
        step(s)
        assert (s.requests["long"].num_computed_tokens == 201) is kept, (policy, s.state()["paused"])


def case_no_profile_no_plan():
    s = make("discard", profile=None)
    s.add_request(request("a", prompt(40)))
    run_until_paused(s, "a")
    step(s)
    assert s.requests["a"].num_computed_tokens == 41, "discarded without a profile"


def case_ending_a_discarded_session_frees_everything():
    s = make("discard")
    start = free_blocks(s)
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(s)
    assert "a" not in s.requests and not s.pauses and free_blocks(s) == start
    assert len(s.waiting) == 0 and len(s.kv_holding_waiting) == 0


def case_measured_pause_feeds_the_estimator():
    s = make("preserve")
    s.add_request(request("a", prompt(20)))
    run_until_paused(s, "a")
    s._on_message({"op": "pause", "id": "a", "tool": "search"})
    resume(s, "a", prompt(5, 5000))
    assert len(s.estimator.history("search")) == 1


def case_the_tool_history_records_the_pause_until_the_result_arrived():
    """The result's arrival time (`{"op": "result"}`, sent by the worker ahead of the input) ends the
    pause in the history, not the step at which vLLM hands the scheduler the next chunk."""
    s = make("preserve")
    s.add_request(request("a", prompt(20)))
    run_until_paused(s, "a")
    s._on_message({"op": "pause", "id": "a", "tool": "search"})
    paused_at = s.pauses["a"].paused_at
    s._on_message({"op": "result", "id": "a", "at": paused_at + 0.001})
    time.sleep(0.05)  # the step in flight
    resume(s, "a", prompt(5, 5000))
    (recorded,) = s.estimator.history("search")
    assert abs(recorded - 0.001) < 1e-9, recorded


def case_swap_moves_a_paused_sessions_kv_to_the_host_and_back():
    s = make("swap", num_blocks=16, host_blocks=32)
    start = free_blocks(s)
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    step(s)  # planned, copied out this step, device blocks freed
    assert free_blocks(s) == start, "a swapped session still holds device blocks"
    assert s.state()["paused"] == {"a": [0, 101, 0]}
    s.add_request(request("b", prompt(200, 3000), max_tokens=3))  # takes over (and evicts) a's old blocks
    run_until_paused(s, "b")
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out = resume(s, "a", prompt(20, 5000))
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["a"].num_computed_tokens == 101, f"{new['a'].num_computed_tokens} tokens loaded or cached, not 101"
    assert out.num_scheduled_tokens["a"] == 21
    counters = s.state()["counters"]
    # Loaded from the host: whatever b's blocks evicted from the prefix cache (whole blocks).
    assert counters["recomputed_tokens"] == 0 and 0 < counters["swapped_in_tokens"] <= 101, counters
    assert (101 - counters["swapped_in_tokens"]) % BLOCK == 0, counters
    assert kv_matches(s, "a"), "the KV loaded from the host is not the KV the session had"


def case_reclaim_swaps_paused_kv_when_a_copy_is_cheaper_than_a_recompute():
    s = make("preserve+swap-preemption", num_blocks=16, host_blocks=32)  # the plan preserves every pause
    s.add_request(request("paused", prompt(120)))
    run_until_paused(s, "paused")
    s.add_request(request("running", prompt(100, 3000), max_tokens=60))
    for _ in range(70):
        step(s)
    assert s.requests["running"].num_preemptions == 0, "a running request was preempted"
    assert s.counters["num_reclaims"] == 1 and s.counters["num_swaps"] == 1, s.counters
    assert s.counters["discarded_tokens"] == 0 and s.state()["paused"]["paused"] == [0, 121, 0]
    resume(s, "paused", prompt(5, 7000))
    assert s.counters["recomputed_tokens"] == 0 and kv_matches(s, "paused")


def case_a_full_host_pool_means_a_discard():
    s = make("swap", num_blocks=16, host_blocks=4)  # 64 tokens of room: a 101-token context does not fit
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    step(s)
    assert s.state()["paused"] == {"a": [0, 0, 101]}, s.state()
    assert s.counters["num_swaps"] == 0 and s.counters["discarded_tokens"] == 101
    assert s.host_tier.free_host_tokens == 64


def paused_behind_a_slow_copy():
    """Session "a" (101 tokens of KV) paused for an hour under `infercept`, with a copy rate (10 MB/s) at
    which a decode-sized step's swap budget is ~48 tokens: its swap takes several steps. The copies are
    priced as overlapping the forward pass (a GPU's): priced as stalls, so slow a copy would cost the
    batch more than recomputing these 101 tokens, and the policy would discard instead."""
    slow = Profile.from_dict(PROFILE.to_dict() | {"d2h_bytes_per_s": 1e7, "h2d_bytes_per_s": 1e7, "copy_overlap": 1.0})
    s = make("infercept", num_blocks=16, host_blocks=32, profile=slow)  # 16 blocks: the pool is wanted
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    s._on_message({"op": "pause", "id": "a", "expected_s": 3600.0})
    return s


def case_a_context_larger_than_the_swap_budget_leaves_over_several_steps():
    s = paused_behind_a_slow_copy()
    held = []
    for _ in range(6):
        step(s)  # ~48 tokens of copy per decode-sized step at 10 MB/s
        held.append((s.requests["a"].num_computed_tokens, s.host_tier.host_tokens("a")))
        if s.requests["a"].num_computed_tokens == 0:
            break
    assert len(held) > 1 and held[0][0] == 101 and 0 < held[0][1] < 101, f"not a swap in parts: {held}"
    assert held[-1] == (0, 101), f"the swap never completed: {held}"
    resume(s, "a", prompt(5, 5000))
    assert s.counters["recomputed_tokens"] == 0 and kv_matches(s, "a")


def case_a_session_resumed_mid_swap_keeps_its_device_kv():
    s = paused_behind_a_slow_copy()
    step(s)
    assert 0 < s.host_tier.host_tokens("a") < 101
    out = resume(s, "a", prompt(5, 5000))
    assert out.num_scheduled_tokens["a"] == 6 and s.host_tier.host_tokens("a") == 0
    step(s)
    assert s.host_tier.free_host_tokens == 32 * BLOCK, "the partial copy's host blocks were not given back"
    assert kv_matches(s, "a")


def swapped_out_for_an_hour(policy: str = "infercept", max_num_seqs: int = 16, profile: Profile = PROFILE):
    """Session "a" (101 tokens of KV) paused on a tool the client says lasts an hour and swapped to the
    host; then "b" took over most of its old blocks, so the prefix cache holds only its first few."""
    s = make(policy, num_blocks=16, host_blocks=32, max_num_seqs=max_num_seqs, profile=profile)
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    s._on_message({"op": "pause", "id": "a", "tool": "search", "expected_s": 3600.0})
    for _ in range(6):  # (a copy slower than a step's budget takes several)
        step(s)
        if s.state()["paused"]["a"] == [0, 101, 0]:
            break
    assert s.state()["paused"]["a"] == [0, 101, 0], s.state()
    s.add_request(request("b", prompt(200, 3000), max_tokens=3))
    run_until_paused(s, "b")
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    step(s)
    assert s.state()["paused"]["a"] == [0, 101, 0], "brought back an hour ahead of its resume"
    return s


def result_due_in(s, rid: str, seconds: float) -> None:
    """The client's hint, learned now: the tool's result comes `seconds` from now."""
    pause = s.pauses[rid]
    s._on_message({"op": "pause", "id": rid, "tool": pause.tool,
                   "expected_s": time.monotonic() - pause.paused_at + seconds})


def case_prefetch_brings_host_kv_back_before_the_resume_which_finds_it_on_the_device():
    """`infercept` (prefetch on): once the result is near, the session's KV comes back from the host in one
    step, past what the prefix cache still holds, position for position; the plan keeps it there, the
    host blocks go back to the pool, and the resume starts with every token computed, loading nothing."""
    s = swapped_out_for_an_hour()
    loaded = s.host_tier.counters["swapped_in_tokens"]
    result_due_in(s, "a", 0.05)
    out = step(s)
    assert s.state()["paused"]["a"] == [101, 0, 0], s.state()
    assert out.has_sync_kv_loads and 0 < s.host_tier.counters["swapped_in_tokens"] - loaded < 101, \
        "not a copy of what the prefix cache lost"
    assert kv_matches(s, "a"), "the KV brought back is not the KV the session had"
    step(s)
    assert s.state()["paused"]["a"] == [101, 0, 0], "the plan sent it away again"
    assert s.host_tier.free_host_tokens == 32 * BLOCK and not s.host_tier.copies
    loaded = s.host_tier.counters["swapped_in_tokens"]
    out = resume(s, "a", prompt(20, 5000))
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["a"].num_computed_tokens == 101 and out.num_scheduled_tokens["a"] == 21, new["a"]
    assert s.host_tier.counters["swapped_in_tokens"] == loaded and s.counters["recomputed_tokens"] == 0
    assert kv_matches(s, "a")


def case_prefetch_acts_one_step_ahead_whatever_the_swap_budget():
    """At a copy rate (10 MB/s) whose swap budget takes several steps for the 101 tokens, the native
    engine's lead would count those steps; here the copy back is whole, in one step, and the plan keeps
    prefetched KV only while its resume is a step near, so the session stays on the host until then.
    Copies priced as overlapping, as in `paused_behind_a_slow_copy`."""
    slow = Profile.from_dict(PROFILE.to_dict() | {"d2h_bytes_per_s": 1e7, "h2d_bytes_per_s": 1e7, "copy_overlap": 1.0})
    s = swapped_out_for_an_hour(profile=slow)
    s.add_request(request("runner", prompt(20, 20000), max_tokens=50))  # steps with a forward: a budget
    step(s)
    lead = s._step_lead_s() + slow.t_swap(101, "in")
    result_due_in(s, "a", 2 * lead)
    step(s)
    assert s.state()["paused"]["a"] == [0, 101, 0], "brought back steps ahead of its resume"
    result_due_in(s, "a", 0.5 * lead)
    step(s)
    assert s.state()["paused"]["a"] == [101, 0, 0], s.state()
    step(s)
    assert s.state()["paused"]["a"] == [101, 0, 0], "the plan sent it away again"
    assert kv_matches(s, "a")


def case_without_prefetch_the_resume_loads_host_kv_itself():
    s = swapped_out_for_an_hour("infercept+no-prefetch")
    result_due_in(s, "a", 0.05)
    step(s)
    assert s.state()["paused"]["a"] == [0, 101, 0], s.state()
    out = resume(s, "a", prompt(20, 5000))
    assert out.has_sync_kv_loads and s.host_tier.counters["swapped_in_tokens"] > 0
    assert s.counters["recomputed_tokens"] == 0 and kv_matches(s, "a")


def case_an_idle_engine_steps_for_host_kv_due_back_and_asks_to_be_woken_before_then():
    """With nothing running or waiting vLLM's engine core sleeps until `has_requests`: it owes a step to
    host KV due back and otherwise asks the worker to wake it when the copy back may first be due (the
    session's predicted resume less the copy and a step)."""
    s = swapped_out_for_an_hour()
    sent = []
    s.channel = SimpleNamespace(poll=lambda: False, send=sent.append)
    def wakes() -> list[float]:
        return [m["at"] for m in sent if m["op"] == "wake"]

    assert not s.has_requests(), "the engine steps for a resume an hour away"
    assert len(wakes()) == 1 and wakes()[0] > time.monotonic() + 3000, wakes()
    result_due_in(s, "a", 5.0)
    assert not s.has_requests()
    wake = wakes()[-1]
    due = s.pauses["a"].paused_at + s.pauses["a"].hint_s - PROFILE.t_swap(101, "in") - s._step_lead_s()
    assert abs(wake - due) < 0.05, (wake, due)
    assert not s.has_requests() and len(wakes()) == 2, "asked again for the same wake"
    result_due_in(s, "a", 0.05)
    assert s.has_requests(), "no step for host KV due back"
    step(s)
    assert s.state()["paused"]["a"] == [101, 0, 0] and kv_matches(s, "a")
    assert not s.has_requests()


def case_prefetch_takes_only_blocks_the_next_step_does_not_need():
    """A request waiting for vLLM's one seat keeps the room the next step may admit it into (its 8 blocks
    of the 14 free, less than a step's budget; a running request's next token one more): the host KV
    due back (7 blocks) waits."""
    s = swapped_out_for_an_hour(max_num_seqs=1)
    s.add_request(request("runner", prompt(20, 20000), max_tokens=50))
    step(s)
    s.add_request(request("waiter", prompt(120, 30000)))
    result_due_in(s, "a", 0.05)
    step(s)
    assert s.requests["waiter"].status == RequestStatus.WAITING and free_blocks(s) >= 7
    assert s.state()["paused"]["a"] == [0, 101, 0], "prefetch took the room a waiting request needs"


def case_ending_a_swapped_session_frees_its_host_blocks():
    s = make("swap", host_blocks=32)
    s.add_request(request("a", prompt(100)))
    run_until_paused(s, "a")
    step(s)
    assert s.host_tier.host_tokens("a") == 101
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(s)
    step(s)
    assert s.host_tier.free_host_tokens == 32 * BLOCK and not s.host_tier.copies


def paused_on_a_slow_tool(event_driven: bool) -> tuple[list, list]:
    """A scripted run under `heuristic-preserve` (preserve while the expected remaining pause is under
    2 s; no host tier, so discard after) on a virtual clock, 50 ms a step: twelve sessions pause, in two
    batches, on a tool whose past calls took 1.5 s; one is told later that it waits for a human for
    100 s (a hint its estimate reads at once); one resumes, adding a duration to the tool's history, and
    pauses again. Returns, per step, where each paused session's KV is (computed tokens, on the device)
    and, per plan, the sessions the policy's plan saw and those holding device KV then. `event_driven`
    False: the index plans every holder every step."""
    clock = [1000.0]
    real_time, ours.time = ours.time, SimpleNamespace(monotonic=lambda: clock[0])
    try:
        s = make("heuristic-preserve", num_blocks=128)
        s.paused_kv.event_driven = event_driven
        for _ in range(3):
            s.estimator.observe("slow", 1.5)
        plan, seen = s.intercept_policy.plan, []

        def counting_plan(paused, iteration, profile):
            holders = {rid for rid, p in s.pauses.items() if p.frontier is None}
            seen.append((sorted(ours.external_id(p.request_id) for p in paused), sorted(holders)))
            return plan(paused, iteration, profile)

        s.intercept_policy.plan = counting_plan
        told, where = set(), []
        for k in range(90):
            if k in (0, 10):
                for i in range(k // 10 * 6, k // 10 * 6 + 6):
                    s.add_request(request(f"s{i}", prompt(20, 1000 * (i + 1))))
            if k == 20:
                s._on_message({"op": "pause", "id": "s1", "tool": "human", "expected_s": 100.0})
            if k == 25:
                s.add_request(request("s2", [SAMPLED, *prompt(3, 9000)]))
                told.discard("s2")
            step(s)
            clock[0] += 0.05
            for rid in sorted(set(s.pauses) - told):  # the worker names each pause's tool
                s._on_message({"op": "pause", "id": rid, "tool": "slow"})
                told.add(rid)
            where.append({rid: (p.request.num_computed_tokens, p.frontier is None) for rid, p in s.pauses.items()})
        assert len(s.estimator.history("slow")) == 4, "s2's pause did not reach the tool's history"
        return where, seen
    finally:
        ours.time = real_time


def case_paused_sessions_on_a_slow_tool_are_planned_only_when_their_decision_may_change():
    """The paused-KV index (`engine/paused_kv.py`) on the vLLM side: once preserved under the policy's
    guard, sessions waiting on a slow tool are not planned again until the guard may be crossed (their
    estimate's next jump, the bound's timer, a new hint, a new duration in their tool's history), and
    every step leaves every session's KV where planning every session every step leaves it."""
    reference, every_step = paused_on_a_slow_tool(event_driven=False)
    events, planned = paused_on_a_slow_tool(event_driven=True)
    assert len(events) == len(reference)
    for k, (a, b) in enumerate(zip(reference, events)):
        assert a == b, f"step {k}: planning every step left {a}, event-driven planning {b}"
    # The scenario decides something: all twelve preserved at once, s1 discarded once a human's turn is
    # expected, every session discarded in the end (its pause outgrew 2 s).
    assert max(sum(on_device for _, on_device in w.values()) for w in reference) == 12, reference
    assert reference[19]["s1"] == (21, True) and reference[20]["s1"] == (0, False), "the hint did not discard s1"
    assert reference[-1] == {f"s{i}": (0, False) for i in range(12)}, reference[-1]
    # Planning every step sees every holder every step; the index, only fresh pauses and woken ones.
    assert all(seen == holders for seen, holders in every_step), every_step
    assert len(planned) == len(every_step) and all(set(a) <= set(h) for a, h in planned), planned
    quiet = sum(1 for seen, holders in planned if not seen and len(holders) >= 7)
    assert quiet >= 20, f"only {quiet} steps with 7 or more holders planned none of them: {planned}"
    total, reference_total = sum(len(a) for a, _ in planned), sum(len(a) for a, _ in every_step)
    assert total * 4 < reference_total, (total, reference_total, planned)


def run_script(s, rid: str, script: list[int]):
    """Sample `script`'s tokens for `rid`, one per step, until its turn ends: (tokens taken, its last output)."""
    for taken, token in enumerate(script, 1):
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[token] for _ in ids])
        outputs = [o for eco in s.update_from_output(out, runner).values() for o in eco.outputs if o.request_id == rid]
        if outputs and outputs[-1].finish_reason is not None:
            return taken, outputs[-1]
    raise AssertionError(f"{rid}'s turn never ended")


def where_the_output_stage_ends(tokenizer, context: list[int], script: list[int], params: OurParams,
                                intercept: InterceptParams | None) -> int:
    """The tokens of `script` the backend's output stage (the native engine's too) takes before its turn ends."""
    stage = TurnOutput(tokenizer, context, params, intercept)
    for taken, token in enumerate(script, 1):
        stop = stage.add(token)
        if stop is not None or stage.decide(stopped=False).action is not Action.GO_ON:
            return taken
    return len(script)


def turn_case(text: str, params: OurParams, intercept: InterceptParams | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    context, script = prompt(20), tokenizer.encode(text, add_special_tokens=False)
    rule = TurnRule.of(params, intercept)
    s = make("preserve")
    s.add_request(Request("a", context, SamplingParams(max_tokens=100, ignore_eos=True,
                                                       extra_args={TURN_RULE_KEY: rule.as_dict()}),
                          None, block_hasher=HASHER, resumable=True))
    taken, last = run_script(s, "a", script)
    expected = where_the_output_stage_ends(tokenizer, context, script, params, intercept)
    assert taken == expected < len(script), f"the turn ended after {taken} tokens, the output stage's after {expected}"
    assert s.requests["a"].status == PAUSED, "the session did not wait for its next chunk"
    return s, last


def case_a_stop_string_ends_a_sessions_turn_at_the_token_the_output_stage_does():
    _, last = turn_case("One, two, three, four, five, six, seven.", OurParams(stop=["four"]),
                        InterceptParams(pause_on_stop=True))
    assert last.stop_reason == "four" and str(last.finish_reason) == "stop", last


def case_tool_calls_end_a_sessions_turn_once_the_model_moves_past_them():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    s, last = turn_case(f"Let me look.{call}\nAnd then the model writes on about the weather.", OurParams(),
                        InterceptParams(tool_parser="hermes"))
    assert last.stop_reason is None and str(last.finish_reason) == "stop", last
    resume(s, "a", [5, 6])  # the next turn carries no rule: nothing watches it
    assert "a" not in s.turn_watches


def vllm_tool_calls():
    from vllm.tokenizers import get_tokenizer

    from engine.vllm_backend.tool_calls import VllmToolCalls
    return VllmToolCalls(get_tokenizer(MODEL), MODEL)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def case_vllms_tool_parsers_read_a_turn_as_vllms_chat_serving_does():
    """The worker's parse of an ended turn (tool_calls.py): the text without the EOS that ended it, read by
    vLLM's parser of the turn's rule; the calls with vLLM's ids, the content outside them."""
    from engine.vllm_backend.tool_calls import CallRule

    parsers = vllm_tool_calls()
    tokenizer = parsers.tokenizer
    eos = tokenizer.eos_token_id

    def read(name: str, text: str, reasoning: str | None = None, stop_reason=None, end: list[int] = [eos]):
        ids = tokenizer.encode(text, add_special_tokens=False) + end
        rule = CallRule.from_dict({"parser": name, "tools": [WEATHER_TOOL], "reasoning": reasoning})
        return parsers.parse(rule, ids, "stop", stop_reason)

    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    for name, text in (("qwen3_coder", "Let me look.\n" + xml),
                       ("qwen3_json", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris"}}\n</tool_call>'),
                       ("llama4_pythonic", '[get_weather(city="Paris")]')):
        got = read(name, text)
        (call,) = got["calls"]
        assert call[:2] == ["get_weather", '{"city": "Paris"}'] and call[2], (name, got)
        assert (got["content"] or "").strip() in ("", "Let me look."), (name, got)
    assert read("qwen3_coder", "It is sunny.") == {"calls": [], "content": "It is sunny."}
    # The thinking is read first, by vLLM's reasoning parser of the same name (as vLLM serves the two): the
    # calls and the content come after it.
    thought = read("qwen3_coder", "<think>The user asks for the weather.</think>\n" + xml, reasoning="qwen3")
    assert [c[0] for c in thought["calls"]] == ["get_weather"] and not thought["content"], thought
    answer = read("qwen3_coder", "<think>No tool needed.</think>\nIt is sunny.", reasoning="qwen3")
    assert answer["calls"] == [] and answer["content"].strip() == "It is sunny.", answer
    # A stop string ends the text before it; the turn's last token is text, not a stop token, then.
    cut = read("qwen3_coder", xml + "\nObservation: none", stop_reason="\nObservation:", end=[])
    assert [c[0] for c in cut["calls"]] == ["get_weather"], cut


def case_vllms_parser_streams_a_turns_content_as_it_is_written_and_never_its_calls():
    """The worker's read of a turn as it is written (tool_calls.ContentStream), each token an output of its
    own: the content vLLM's parser streams joins to the content of the whole-turn parse (leading and
    trailing blanks aside: the output stage strips it), ends before the call and shows none of it, and
    leaves the thinking out; an answer streams whole but its last token, which the whole-turn parse reads."""
    from engine.vllm_backend.tool_calls import CallRule

    parsers = vllm_tool_calls()
    tokenizer = parsers.tokenizer
    prompt = tokenizer.encode("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")

    def streamed_and_whole(name: str, text: str, reasoning: str | None = None) -> tuple[list[str], str]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        rule = CallRule.from_dict({"parser": name, "tools": [WEATHER_TOOL], "reasoning": reasoning})
        stream = parsers.stream(rule, prompt)
        deltas = [stream.add([t]) for t in ids[:-1]]  # the last output reaches the whole-turn parse instead
        whole = parsers.parse(rule, ids + [tokenizer.eos_token_id], "stop", None)
        return [d for d in deltas if d], (whole["content"] or "").strip()

    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    json_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for name, text, content in (("qwen3_coder", "Let me look.\n" + xml, "Let me look."),
                                ("qwen3_json", "Let me look.\n" + json_call, "Let me look."),
                                ("llama4_pythonic", '[get_weather(city="Paris")]', "")):
        deltas, whole = streamed_and_whole(name, text)
        assert "".join(deltas).strip() == whole == content, (name, deltas, whole)
        assert len(deltas) > 1 or not content, (name, deltas)  # as written, not at once
        assert not any(marker in "".join(deltas) for marker in ("<tool", "get_weather", "[get")), (name, deltas)
    for name in ("qwen3_coder", "qwen3_json", "llama4_pythonic"):
        deltas, whole = streamed_and_whole(name, "It is sunny in Paris today.")
        assert "".join(deltas) == "It is sunny in Paris today" and whole == "It is sunny in Paris today.", \
            (name, deltas, whole)
    deltas, whole = streamed_and_whole("qwen3_coder", "<think>The user asks for the weather.</think>\nLet me look.\n"
                                       + xml, reasoning="qwen3")
    assert "".join(deltas).strip() == whole == "Let me look.", (deltas, whole)


def case_the_worker_hands_a_turns_calls_to_the_backend_with_its_last_output():
    """Each turn of a session gathers its own tokens; only its last output (finish_reason set) carries
    the calls vLLM's parser found and the content, and a turn without a rule carries none."""
    from engine.vllm_backend import worker as worker_module

    worker = worker_module.Worker(None, {"engine": {}})
    worker.tool_calls = vllm_tool_calls()
    tokenizer = worker.tool_calls.tokenizer
    rule = {"parser": "qwen3_json", "tools": [WEATHER_TOOL], "reasoning": None}
    call = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                            add_special_tokens=False) + [tokenizer.eos_token_id]

    def out(tokens, finish_reason=None):
        return {"op": "out", "id": "s", "tokens": tokens, "finish_reason": finish_reason, "stop_reason": None}

    worker.follow_calls("s", rule, [1, 2, 3])
    assert worker.with_calls("s", out(call[:5])) == out(call[:5])  # not ended, no content streamed: as it was
    last = worker.with_calls("s", out(call[5:], "stop"))
    assert [c[:2] for c in last["calls"]] == [["get_weather", '{"city": "Oslo"}']], last
    assert "streamed_content" not in last and "s" not in worker.content_streams  # the turn's stream ends with it
    worker.follow_calls("s", rule, [4, 5])  # the resume: a turn of its own, only its tokens read
    cold = tokenizer.encode("It is cold.", add_special_tokens=False) + [tokenizer.eos_token_id]
    streamed = [worker.with_calls("s", out([t])).get("streamed_content", "") for t in cold[:-2]]
    assert "".join(streamed) == "It is cold" and sum(1 for d in streamed if d) > 1, streamed
    answer = worker.with_calls("s", out(cold[-2:], "stop"))
    assert answer["calls"] == [] and answer["content"] == "It is cold.", answer
    worker.follow_calls("s", None, [6])
    assert worker.with_calls("s", out(cold[:2])) == out(cold[:2])  # no rule: nothing read, nothing streamed
    assert "calls" not in worker.with_calls("s", out(call, "stop"))


ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def case_a_forced_turn_is_written_in_the_models_own_call_format():
    """tool_choice required / named with vLLM's parsers (tool_calls.forced_grammar): the grammar of the
    structural tag each parser builds, as llguidance (vLLM's structured outputs here) reads it, takes a
    call of an allowed tool as the model writes it, and neither another tool's call nor plain text; the
    worker gives a forced turn that grammar, an unforced one none. Parsers without a structural tag, or
    with one the grammar cannot write, are refused with the reason."""
    import llguidance
    import llguidance.hf

    from engine.vllm_backend import worker as worker_module
    from engine.vllm_backend.tool_calls import CallRule, forcing_refusals

    parsers = vllm_tool_calls()
    tokenizer = parsers.tokenizer
    vocabulary = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocabulary, llguidance.grammar_from("lark", grammar))
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    calls = {"qwen3_coder": "<tool_call>\n<function={}>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
             "qwen3_json": '<tool_call>\n{{"name": "{}", "arguments": {{"a": 2}}}}\n</tool_call>',
             "longcat": '<longcat_tool_call>\n{{"name": "{}", "arguments": {{"a": 2}}}}\n</longcat_tool_call>',
             "mimo": "<tool_call><function={}><parameter=a>2</parameter></function></tool_call>"}
    for name, call in calls.items():
        required = parsers.forced_grammar(CallRule(name, (WEATHER_TOOL, ADD_TOOL), forced="required"))
        named = parsers.forced_grammar(CallRule(name, (WEATHER_TOOL, ADD_TOOL), forced="add", parallel=False))
        for grammar in (required, named):
            error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar), vocabulary)
            assert not error, (name, error)
        assert accepts(required, call.format("get_weather")) and accepts(required, call.format("add")), name
        assert not accepts(required, "It is sunny."), name
        assert accepts(named, call.format("add")), name
        assert not accepts(named, call.format("get_weather")) and not accepts(named, "It is sunny."), name
    refusals = forcing_refusals()
    assert not set(calls) & set(refusals), refusals
    assert "JSON list" in refusals["llama4_pythonic"] and "minimax_xml" in refusals["minimax_m2"], refusals

    worker = worker_module.Worker(None, {"engine": {}})
    worker.tool_calls = parsers
    fields = {"max_tokens": 8, "structured_outputs": None}
    for forced, grammar in (("add", True), (None, False)):
        worker.follow_calls("f", {"parser": "qwen3_coder", "tools": [WEATHER_TOOL, ADD_TOOL], "forced": forced,
                                  "parallel": forced is None}, [1, 2])
        structured = worker.turn_params("f", dict(fields)).structured_outputs
        assert (structured is not None and "function=add" in structured.grammar) == grammar, structured


def case_the_worker_wakes_vllms_engine_core_when_the_scheduler_asks():
    """A `wake` from the scheduler (its reader thread) arms one timer on the event loop; a later request
    replaces it; when it fires, a read-only call reaches vLLM's engine core (whose loop then asks the
    scheduler whether to step). A pause hint sent to the scheduler wakes it at once."""
    import asyncio

    from engine.vllm_backend import worker as worker_module

    calls = []

    class Engine:
        async def is_sleeping(self):
            calls.append(time.monotonic())
            return False

    async def main():
        worker = worker_module.Worker(None, {"engine": {}})
        worker.llm, worker.loop = Engine(), asyncio.get_running_loop()
        asked = time.monotonic()
        await asyncio.to_thread(worker.wake_engine_at, asked + 0.3)
        await asyncio.to_thread(worker.wake_engine_at, asked + 0.1)  # the scheduler's latest word
        await asyncio.sleep(0.5)
        assert len(calls) == 1 and asked + 0.1 <= calls[0] < asked + 0.3, [c - asked for c in calls]
        worker.policy = SimpleNamespace(send=lambda msg: None)
        worker.handle({"op": "pause", "id": "s", "tool": "search", "expected_s": 2.0})
        await asyncio.sleep(0.05)
        assert len(calls) == 2, "a pause hint did not wake the engine core"

    asyncio.run(main())


def case_an_unknown_or_unfit_tool_parser_is_refused():
    parsers = vllm_tool_calls()
    for name, said in (("qwen3_xmll", "vLLM's are: "), ("deepseek_v3", "tokenizer")):
        try:
            parsers.check(name)
        except ValueError as e:
            assert said in str(e), e
        else:
            raise AssertionError(f"{name} was accepted")
    parsers.check("qwen3_coder")


# The vLLM 0.32.0 signatures of what the worker calls of vLLM's parsers (tool_calls.py).
PARSER_SIGNATURES = {
    "ParserManager.get_parser": "(tool_parser_name: 'str | None' = None, reasoning_parser_name: 'str | None' = None, "
                                "enable_auto_tools: 'bool' = False, model_name: 'str | None' = None, is_harmony: "
                                "'bool' = False, tool_strict_level: 'str' = 'auto', tokenizer: 'TokenizerLike | None' "
                                "= None) -> 'type[Parser] | None'",
}


def case_the_vllm_parser_api_we_call_has_the_signatures_we_were_written_against():
    from vllm.parser.abstract_parser import Parser
    from vllm.parser.parser_manager import ParserManager
    from vllm.tool_parsers import ToolParserManager

    got = str(inspect.signature(ParserManager.get_parser))
    assert got == PARSER_SIGNATURES["ParserManager.get_parser"], f"ParserManager.get_parser{got}"
    assert list(inspect.signature(Parser.parse).parameters) == \
        ["self", "model_output", "request", "enable_auto_tools", "model_output_token_ids"], "Parser.parse changed"
    assert list(inspect.signature(Parser.adjust_request).parameters) == ["self", "request"], "adjust_request changed"
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
    assert list(inspect.signature(get_model_structural_tag).parameters) == \
        ["model", "tools", "tool_choice", "reasoning", "token_suffix", "strict_level"], \
        "get_model_structural_tag changed"
    assert "qwen3_coder" in ToolParserManager.list_registered()


# The vLLM 0.32.0 signatures of what the scheduler overrides or calls (a bump that changes one fails here).
SIGNATURES = {
    "Scheduler.schedule": "(self, throttle_prefills: bool = False) -> vllm.v1.core.sched.output.SchedulerOutput",
    "Scheduler._handle_stopped_request": "(self, request: vllm.v1.request.Request) -> bool",
    "Scheduler._update_request_as_session": "(self, session: vllm.v1.request.Request, update: "
                                            "vllm.v1.request.StreamingUpdate) -> None",
    "Scheduler.finish_requests": "(self, request_ids: str | collections.abc.Iterable[str] | None, "
                                 "finished_status: vllm.v1.request.RequestStatus) -> list[vllm.v1.request.Request]",
    "Scheduler.add_request": "(self, request: vllm.v1.request.Request) -> None",
    "Scheduler._update_request_with_output": "(self, request: vllm.v1.request.Request, new_token_ids: list[int], "
                                             "is_stale: bool = False) -> tuple[list[int], bool]",
    "Scheduler._free_request_blocks": "(self, request: vllm.v1.request.Request)",
    "Scheduler._request_blocks_can_be_freed": "(self, request: vllm.v1.request.Request) -> bool",
    "Scheduler._holds_kv_blocks": "(request: vllm.v1.request.Request) -> bool",
    "Scheduler._is_blocked_waiting_status": "(status: vllm.v1.request.RequestStatus) -> bool",
    "Scheduler._enqueue_waiting_request": "(self, request: vllm.v1.request.Request) -> None",
    "Scheduler.has_finished_requests": "(self) -> bool",
    "Scheduler.update_from_output": "(self, scheduler_output: vllm.v1.core.sched.output.SchedulerOutput, "
                                    "model_runner_output: vllm.v1.outputs.ModelRunnerOutput) -> "
                                    "dict[int, vllm.v1.engine.EngineCoreOutputs]",
    "KVCacheManager.get_computed_blocks": "(self, request: vllm.v1.request.Request) -> "
                                          "tuple[vllm.v1.core.kv_cache_manager.KVCacheBlocks, int, int]",
    "Scheduler.get_request_counts": "(self) -> tuple[int, int]",
    "KVCacheManager.free": "(self, request: vllm.v1.request.Request) -> None",
    "FCFSRequestQueue.add_request": "(self, request: vllm.v1.request.Request) -> None",
    "FCFSRequestQueue.remove_request": "(self, request: vllm.v1.request.Request) -> None",
}
CONNECTOR_SIGNATURES = {
    "get_num_new_matched_tokens": "(self, request: 'Request', num_computed_tokens: int) -> tuple[int | None, bool]",
    "update_state_after_alloc": "(self, request: 'Request', blocks: 'KVCacheBlocks', num_external_tokens: int)",
    "build_connector_meta": "(self, scheduler_output: vllm.v1.core.sched.output.SchedulerOutput) -> "
                            "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata",
    "request_finished": "(self, request: 'Request', block_ids: list[int]) -> tuple[bool, dict[str, typing.Any] | None]",
    "register_kv_caches": "(self, kv_caches: dict[str, torch.Tensor])",
    "handle_preemptions": "(self, kv_connector_metadata: vllm.distributed.kv_transfer.kv_connector.v1.base."
                          "KVConnectorMetadata)",
    "start_load_kv": "(self, forward_context: 'ForwardContext', **kwargs: Any) -> None",
    "KVCacheManager.get_block_ids": "(self, request_id: str) -> tuple[list[int], ...]",
}


def case_the_connector_hooks_we_use_have_the_signatures_and_order_we_were_written_against():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    named = set(host_tier.OVERRIDDEN) | {f"KVCacheManager.{m}" for m in host_tier.KV_CACHE_MANAGER_CALLED}
    assert named == set(CONNECTOR_SIGNATURES), f"the connector's list changed: {sorted(named ^ set(CONNECTOR_SIGNATURES))}"
    changed = []
    for name, expected in CONNECTOR_SIGNATURES.items():
        owner, _, method = name.rpartition(".")
        got = str(inspect.signature(getattr(KVCacheManager if owner else KVConnectorBase_V1, method)))
        if got != expected:
            changed.append(f"{name}{got}")
    assert not changed, "changed in this vLLM: " + "; ".join(changed)
    # The swap-out frees device blocks in the step that copies them: the model runner must copy them out
    # (handle_preemptions) before it zeroes newly allocated blocks (_update_states) and before the loads
    # and the forward (maybe_get_kv_connector_output runs start_load_kv). The CPU runner inherits this.
    source = inspect.getsource(GPUModelRunner.execute_model)
    order = [source.find(s) for s in ("handle_preemptions(", "self._update_states(", "maybe_get_kv_connector_output(")]
    assert -1 not in order and order == sorted(order), f"vLLM's model runner changed its order: {order}"


def _calls(node) -> list[str]:
    """The names of the functions and methods called anywhere in `node` (`a.b.c(...)` -> "c")."""
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            names.append(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def _unguarded_calls(body: list, first: str, then: set[str], taken=lambda test: False) -> list[str]:
    """Calls to any of `then` in the statements `body` (a function's, recursively through its if, with,
    for and try statements) that no call to `first` runs before on every path. A statement holding a
    call to `first` (in a with statement: its items) guards what follows it in the same list and what
    is nested in it (a simple statement holding both counts as guarded); an `if` whose test `taken` accepts
    guards as if it were unconditional."""
    missing: list[str] = []

    def walk(stmts: list, guarded: bool) -> bool:
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                inner = walk(stmt.body, guarded)
                walk(stmt.orelse, guarded)
                missing.extend(c for c in _calls(stmt.test) if c in then and not guarded)
                guarded = guarded or (taken(stmt.test) and inner)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                items = [c for item in stmt.items for c in _calls(item)]
                missing.extend(c for c in items if c in then and not guarded and first not in items)
                guarded = walk(stmt.body, guarded or first in items)
            elif isinstance(stmt, (ast.For, ast.While, ast.Try)):
                handlers = [h.body for h in getattr(stmt, "handlers", [])]
                for block in (stmt.body, stmt.orelse, getattr(stmt, "finalbody", []), *handlers):
                    walk(block, guarded)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            else:  # a simple statement: one holding `first` counts as guarded
                calls = _calls(stmt)
                if not guarded and first not in calls:
                    missing.extend(c for c in calls if c in then)
                guarded = guarded or first in calls
        return guarded

    walk(body, False)
    return missing


def _method(cls, name: str) -> ast.FunctionDef:
    (fn,) = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name)))).body
    return fn


def _order(fn, names: tuple[str, ...]) -> list[int]:
    """The line of the first call to each of `names` in `fn` (-1: none)."""
    lines = {}
    for sub in ast.walk(fn):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                lines[name] = min(lines.get(name, sub.lineno), sub.lineno)
    return [lines.get(name, -1) for name in names]


def case_every_model_runner_vllm_picks_copies_swap_outs_before_new_blocks_are_written_and_loads_before_the_forward():
    """The order the host tier relies on, in each model runner vLLM 0.32 runs on CUDA and on CPU: the V1
    runner (gpu_model_runner.py; the CPU runner inherits its execute_model) and the newer one
    (vllm/v1/worker/gpu/, vLLM's default on CUDA where Triton is). Swap-outs (`handle_preemptions`) run
    before anything writes the blocks the scheduler freed, loads (`start_load_kv`) before the forward in
    a step with a synchronous load (the scheduler marks every step that admits a request with external
    tokens: our loads; `FakeWorker` checks it step by step)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu import kv_connector as v2_connector
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    forwards = {"_model_forward", "model", "run_fullgraph", "run_pw_graph", "run"}
    # V1: swap-outs first (inside `if has_kv_transfer_group():`, true whenever our connector runs), then
    # _update_states (zeroes new blocks, applies copy-on-write copies), then the forward inside the
    # connector's context, which loads before it.
    assert CPUModelRunner.execute_model is GPUModelRunner.execute_model, "the CPU runner has its own execute_model"
    v1 = _method(GPUModelRunner, "execute_model")
    has_group = lambda test: "has_kv_transfer_group" in _calls(test)  # noqa: E731
    early = _unguarded_calls(v1.body, "handle_preemptions", {"_update_states", *forwards}, has_group)
    assert not early, f"vLLM's V1 runner writes blocks or runs the forward before the swap-outs: {early}"
    early = _unguarded_calls(v1.body, "maybe_get_kv_connector_output", forwards)
    assert not early, f"vLLM's V1 runner runs the forward outside the connector's context: {early}"
    assert "_get_kv_connector_output" in _calls(_method(mixin.KVConnectorModelRunnerMixin,
                                                         "maybe_get_kv_connector_output"))
    context = inspect.getsource(mixin.KVConnectorModelRunnerMixin._get_kv_connector_output)
    assert "start_after_forward = not scheduler_output.has_sync_kv_loads" in context, "the V1 load rule changed"
    assert context.index("kv_connector.start_load_kv(") < context.index("yield output"), "V1 loads after the forward"
    # V2: the connector's pre_forward runs before every forward, in a step without tokens too (no_forward),
    # and runs the swap-outs, then a synchronous load.
    run = _method(v2.GPUModelRunner, "execute_model")
    early = _unguarded_calls(run.body, "pre_forward", forwards)
    assert not early, f"vLLM's V2 runner runs the forward before the connector's pre_forward: {early}"
    pre = inspect.getsource(v2_connector.ActiveKVConnector.pre_forward)
    assert pre.index("handle_preemptions(") < pre.index("if scheduler_output.has_sync_kv_loads:") \
        < pre.index("self._start_load_kv()"), "V2's pre_forward changed its order"
    assert "start_load_kv" in _calls(_method(v2_connector.ActiveKVConnector, "_start_load_kv"))
    assert "pre_forward" in _calls(_method(v2_connector.ActiveKVConnector, "no_forward"))
    # ... but V2 zeroes new blocks and applies copy-on-write copies (update_requests) before pre_forward.
    # Neither happens on a KV cache the host tier accepts: vLLM zeroes only a cache with Mamba layers or
    # mixed precisions, and copies on write only for a prefix-cache hit inside a block, which one group
    # never has (its hits are whole blocks).
    update, pre_forward = _order(run, ("update_requests", "pre_forward"))
    assert -1 < update < pre_forward, "V2's order changed: revisit what the host tier assumes of it"
    source = inspect.getsource(v2.GPUModelRunner.update_requests)
    assert "new_block_ids_to_zero" in source and "kv_cache_block_copies" in source
    config, kv = configs(host_bytes=32 * BYTES_PER_BLOCK)
    assert host_tier.unsupported_kv_cache(kv) is None and not kv.needs_kv_cache_zeroing
    assert resolve_kv_cache_block_sizes(kv, config) == (BLOCK, BLOCK), "one group's prefix hits are not whole blocks"


def refused(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("not refused")


def case_a_model_with_two_kv_cache_groups_or_mla_is_refused_at_start():
    """Hybrid and sliding-window models (two KV cache groups) and MLA: the scheduler and the connector
    refuse them at start, naming the policy that serves them; several full-attention layers in one group
    (also as `UniformTypeKVCacheSpecs`) are served, and a host block holds one page of each."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64)
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    for groups, why in (([KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)], "2 KV cache groups"),
                        ([KVCacheGroupSpec(["a"], mla)], "MLAAttentionSpec")):
        config, kv = configs(host_bytes=4096, kv_groups=groups)
        for build in (lambda: make("preserve", kv_groups=groups),
                      lambda: host_tier.HostTierConnector(config, KVConnectorRole.WORKER, kv)):
            message = refused(build)
            assert why in message and "--policy prefix-cache" in message, message
    s = make("preserve", kv_groups=[KVCacheGroupSpec(["a", "b"], full)], host_blocks=8)
    assert host_tier.bytes_per_block(s.kv_cache_config) == 2 * full.page_size_bytes
    uniform = configs(kv_groups=[KVCacheGroupSpec(["a", "b"], UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs={"a": full, "b": full}))])[1]
    assert host_tier.unsupported_kv_cache(uniform) is None
    assert host_tier.bytes_per_block(uniform) == 2 * full.page_size_bytes, "a uniform group's pages counted twice"


def case_the_host_tier_copies_blocks_in_every_kv_cache_layout_vllm_allocates():
    """The connector on KV caches allocated by vLLM's own `allocate_kv_cache` (what both model runners
    hand `register_kv_caches`), in every layout, with vLLM's blocks split into kernel blocks where vLLM
    splits them: swapped-out pages come back into other blocks byte for byte, as vLLM's KVCacheTensor
    addresses them, over host blocks that are not consecutive. 4 blocks and 4 KV heads: the connector
    once took the block dimension to be the first of that size, the heads here under a kernel split."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    assert host_tier.host_runs([0, 1, 5, 2, 3, 9]) == [(0, 0, 2), (2, 5, 1), (3, 2, 2), (5, 9, 1)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=2, dtype=torch.float32)
    num_blocks, layers = 4, ["l0", "l1", "l2"]
    tried = []
    for layout in KVCacheLayout:
        for kernel in (BLOCK, BLOCK // 2):
            config, _ = configs(host_bytes=8 * len(layers) * spec.page_size_bytes)
            config.cache_config.kv_cache_layout = layout.name
            kv = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(layers, spec)],
                                                 num_blocks * len(layers) * spec.page_size_bytes)
            assert kv.num_blocks == num_blocks
            try:
                caches = allocate_kv_cache(kv, torch.device("cpu"), layout, [kernel])
            except ValueError as e:  # vLLM splits blocks only where each is one dense page
                assert kernel != BLOCK and "cannot be split" in str(e), e
                continue
            assert caches["l0"].shape[0] == num_blocks * BLOCK // kernel
            # Every (layer, block) page through vLLM's own byte addressing of the allocation.
            (tensor,) = kv.kv_cache_tensors
            storage = caches["l0"].untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            strides = compute_layout_strides(spec, num_blocks, len(layers), layout,
                                             fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None))
            pages = torch.as_strided(raw, (len(layers), *compute_layer_kv_cache_shape_bytes(spec, num_blocks)),
                                     strides, tensor.offset)
            cells = pages[0, 0].numel()
            for layer in range(len(layers)):
                for block in range(num_blocks):
                    pages[layer, block] = ((torch.arange(cells) + 31 * block + 7 * layer) % 251).view(pages.shape[2:])
            before = pages.clone()
            connector = host_tier.HostTierConnector(config, KVConnectorRole.WORKER, kv)
            connector.register_kv_caches(caches)
            connector.handle_preemptions(host_tier.HostTierMetadata(swap_out=[(3, 0), (1, 1), (0, 5)]))
            raw.zero_()
            connector.bind_connector_metadata(host_tier.HostTierMetadata(swap_in=[(2, 0), (0, 1), (1, 5)]))
            connector.start_load_kv(None)
            connector.clear_connector_metadata()
            for device, was in ((2, 3), (0, 1), (1, 0)):
                assert torch.equal(pages[:, device], before[:, was]), f"{layout.name}, kernel {kernel}: block {device}"
            assert not pages[:, 3].any(), f"{layout.name}, kernel {kernel}: a block no pair names was written"
            tried.append(f"{layout.name}/{kernel}")
    assert len(tried) > len(KVCacheLayout) and all(f"{layout.name}/{BLOCK}" in tried for layout in KVCacheLayout), tried


def case_bytes_per_token_follows_the_kv_cache_dtype_and_mla():
    """The worker's bytes per token (its host pool size, the policy's copy cost) as vLLM's KV cache spec
    sizes a page: the KV cache dtype (fp8: one byte), and MLA's one latent vector per token; and the
    copy-bandwidth probe allocates at most 64 MiB on the device, whatever the block size."""
    from types import SimpleNamespace

    from engine.vllm_backend import worker

    def fake(cache_dtype: str, use_mla: bool = False, kv_heads: int = 8, head_size: int = 128):
        model = SimpleNamespace(dtype=torch.bfloat16, use_mla=use_mla, get_num_kv_heads=lambda parallel: kv_heads,
                                get_head_size=lambda: head_size,
                                get_num_layers_by_block_type=lambda parallel, kind: 32 if kind == "attention" else 0)
        return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                               parallel_config=None)

    assert worker.kv_bytes_per_token(fake("auto")) == 2 * 8 * 128 * 2 * 32  # K and V, bfloat16
    assert worker.kv_bytes_per_token(fake("fp8")) == 2 * 8 * 128 * 1 * 32
    assert worker.kv_bytes_per_token(fake("float32")) == 2 * 8 * 128 * 4 * 32
    assert worker.kv_bytes_per_token(fake("auto", use_mla=True, kv_heads=1, head_size=576)) == 576 * 2 * 32
    config, _ = configs()  # vLLM's own configuration of SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
    assert worker.kv_bytes_per_token(config) == 2 * 30 * 3 * 64 * 4
    # The connector sizes its host blocks from the KV cache config: the same bytes for the same spec.
    fp8 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.uint8)
    kv = KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(32)], fp8)])
    assert host_tier.bytes_per_block(kv) == worker.kv_bytes_per_token(fake("fp8")) * BLOCK
    allocated = []
    randint = torch.randint

    def recording(*args, **kwargs):
        out = randint(*args, **kwargs)
        allocated.append(out.numel() * out.element_size())
        return out

    torch.randint = recording
    try:
        worker.copy_bandwidth("cpu", 2**30)  # a 1 GiB block: a model far larger than any here
    finally:
        torch.randint = randint
    assert allocated == [32 * 2**20], allocated  # the blocks; as much again for the copy's gathered blocks


def case_the_scheduler_vllm_builds_follows_its_choice_of_async_scheduling():
    """`intercept_scheduler` (the backend's scheduler_cls unless async scheduling is asked for or off)
    builds the scheduler that matches vLLM's final choice: vLLM's CPU platform turns asynchronous
    scheduling off even when asked; on a GPU vLLM turns it on by default."""
    config, _ = configs(async_scheduling=True)
    assert config.scheduler_config.async_scheduling is False, "vLLM's CPU platform no longer turns it off"
    for async_scheduling, cls in ((True, ours.AsyncInterceptScheduler), (False, ours.InterceptScheduler)):
        config, kv = configs("preserve")
        config.scheduler_config.async_scheduling = async_scheduling  # as vLLM resolved it
        s = ours.intercept_scheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
                                     structured_output_manager=StructuredOutputManager(config))
        assert type(s) is cls, (async_scheduling, type(s))


def case_the_vllm_internals_we_use_have_the_signatures_we_were_written_against():
    owners = {"Scheduler": Scheduler, "KVCacheManager": KVCacheManager, "FCFSRequestQueue": FCFSRequestQueue}
    named = {f"Scheduler.{m}" for m in ours.OVERRIDDEN + ours.CALLED} | \
        {f"KVCacheManager.{m}" for m in ours.KV_CACHE_MANAGER_CALLED} | {f"FCFSRequestQueue.{m}" for m in ours.QUEUE_CALLED}
    named.discard("KVCacheManager.allocate_slots")  # checked by its parameters below: a long list
    assert named == set(SIGNATURES), f"the scheduler's list of internals changed: {sorted(named ^ set(SIGNATURES))}"
    changed = []
    for name, expected in SIGNATURES.items():
        owner, method = name.split(".")
        got = str(inspect.signature(getattr(owners[owner], method)))
        if got != expected:
            changed.append(f"{name}{got}")
    assert not changed, "changed in this vLLM: " + "; ".join(changed)
    params = list(inspect.signature(KVCacheManager.allocate_slots).parameters)
    assert params[:3] == ["self", "request", "num_new_tokens"], f"allocate_slots{params}"
    # vLLM's internal request ids are the worker's id and a random suffix; the scheduler strips it.
    from types import SimpleNamespace

    from vllm.v1.engine.input_processor import InputProcessor
    request = SimpleNamespace(request_id="chat-7f3a", external_req_id=None)
    InputProcessor.assign_request_id(request)
    assert request.request_id != "chat-7f3a" and ours.external_id(request.request_id) == "chat-7f3a", \
        f"vLLM's internal id {request.request_id!r} no longer maps back"
    for attr in ("kv_holding_waiting", "waiting", "deferred_waiting", "running", "requests", "max_num_scheduled_tokens",
                 "num_waiting_for_streaming_input", "reset_preempted_req_ids"):
        assert hasattr(make("preserve"), attr), f"Scheduler has no {attr}"


CASES = {name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> None:
    results = {}
    for name, fn in CASES.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - every case reports, whatever failed
            results[name] = traceback.format_exc(limit=3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
