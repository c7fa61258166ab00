"""`InterceptScheduler` (engine/vllm_backend/scheduler.py) on vLLM's own scheduler, without a model run.

The cases live in tests/vllm_scheduler_cases.py and run once, in the vLLM environment's python (vLLM and
the server cannot share one environment); each case is a test here. They cover: preserve keeps a paused
session's blocks; discard frees them and the resume recomputes only past the prefix-cache hit; the
resumed context is the same either way; paused KV is reclaimed before a running request is preempted; a
pool full of paused sessions still admits new work (and stock vLLM, on the same pool, does not: the
deadlock the reclaim prevents); more paused sessions than vLLM's max_num_seqs still let new work and
resumes run (each paused session is reported to the model runner as preempted, freeing its slot);
paused sessions wait outside vLLM's queues and counts until their next chunk or end, and an engine with
only paused sessions and a KV connector takes no step; the per-step report to the worker names only the
sessions whose KV changed;
min-waste discards a long pause and preserves a short one; the policy runs without the parts only the
native engine runs (refused when a name asks for one), `infercept` whole; ample-memory
preserve keeps paused KV while vLLM's pool has room for all queued work (all of it on a CPU, no discard
on a GPU) and lets the policy decide once the room is wanted; a tool's history records the pause until its
result arrived (not until the scheduler's next step); the host tier
(`HostTierConnector`, with a fake worker copying real tensors in the order vLLM's model runner does):
a swapped session's KV goes to the host and comes back position for position, reclaim swaps when a copy is
cheaper, a full host pool means a discard, a context larger than the step's swap budget leaves over
several steps, a session resumed mid-swap keeps its device KV, an ended one frees its host blocks;
proactive swap-in brings a session's host KV back once its result is near (past the prefix cache's hit,
position for position, only into blocks the next step does not need, one step ahead whatever the swap
budget), so its resume loads nothing, while without
it the resume loads the host KV itself, and an idle engine steps for host KV due back or asks the worker
to wake it when the copy back may first be due (and the worker does);
paused sessions on a slow tool are planned only when their decision may change (the paused-KV index,
engine/paused_kv.py), deciding what planning every session every step decides; the
connector on KV caches vLLM's own allocator lays out (every layout, blocks split into kernel blocks, host
blocks not consecutive); models the policies cannot serve (two KV cache groups, MLA) refused at start; the
worker's bytes per token from the KV cache dtype and MLA, and its bounded copy probe; the scheduler built
for vLLM's choice of asynchronous scheduling; vLLM's own tool parsers as the worker runs them on an ended
turn (tool_calls.py: calls, content, thinking, stop strings; unknown or unfit parsers refused); the
signatures of every vLLM internal the scheduler overrides or calls, and of vLLM's parser API the worker
calls (a vLLM bump that changes one fails here); and, read from vLLM's source, the order in
each model runner it picks (the V1 runner, the CPU one, and the newer vllm/v1/worker/gpu/ one): swap-outs
before anything writes the freed blocks, loads before the forward.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infercept.engine import default_vllm_python

VLLM_PYTHON = default_vllm_python()
CASES_SCRIPT = Path(__file__).resolve().parent / "vllm_scheduler_cases.py"
CASES = ("preserve_keeps_a_paused_sessions_blocks",
         "discard_frees_and_resume_recomputes_only_past_the_prefix_hit",
         "a_resumed_discarded_session_has_the_same_tokens_as_a_preserved_one",
         "reclaim_takes_paused_kv_before_preempting_a_running_request",
         "a_pool_of_paused_sessions_never_deadlocks",
         "paused_sessions_hold_no_running_seat",
         "paused_sessions_wait_outside_vllms_queues",
         "the_kv_report_carries_only_what_changed",
         "stock_vllm_deadlocks_on_the_same_pool",
         "infercept_discards_long_pauses_and_preserves_short_ones",
         "the_policy_runs_without_the_parts_only_the_native_engine_runs",
         "ample_memory_keeps_paused_kv_on_a_cpu_until_the_pool_is_wanted",
         "ample_no_discard_keeps_what_min_waste_would_discard_while_the_pool_has_room",
         "no_profile_no_plan",
         "ending_a_discarded_session_frees_everything",
         "measured_pause_feeds_the_estimator",
         "the_tool_history_records_the_pause_until_the_result_arrived",
         "swap_moves_a_paused_sessions_kv_to_the_host_and_back",
         "reclaim_swaps_paused_kv_when_a_copy_is_cheaper_than_a_recompute",
         "a_full_host_pool_means_a_discard",
         "a_context_larger_than_the_swap_budget_leaves_over_several_steps",
         "a_session_resumed_mid_swap_keeps_its_device_kv",
         "ending_a_swapped_session_frees_its_host_blocks",
         "prefetch_brings_host_kv_back_before_the_resume_which_finds_it_on_the_device",
         "prefetch_acts_one_step_ahead_whatever_the_swap_budget",
         "without_prefetch_the_resume_loads_host_kv_itself",
         "an_idle_engine_steps_for_host_kv_due_back_and_asks_to_be_woken_before_then",
         "prefetch_takes_only_blocks_the_next_step_does_not_need",
         "paused_sessions_on_a_slow_tool_are_planned_only_when_their_decision_may_change",
         "a_stop_string_ends_a_sessions_turn_at_the_token_the_output_stage_does",
         "tool_calls_end_a_sessions_turn_once_the_model_moves_past_them",
         "the_vllm_internals_we_use_have_the_signatures_we_were_written_against",
         "the_connector_hooks_we_use_have_the_signatures_and_order_we_were_written_against",
         "every_model_runner_vllm_picks_copies_swap_outs_before_new_blocks_are_written_and_loads_before_the_forward",
         "a_model_with_two_kv_cache_groups_or_mla_is_refused_at_start",
         "the_host_tier_copies_blocks_in_every_kv_cache_layout_vllm_allocates",
         "bytes_per_token_follows_the_kv_cache_dtype_and_mla",
         "the_scheduler_vllm_builds_follows_its_choice_of_async_scheduling",
         "vllms_tool_parsers_read_a_turn_as_vllms_chat_serving_does",
         "vllms_parser_streams_a_turns_content_as_it_is_written_and_never_its_calls",
         "the_worker_hands_a_turns_calls_to_the_backend_with_its_last_output",
         "a_forced_turn_is_written_in_the_models_own_call_format",
         "the_worker_wakes_vllms_engine_core_when_the_scheduler_asks",
         "an_unknown_or_unfit_tool_parser_is_refused",
         "the_vllm_parser_api_we_call_has_the_signatures_we_were_written_against")

pytestmark = pytest.mark.skipif(not os.path.isfile(VLLM_PYTHON),
                                reason=f"no vLLM environment at {VLLM_PYTHON} (`make vllm-env`)")


@pytest.fixture(scope="module")
def results(default_model_dir) -> dict[str, str]:
    proc = subprocess.run([VLLM_PYTHON, str(CASES_SCRIPT), default_model_dir], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        pytest.fail(f"the scheduler cases did not run (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_case_in_the_script_is_a_test_here(results):
    assert set(results) == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_scheduler_case(results, case):
    assert results[case] == "ok", results[case]
