"""CUDA paths: run with `pytest -m gpu` on a GPU host; skipped cleanly without one. The check of the
--device value runs everywhere."""
import time

import pytest
import torch

from infercept.engine import LLM, SamplingParams
from infercept.engine.config import resolve_device


CUDA_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


def cuda_test(test):
    """Marked `gpu` (selected by `pytest -m gpu`) and skipped without a CUDA device."""
    for mark in CUDA_MARKS:
        test = mark(test)
    return test


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("name", ["bogus", "mps", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_device_flag_refuses_what_this_host_cannot_run(name):
    with pytest.raises(ValueError, match="--device"):
        resolve_device(name)
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@cuda_test
def test_cuda_matches_cpu_fp32(default_model_dir, llm_fp32):
    gpu = LLM(default_model_dir, dtype="float32", device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=32)
    assert [o.token_ids for o in gpu.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in llm_fp32.generate(PROMPTS, GREEDY)]


@cuda_test
def test_async_scheduling_on_cuda_gives_the_synchronous_engines_tokens(default_model_dir, llm_fp32):
    """On CUDA (asynchronous scheduling by default) each step is launched before the last one's samples
    reach the host through pinned memory, and its pass reads them on the device: greedy tokens, stop
    strings and tokens and logprobs as the CPU reference gives them; seeded sampling, a grammar and
    penalties as the synchronous CUDA engine gives them (the two devices draw different random numbers)."""
    from infercept.engine.sampling_params import GuidedDecodingParams

    kw = dict(dtype="float32", device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=32, progress=False)
    overlapped = LLM(default_model_dir, **kw)
    sync = LLM(default_model_dir, async_output=False, **kw)
    assert overlapped.engine.async_scheduling and not sync.engine.async_scheduling
    greedy = [SamplingParams(temperature=0, max_tokens=20, stop=["\n"]),
              SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[28], logprobs=2), GREEDY]
    got, want = overlapped.generate(PROMPTS, greedy), llm_fp32.generate(PROMPTS, greedy)
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in got] == \
        [(o.token_ids, o.finish_reason, o.stop_reason) for o in want]
    assert [t.logprob for t in got[1].logprobs] == pytest.approx([t.logprob for t in want[1].logprobs], abs=1e-3)
    drawn = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7),
             SamplingParams(temperature=0, max_tokens=10, guided=GuidedDecodingParams(choice=["yes", "no"])),
             SamplingParams(temperature=0.7, max_tokens=12, seed=5, repetition_penalty=1.3)]
    assert [o.token_ids for o in overlapped.generate(PROMPTS, drawn)] == \
        [o.token_ids for o in sync.generate(PROMPTS, drawn)]


