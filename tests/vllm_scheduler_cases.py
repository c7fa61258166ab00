"""Scheduler cases for `InterceptScheduler`, run by the vLLM environment's python (no pytest there).

    <vllm python> tests/vllm_scheduler_cases.py MODEL_DIR   ->  one JSON object: case name -> "ok" or why not

In the style of vLLM's own tests/v1/core: a real `Scheduler` over a block pool of a given size, no model
runs; each step feeds `update_from_output` a sampled token per scheduled request. tests/test_vllm_scheduler.py
runs this once and turns every case into a test. MODEL_DIR is read for its config only.
"""
from __future__ import annotations

import inspect
import json
import sys
import time
import traceback
from pathlib import Path

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


def make(policy: str | None = "infercept", num_blocks: int = 64, profile: Profile | None = PROFILE,
         cls=ours.InterceptScheduler, host_blocks: int | None = None, max_num_seqs: int = 16):
    """A scheduler over `num_blocks` device blocks; with `host_blocks`, our host-tier connector too, and a
    fake worker (`FakeWorker`) that runs its copies on real tensors."""
    model = ModelConfig(model=MODEL, max_model_len=4096, dtype="float32", seed=0)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=4096,
                            is_encoder_decoder=False, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    transfer = None if host_blocks is None else KVTransferConfig(
        kv_connector="HostTierConnector", kv_connector_module_path="engine.vllm_backend.host_tier", kv_role="kv_both",
        kv_connector_extra_config={"host_bytes": host_blocks * BYTES_PER_BLOCK})  # as backend.host_tier_config
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=transfer,
                        additional_config=ours.scheduler_config(policy) if policy else {})
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    s = cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK, log_stats=True)
    if profile is not None and cls is not Scheduler:
        s._on_message({"op": "profile", "profile": profile.to_dict()})
    s.fake_worker = None if host_blocks is None else FakeWorker(config, kv, num_blocks)
    return s


class FakeWorker:
    """A worker without a model: the worker side of the host-tier connector on a real KV tensor, run in
    the order vLLM's model runner runs it (swap-outs, zeroing of new blocks, loads), and a "forward"
    that writes each scheduled position's KV as a function of its token and position (`kv_value`), so
    a resumed session's KV can be checked position by position."""

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
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()
        for rid, n in out.num_scheduled_tokens.items():
            request, blocks = s.requests[rid], s.kv_cache_manager.get_block_ids(rid)[0]
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                self.cache[blocks[pos // BLOCK], :, pos % BLOCK] = kv_value(request.all_token_ids[pos], pos)


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
    s = make("infercept")
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
    which a decode-sized step's swap budget is ~48 tokens: its swap takes several steps."""
    slow = Profile.from_dict(PROFILE.to_dict() | {"d2h_bytes_per_s": 1e7, "h2d_bytes_per_s": 1e7})
    s = make("infercept", host_blocks=32, profile=slow)
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
    for attr in ("kv_holding_waiting", "waiting", "running", "requests", "max_num_scheduled_tokens",
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