def _kv_pools(model_dir: str, device: str):
    from infercept.engine.kv_cache import KVCache
    from infercept.engine.model_loader import load_spec

    return KVCache(load_spec(model_dir), torch.bfloat16, torch.device(device), block_size=16, num_blocks=8,
                   num_host_blocks=6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_a_swap_outs_gather_lays_each_block_out_as_the_host_pool_holds_it(device):
    """`gather_blocks` (a swap-out's staging on CUDA) in one pass equals gathering then making the
    result contiguous, in bf16 and fp32."""
    from infercept.engine.kv_cache import gather_blocks

    for dtype in (torch.bfloat16, torch.float32):
        pool = torch.randn(2, 3, 10, 4, 2, 8, device=device).to(dtype)  # [2, L, blocks, bs, Hkv, D]
        ids = torch.tensor([7, 2, 5, 6], device=device)
        staged = gather_blocks(pool, ids)
        assert staged.is_contiguous() and staged.shape == (4, 2, 3, 4, 2, 8)
        assert torch.equal(staged, pool.index_select(2, ids).movedim(2, 0).contiguous())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_swap_round_trip_restores_the_blocks(default_model_dir, device):
    """Blocks copied out to the host pool and back hold what they held (on CUDA: via the copy stream
    and pinned memory; the compute stream sees swapped-in blocks only after `wait_for_copies`, as the
    runner calls it before a forward pass that touches them). Index tensors, not lists: `kv[:, :, [3, 7]]` is a
    copy, and writing to it would leave the pool untouched."""
    kv = _kv_pools(default_model_dir, device)
    if device == "cuda":
        assert kv.host_kv.is_pinned() and kv.copy_stream.stream is not None
    blocks = torch.tensor([3, 7, 4], device=device)
    kv.device_kv.index_copy_(2, blocks, torch.randn_like(kv.device_kv.index_select(2, blocks)))
    before = kv.device_kv.index_select(2, blocks).clone()
    assert before.abs().sum() > 0
    kv.copy_blocks_out([(3, 0), (7, 1), (4, 5)])  # host runs [0, 1] and [5]
    # The compute stream may overwrite the swapped-out blocks at once: on CUDA they were gathered on it
    # and only that staging copy goes to the host on the copy stream.
    kv.device_kv.index_fill_(2, blocks, 0)
    assert kv.device_kv.index_select(2, blocks).abs().sum() == 0
    kv.copy_blocks_in([(0, 3), (1, 7), (5, 4)])
    kv.wait_for_copies([3, 7, 4])
    assert torch.equal(kv.device_kv.index_select(2, blocks), before)
    assert kv.device_kv.index_select(2, torch.tensor([0, 1, 2, 5, 6], device=device)).abs().sum() == 0
    # Runs consecutive on both sides (one strided copy each on a CPU): device 3, 4 <-> host 2, 3.
    kv.copy_blocks_out([(3, 2), (4, 3), (7, 4)])
    kv.wait_for_copies([3, 4, 7])
    kv.device_kv.zero_()
    kv.copy_blocks_in([(2, 5), (3, 6), (4, 0)])
    kv.wait_for_copies([5, 6, 0])
    assert torch.equal(kv.device_kv.index_select(2, torch.tensor([5, 6, 0], device=device)), before[:, :, [0, 2, 1]])


@cuda_test
def test_a_forward_pass_reusing_swapped_out_blocks_does_not_wait_for_their_transfer(default_model_dir):
    """A swap-out's blocks are gathered on the compute stream; only the staging copy waits for the copy
    stream. With that stream busy for ~0.1 s, a pass that overwrites the freed blocks at once neither
    waits (`waited_seconds` stays 0) nor changes what reaches the host."""
    kv = _kv_pools(default_model_dir, "cuda")
    blocks = torch.tensor([3, 7], device="cuda")
    kv.device_kv.index_copy_(2, blocks, torch.randn_like(kv.device_kv.index_select(2, blocks)))
    before = kv.device_kv.index_select(2, blocks).movedim(2, 0).cpu()
    with kv.copy_stream.copying():
        torch.cuda._sleep(200_000_000)  # the copy stream busy with earlier copies
    kv.copy_blocks_out([(3, 0), (7, 1)])
    kv.wait_for_copies([3, 7])  # as the runner calls it before a pass that writes them
    kv.device_kv.index_fill_(2, blocks, 1)
    torch.cuda.synchronize()
    assert kv.copy_stream.waited_seconds() == 0.0
    assert torch.equal(kv.host_kv[:2], before)


def test_paired_runs_group_pairs_consecutive_on_both_sides():
    from infercept.engine.kv_cache import paired_runs

    assert paired_runs([(3, 2), (4, 3), (7, 4), (8, 6), (9, 7), (1, 8)]) == [(3, 2, 2), (7, 4, 1), (8, 6, 2), (1, 8, 1)]
    assert paired_runs([]) == []


@pytest.mark.parametrize("device, next_step", [("cpu", False), ("cpu", True),
                                               pytest.param("cuda", True, marks=CUDA_MARKS)])
def test_resume_after_swap_on_the_copy_stream_is_token_exact(default_model_dir, device, next_step):
    """A paused request's KV moves to the host pool (on CUDA: pinned, on the copy stream) one block per
    step while other requests' forward passes run, and comes back the same way when it resumes beside
    another one: the greedy tokens after the resume equal a fresh request of the whole conversation,
    recomputed. On a CPU the copies are synchronous; the scheduling is the same, and with `next_step` the
    resumed request first runs in the step after its last block came back, as on CUDA
    (`Scheduler.swap_ins_run_next_step`).

    `budgeted-swap` swaps a paused context out within each step's budget whatever its expected pause, so
    the copies this test is about happen. The default (`infercept`), as designed, did not make them here: with
    this profile's slow copies (a block per 10 ms step) its expected waste prices the swap-in no step
    hides (56 ms of the 105-token context this test used to pause) above recomputing the context (three
    10 ms chunks), and while memory is ample it keeps what it would discard (`ample_preserve`, no
    discard with a GPU profile); only the one block that a prefill step's dearer recompute let out
    reached the host (16 tokens on an H100, 2026-11-26, and on a CPU with the same profile)."""
    from infercept.engine import Engine
    from infercept.engine.model_loader import load_spec
    from infercept.engine.policy import Profile
    from infercept.engine.request import InterceptParams

    bytes_per_token = load_spec(default_model_dir).kv_bytes_per_token(torch.float32)
    one_block_per_step = 16 * bytes_per_token / 0.01  # copy bandwidth: a 10 ms step moves one block
    profile = Profile(model="test", device=device, dtype="float32", bytes_per_token=bytes_per_token,
                      block_size=16, t_fwd_samples=((1, 0.01), (32, 0.01), (64, 0.02)),
                      d2h_bytes_per_s=one_block_per_step, h2d_bytes_per_s=one_block_per_step, saturation_point=32)
    # No prefix cache: the reference recomputes every token instead of reusing the resumed request's blocks.
    engine = Engine(default_model_dir, dtype="float32", device=device, kv_cache_gb=0.05, host_kv_gb=0.05,
                    max_num_batched_tokens=32, policy="budgeted-swap", profile=profile, progress=False,
                    enable_prefix_caching=False)
    assert engine.scheduler.swap_ins_run_next_step is (device == "cuda")
    engine.scheduler.swap_ins_run_next_step = next_step
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def drain():
        """Steps until idle: the outputs, and the paused KV's host tokens after each step that ran another
        request (more than one value besides 0: it moved a block at a time beside their passes)."""
        outs, host = [], set()
        while engine.has_unfinished_requests():
            outs += engine.step()
            engine.block_manager.check_integrity()
            if any(r.request_id != rid for r in engine.scheduler.running):
                host.add(engine.kv_location(rid)["host"])
        return outs, host

    long_turn = InterceptParams(pause_on_stop=True, expected_s=30.0)
    rid = engine.add_request("Once upon a time, " * 10, greedy(4), intercept=long_turn)  # 51 + 4 tokens
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, greedy(12))  # still decoding while its 4 blocks go out
    _, host_beside = drain()
    context = list(engine.scheduler.requests[rid].token_ids)
    assert engine.kv_location(rid)["host"] > 16, "the paused KV should be (partly) on the host by now"
    assert len(host_beside - {0}) >= 2, f"not swapped out a block per step beside other passes: {host_beside}"

    appended = engine.tokenizer.encode(" Then the dragon")
    assert engine.resume(rid, appended, greedy(8))["host"] > 16
    engine.add_request(PROMPTS[0], greedy(4))  # forward passes alongside the swap-in
    planned, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: planned.append(schedule()) or planned[-1]
    outs, host_beside = drain()
    assert len(host_beside - {0}) >= 2, f"not swapped in a block per step beside another pass: {host_beside}"
    last_copy_back = [out for out in planned if out.swap_in][-1]
    assert (rid in {c.request_id for c in last_copy_back.chunks}) is not next_step
    resumed = [o for o in outs if o.request_id == rid][-1]
    fresh = engine.add_request(context + appended, greedy(8))
    reference = [o for o in drain()[0] if o.request_id == fresh][-1]
    assert reference.num_cached_tokens == 0
    assert resumed.token_ids == reference.token_ids
    engine.abort(rid)  # pause_on_stop holds for every turn: it paused again after its 8 tokens
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.device.num_blocks and bm.num_free_host_blocks == bm.host.num_blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_a_steps_copies_are_queued_once_its_pass_is_launched_unless_the_pass_reads_them(default_model_dir, device):
    """The runner queues a step's swap-out transfers and swap-ins after launching its forward pass, so the
    host's queueing overlaps the pass; a swap-in into a block the pass reads is queued before it (the
    pass waits for it). Either way every block lands where it should. On a CPU, whose copies run
    synchronously and which has no copy stream, the runner queues everything first; there the test makes
    the copy stream answer as CUDA's does (`mark`), so the order is the same and its copies show it."""
    from infercept.engine import Engine

    engine = Engine(default_model_dir, dtype="float32", device=device, kv_cache_gb=0.05, host_kv_gb=0.05,
                    max_num_batched_tokens=32, progress=False, enforce_eager=True)
    kv, bm = engine.kv_cache, engine.block_manager
    if device == "cpu":
        assert kv.copy_stream.mark() is None
        kv.copy_stream.mark = lambda: "the compute stream's work so far"
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    calls = []
    for name in ("wait_for_copies", "send_blocks_out", "copy_blocks_in"):
        method = getattr(kv, name)
        setattr(kv, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    schedule = engine.scheduler.schedule
    copies = {}
    engine.scheduler.schedule = lambda: (lambda out: (out.swap_out.extend(copies.get("out", [])),
                                                      out.swap_in.extend(copies.get("in", [])), out)[-1])(schedule())

    free = list(bm.device.free_ids)[-4:]  # taken last: nothing writes them meanwhile
    kv.device_kv[:, :, free[:2]] = torch.randn_like(kv.device_kv[:, :, free[:2]])
    swapped_out = kv.device_kv[:, :, free[:2]].movedim(2, 0).cpu()
    kv.host_kv[2:4] = torch.randn_like(kv.host_kv[2:4])
    copies.update({"out": [(free[0], 0), (free[1], 1)], "in": [(2, free[2]), (3, free[3])]})
    engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    assert calls == ["wait_for_copies", "send_blocks_out", "copy_blocks_in"], calls
    assert engine.runner.copy_overlapped_host_seconds > 0
    assert torch.equal(kv.host_kv[:2], swapped_out)
    assert torch.equal(kv.device_kv[:, :, free[2:]].movedim(2, 0).cpu(), kv.host_kv[2:4])

    # A swap-in into the request's last block, of what it holds: queued before the pass, which reads it.
    read = bm.block_table(rid)[-1]
    kv.host_kv[4] = kv.device_kv[:, :, read].cpu()
    calls.clear()
    copies.update({"out": [], "in": [(4, read)]})
    engine.step()
    assert calls.index("copy_blocks_in") < calls.index("wait_for_copies"), calls
    assert engine.runner.copy_overlapped_host_seconds == 0
    copies.clear()
    while engine.has_unfinished_requests():
        out = engine.step()
    reference = Engine(default_model_dir, dtype="float32", device=device, kv_cache_gb=0.05, host_kv_gb=0.01,
                       max_num_batched_tokens=32, progress=False, enforce_eager=True)
    reference.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while reference.has_unfinished_requests():
        expected = reference.step()
    assert out[0].token_ids == expected[0].token_ids


@cuda_test
def test_queueing_swap_copies_does_not_make_the_host_wait(default_model_dir):
    """Swap copies are queued on the copy stream behind the forward passes queued so far and return at
    once: the host goes on to queue the next pass. An index list uploaded with a synchronizing
    `torch.tensor(..., device=...)` made the host wait for those passes and then for the copies (an H100
    measured 2-4% of a swap's copy time hidden behind a forward pass, 2026-11-27; 89% once the ids went up
    through pinned memory, the Llama-3-8B shape's profile). Here the GPU is kept busy by a spin kernel
    instead of a pass, so the result does not hang on how long the model's pass is."""
    llm = LLM(default_model_dir, dtype="bfloat16", device="cuda", kv_cache_gb=0.25, host_kv_gb=0.1, progress=False)
    kv = llm.engine.kv_cache
    out_pairs = [(kv.num_blocks - 64 + i, i) for i in range(64)]

    def copies():
        kv.copy_blocks_out(out_pairs)
        kv.copy_blocks_in([(h, d) for d, h in out_pairs])

    copies()  # warm: the pinned staging memory and the allocator's blocks
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles on the compute stream
    copies()
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    busy = time.perf_counter() - start
    assert busy > 0.02, f"the spin kernel ran only {busy:.4f} s: the comparison says nothing"
    assert queued < 0.25 * busy, f"queueing the copies took {queued:.4f} s of the GPU's {busy:.4f} s busy"


@cuda_test
def test_the_copy_stream_runs_beside_the_compute_stream():
    """Swap copies do not hold up the forward passes queued after them: a pass queued beside a ~0.1 s
    copy starts at once. (Two streams that share one of the GPU's few hardware queues run in order;
    torch's pool streams did not share the compute stream's on an H100, all 32 of them, 2026-11-28.)"""
    from infercept.engine.copy_stream import CopyStream

    device = torch.device("cuda")
    stream = CopyStream(device)
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    with stream.copying([7]):
        torch.cuda._sleep(200_000_000)  # ~0.1 s
    after.record()
    torch.cuda.synchronize()
    assert before.elapsed_time(after) < 10.0


@cuda_test
def test_a_forward_pass_that_waits_for_a_copy_is_timed():
    """`CopyStream.waited_seconds`: how long forward passes stood still for the copies they read (the GPU
    check's copy waits): a pass reading a block a ~0.1 s copy writes waits for it, one that does not,
    not; each wait is counted once. What the pass reads tells an ordering failure (it read the block
    before the copy wrote it) from a timing one (it waited, the events around the wait did not see it).

    Every kernel here runs once before the copy: the first launch of a kernel loads its module (CUDA's
    lazy loading), which can hold the compute stream until the running copy ends, before the wait's first
    event. Without the warm-up an H100 read a wait of 1.3 us, begun 100 ms in, 2026-11-27 and -28."""
    from infercept.engine.copy_stream import CopyStream

    device = torch.device("cuda")
    stream = CopyStream(device)
    block_7 = torch.zeros(1, device=device)

    def pass_reading_block_7():
        torch.ones(1, device=device).add_(1)
        return block_7.clone()

    with stream.copying():
        torch.cuda._sleep(1)
        block_7.fill_(0)
    pass_reading_block_7()
    torch.cuda.synchronize()

    queued = torch.cuda.Event(enable_timing=True)
    queued.record()
    with stream.copying([7]):
        torch.cuda._sleep(200_000_000)  # a long copy into block 7, on the copy stream
        block_7.fill_(1)  # its last write
    stream.before_forward([3])  # reads other blocks: goes on
    torch.ones(1, device=device).add_(1)
    stream.before_forward([7, 8])  # reads block 7: waits for the copy
    read = pass_reading_block_7()
    torch.cuda.synchronize()
    assert read.item() == 1, "the pass read block 7 before the copy wrote it: it did not wait"
    assert len(stream._waits) == 1
    wait_began_ms = queued.elapsed_time(stream._waits[0][0])
    waited = stream.waited_seconds()
    assert waited > 0.02, (f"waited {waited:.6f} s; the wait began {wait_began_ms:.1f} ms after the copy "
                           "was queued (near the copy's ~100 ms: the compute stream was held until then)")
    assert stream.waited_seconds() == 0.0


@cuda_test
def test_a_pass_waits_for_the_copy_that_writes_its_block_not_for_copies_queued_after_it():
    """A step queues its own copies just before its pass, which never reads what they write: a pass that
    reads a block an earlier copy writes waits for that copy alone, not for the ~0.1 s copy queued
    behind it (one event after the newest copies made it wait for both). The pass still reads the
    block as the earlier copy wrote it."""
    from infercept.engine.copy_stream import CopyStream

    device = torch.device("cuda")
    stream = CopyStream(device)
    block_7 = torch.zeros(1, device=device)
    for _ in range(2):  # the second round is timed; the first loads every kernel (see above)
        block_7.zero_()
        torch.cuda.synchronize()
        stream.waited_seconds()  # the warm-up's wait, if any, not counted
        queued = torch.cuda.Event(enable_timing=True)
        queued.record()
        with stream.copying([7]):
            torch.cuda._sleep(2_000_000)  # ~1 ms
            block_7.fill_(1)
        with stream.copying([9]):
            torch.cuda._sleep(200_000_000)  # ~0.1 s, into another block
        stream.before_forward([7, 8])
        read = block_7.clone()
        pass_done = torch.cuda.Event(enable_timing=True)
        pass_done.record()
        torch.cuda.synchronize()
        assert read.item() == 1, "the pass read block 7 before the copy wrote it"
    assert queued.elapsed_time(pass_done) < 50.0, "the pass waited for the copy queued after block 7's"
    assert 0 < stream.waited_seconds() < 0.05
    stream.before_forward([9])  # that copy has ended: nothing left to wait for
    assert not stream._waits


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "grammar+penalty"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_a_steps_device_time_counts_the_pass_and_not_the_hosts_planning(default_model_dir, device,
                                                                          async_scheduling, constrained):
    """`EngineStats.device_seconds`, the device's share of the steps (the GPU check's trace rows): time
    the forward pass spends on the device is in it, the host's planning of the step is not. Each step's
    pass is made 40 ms longer on the device (a spin kernel on CUDA, a sleep on the CPU, where the model
    runs synchronously) and its planning 40 ms longer on the host. With asynchronous scheduling on CUDA
    the planning runs while the step before computes: the steps take less than the two added up, also
    for a request whose sampling needs its last token on the host (a grammar, a penalty), sampled once
    that token is read (its mask and counts must reach the device without waiting for the pass)."""
    from infercept.engine import Engine
    from infercept.engine.policy import Profile
    from infercept.engine.sampling_params import GuidedDecodingParams

    delay = 0.04
    profile = Profile(model="test", device=device, dtype="bfloat16", bytes_per_token=1, block_size=16,
                      t_fwd_samples=((1, 0.01), (64, 0.02)), d2h_bytes_per_s=1e10, h2d_bytes_per_s=1e10)
    engine = Engine(default_model_dir, dtype="bfloat16", device=device, kv_cache_gb=0.05, host_kv_gb=0.01,
                    profile=profile, progress=False, enforce_eager=True, async_scheduling=async_scheduling)
    forward, schedule = engine.model.forward, engine.scheduler.schedule

    def slow_forward(*args, **kwargs):
        if device == "cuda":
            torch.cuda._sleep(int(delay * 2e9))  # ~40 ms of clock cycles at 2 GHz, or more at a lower clock
        else:
            time.sleep(delay)
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward
    engine.scheduler.schedule = lambda: time.sleep(delay) or schedule()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    if constrained:
        params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.2,
                                guided=GuidedDecodingParams(regex="[a-z ]{200}"))
    engine.add_request("The capital of France is", params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats
    assert stats.num_steps == 4 + engine.async_output  # async output (CUDA): a last step brings the last output
    assert stats.device_seconds >= 0.75 * delay * stats.num_steps, stats.device_seconds  # the slow pass, counted
    if async_scheduling and device == "cuda":  # 5 plannings, 4 passes: all but one pass overlapped
        assert stats.forward_seconds < delay * stats.num_steps + stats.device_seconds - 2 * delay
    else:
        assert stats.forward_seconds - stats.device_seconds >= delay * stats.num_steps  # the slow planning, not


DEFAULT_POOL_SCRIPT = """
import json, sys, torch
from infercept.engine import LLM, SamplingParams
from infercept.engine.kv_cache import KVCache
free_before = torch.cuda.mem_get_info()[0]
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", host_kv_gb=0.01, progress=False)
pool = llm.engine.kv_cache.num_blocks * KVCache.block_bytes(llm.engine.spec, torch.bfloat16, 16)
outs = llm.generate(["Once upon a time, " * 40] * 64, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
print(json.dumps({"free_before": free_before, "pool": pool, "lengths": [len(o.token_ids) for o in outs],
                  "peak": torch.cuda.max_memory_allocated(), "total": torch.cuda.mem_get_info()[1]}))
"""


@cuda_test
def test_without_a_pool_size_the_engine_takes_most_of_a_free_gpu(default_model_dir):
    """The default device pool on a GPU: 0.8 of the memory free after the weights, and a batch of 64 runs
    in the rest (activations, CUDA graphs, sampling). In its own process: the pool takes most of the card."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", DEFAULT_POOL_SCRIPT, default_model_dir], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print("default pool on this GPU:", {k: v for k, v in got.items() if k != "lengths"})
    assert 0.7 * got["free_before"] <= got["pool"] <= 0.8 * got["free_before"], got
    assert got["lengths"] == [16] * 64
