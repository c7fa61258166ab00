"""Measure a `Profile` on the real model and device: T_fwd(n), saturation point, copy bandwidth.

The engine loads a cached profile matching (model, device, dtype, threads) or measures a quick one at
start-up; `infercept profile` measures a fuller one and writes it wherever asked.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time

import torch
from tqdm import tqdm

from .env import cache_dir
from .kv_cache import KVCache
from .model_runner import ModelRunner
from .outputs import ScheduledChunk, SchedulerOutput
from .policy import Profile
from .sampling_params import SamplingParams

logger = logging.getLogger("infercept.engine")

QUICK_SIZES = (1, 16, 64, 128, 256, 512)
# A GPU's step time stays flat far longer (an H100 with the Llama-3-8B shape: ~13.5 ms from 1 to 128
# tokens, saturating at 1,024), and its passes are quick: its quick profile reaches further.
QUICK_SIZES_GPU = QUICK_SIZES + (1024, 2048)
# A cached profile whose forward times are this many times slower than one pass timed at start-up was
# measured on a busy machine and is measured again (see `_measured_on_a_busy_machine`).
STALE_SLOWDOWN = 2.0
SPOT_CHECK_TOKENS = 64
FULL_SIZES = (1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024)
# Attention over the context (`_attention_costs`): a decode batch, a prefill chunk, the longest context.
ATTENTION_BATCH = 8
ATTENTION_CHUNK = 128
ATTENTION_CONTEXT = 2048
# Bumped when how a profile is measured changes, so cached profiles are measured again. 2: copy bandwidth
# as the median of five copies after two warm-ups (was one copy after one: `_copy_bandwidth`). 3: the
# attention over the context.
MEASUREMENT = 3


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cached_profile_path(model: str, device: torch.device, dtype: torch.dtype, kernels: str) -> str:
    """kernels: `ModelRunner.kernels`. The kernels are part of the key: a profile measured with others has
    other forward times. So is the way a profile is measured (`MEASUREMENT`): a fix to it must not be
    hidden by a cached profile."""
    key = hashlib.sha1(f"{os.path.abspath(model)}|{device_name(device)}|{dtype}|{kernels}|{MEASUREMENT}".encode()
                       ).hexdigest()[:16]
    return os.path.join(cache_dir(), "profiles", f"{os.path.basename(os.path.normpath(model))}-{key}.json")


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of `fn()` after one warm-up, every queued GPU stream finished each time."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _forward_pass(runner: ModelRunner, num_tokens: int, start_pos: int = 0):
    """One prefill pass of `num_tokens` tokens after `start_pos` tokens of context, written into the
    pool's first blocks, as a function."""
    table = list(range(-(-(start_pos + num_tokens) // runner.block_size)))
    chunk = ScheduledChunk("profile", [100] * num_tokens, start_pos, table, True, SamplingParams(temperature=0), 0)
    return lambda: runner.run(SchedulerOutput(chunks=[chunk]))


def _decode_pass(runner: ModelRunner, batch: int, context: int):
    """One decode step of `batch` sequences of `context` tokens each (the last one new), each in blocks
    of its own (a pass that read the same blocks for every sequence would find them in the caches)."""
    per_seq = -(-context // runner.block_size)
    chunks = [ScheduledChunk(f"profile-{i}", [100], context - 1, list(range(i * per_seq, (i + 1) * per_seq)), True,
                             SamplingParams(temperature=0), 0) for i in range(batch)]
    return lambda: runner.run(SchedulerOutput(chunks=chunks))


def _attention_costs(runner: ModelRunner, kv: KVCache, max_len: int, batch: int = ATTENTION_BATCH,
                     chunk: int = ATTENTION_CHUNK, repeats: int = 3) -> tuple[float, float]:
    """`Profile.attention_read_s_per_token` and `attention_pair_s`: what a pass's attention over earlier
    context adds to T_fwd, which the T_fwd samples (passes from position 0) leave out. The read cost is
    the difference between `batch` decodes over long contexts and over one block each, per extra context
    token; the pair cost, between a `chunk`-token prefill chunk after a long context and the same chunk
    from position 0, per (query, extra context token) pair. Contexts as long as the pool holds, up to
    ATTENTION_CONTEXT. (0, 0) where the pool is too small to tell (under 4 blocks a sequence)."""
    bs = kv.block_size
    device = kv.device_kv.device
    context = min(kv.num_blocks // batch * bs, ATTENTION_CONTEXT, max_len - 1)
    if context < 4 * bs:
        return 0.0, 0.0
    short = _median_seconds(_decode_pass(runner, batch, bs), device, repeats)
    long = _median_seconds(_decode_pass(runner, batch, context), device, repeats)
    read = max(long - short, 0.0) / (batch * (context - bs))
    before = min(ATTENTION_CONTEXT, kv.num_blocks * bs, max_len) - chunk
    pair = 0.0
    if before >= 4 * bs:
        alone = _median_seconds(_forward_pass(runner, chunk), device, repeats)
        after = _median_seconds(_forward_pass(runner, chunk, before), device, repeats)
        pair = max(after - alone, 0.0) / (chunk * before)
    runner.generators.pop("profile", None)
    return read, pair


def _time_forward(runner: ModelRunner, num_tokens: int, repeats: int) -> float:
    """Median seconds of one prefill pass of `num_tokens` tokens written into scratch blocks (the runner
    forgets the scratch request's sampling state afterwards)."""
    seconds = _median_seconds(_forward_pass(runner, num_tokens), runner.device, repeats)
    runner.generators.pop("profile", None)
    return seconds


def _copy_overlap(runner: ModelRunner, kv: KVCache, num_tokens: int = 256, num_blocks: int = 64,
                  repeats: int = 5) -> float | None:
    """Share of a swap's copy time hidden behind a forward pass queued beside it: the copies of
    `num_blocks` blocks out and back in (on the copy stream, blocks the pass does not touch), the pass
    of `num_tokens` tokens, each timed alone and both together. 1: the copy costs the step nothing;
    0: it adds its whole time. None where the pools are too small to keep the two apart."""
    pass_blocks = -(-num_tokens // kv.block_size)
    if kv.num_blocks < pass_blocks + num_blocks or kv.num_host_blocks < num_blocks:
        return None
    out_pairs = [(kv.num_blocks - num_blocks + i, i) for i in range(num_blocks)]
    in_pairs = [(h, d) for d, h in out_pairs]

    def copies():
        kv.copy_blocks_out(out_pairs)
        kv.copy_blocks_in(in_pairs)

    forward = _forward_pass(runner, num_tokens)
    t_copy = _median_seconds(copies, kv.device_kv.device, repeats)
    t_fwd = _median_seconds(forward, kv.device_kv.device, repeats)
    t_both = _median_seconds(lambda: (copies(), forward()), kv.device_kv.device, repeats)
    runner.generators.pop("profile", None)
    return min(max((t_fwd + t_copy - t_both) / min(t_fwd, t_copy), 0.0), 1.0)


def _copy_bandwidth(kv: KVCache, num_blocks: int, warmup: int = 2, repeats: int = 5) -> tuple[float, float]:
    """(device -> host, host -> device) bytes/s of `num_blocks` blocks, the median of `repeats` copies.
    The first copies are not the steady state: their memory's pages fault in on first touch (64 blocks of
    SmolLM2 took 61 ms the first time, 5.3 ms from then on, on an AMD EPYC, 2026-11-25, when CPU copies
    still went through fresh staging buffers), and one copy timed after a single warm-up still caught it:
    profiles of 0.4 GB/s made the policy price a swap 10x too high and discard contexts it could have
    swapped."""
    pairs = [(i, i) for i in range(num_blocks)]
    block_bytes = kv.device_kv[:, :, 0].numel() * kv.device_kv.element_size()
    result = []
    for copy in (kv.copy_blocks_out, kv.copy_blocks_in):
        for _ in range(warmup):
            copy(pairs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            copy(pairs)
            if kv.device_kv.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result.append(num_blocks * block_bytes / max(sorted(times)[len(times) // 2], 1e-9))
    return result[0], result[1]


def measure_profile(model: str, runner: ModelRunner, kv: KVCache, bytes_per_token: int,
                    sizes=None, repeats: int = 3, progress: bool = True) -> Profile:
    """Runs real forward passes in the KV pool's first blocks: call it before serving requests.
    sizes: the step sizes timed (default: the quick ones for the runner's device)."""
    sizes = sizes or (QUICK_SIZES if runner.device.type == "cpu" else QUICK_SIZES_GPU)
    max_tokens = min(max(sizes), kv.num_blocks * kv.block_size, runner.model.spec.max_position_embeddings)
    sizes = [n for n in sizes if n <= max_tokens]
    samples = []
    with torch.inference_mode():
        for n in tqdm(sizes, desc="profiling forward pass", disable=not progress):
            samples.append((n, _time_forward(runner, n, repeats)))
        read, pair = _attention_costs(runner, kv, runner.model.spec.max_position_embeddings)
    num_copy_blocks = max(min(kv.num_blocks, kv.num_host_blocks, 64), 0)
    if num_copy_blocks:
        d2h, h2d = _copy_bandwidth(kv, num_copy_blocks)
    else:
        d2h = h2d = 1e10  # no host pool: swapping never happens, any positive number will do
    # On a CPU the copies are synchronous by construction (copy_stream.py): nothing to measure.
    overlap = None
    if kv.device_kv.device.type == "cuda":
        with torch.inference_mode():
            overlap = _copy_overlap(runner, kv, num_tokens=min(256, max_tokens))
    return Profile(model=os.path.abspath(model), device=device_name(kv.device_kv.device),
                   dtype=dtype_name(kv.device_kv.dtype), bytes_per_token=bytes_per_token,
                   block_size=kv.block_size, t_fwd_samples=tuple(samples), d2h_bytes_per_s=d2h,
                   h2d_bytes_per_s=h2d, copy_overlap=overlap, attention_read_s_per_token=read,
                   attention_pair_s=pair,
                   notes=f"measured by infercept on {time.strftime('%Y-%m-%d')}")


def _measured_on_a_busy_machine(profile: Profile, runner: ModelRunner, kv: KVCache) -> bool:
    """Whether a cached profile's forward time is more than `STALE_SLOWDOWN` times one pass timed now.

    A profile measured while other processes shared the cores (say, many servers starting at once) is
    slow at every size, and the policy would keep pricing iterations and recomputation by it. Sharing
    only ever slows a pass down, so the check is one-sided: a profile slower than now is replaced; one
    faster than now is kept (it is this machine's speed when not busy; the machine may be busy now).
    """
    tokens = min(SPOT_CHECK_TOKENS, profile.t_fwd_samples[-1][0], kv.num_blocks * kv.block_size)
    with torch.inference_mode():
        now = _time_forward(runner, tokens, repeats=1)
    return profile.t_fwd(tokens) > STALE_SLOWDOWN * now


def load_or_measure(model: str, runner: ModelRunner, kv: KVCache, bytes_per_token: int,
                    progress: bool = True) -> Profile:
    path = cached_profile_path(model, kv.device_kv.device, kv.device_kv.dtype, runner.kernels)
    if os.path.exists(path):
        try:
            profile = Profile.load(path)
            if profile.block_size == kv.block_size and profile.bytes_per_token == bytes_per_token:
                if not _measured_on_a_busy_machine(profile, runner, kv):
                    return profile
                logger.warning("cached profile %s is over %gx slower than a forward pass now (measured on a "
                               "busy machine?); measuring it again", path, STALE_SLOWDOWN)
        except (ValueError, KeyError):
            pass  # a stale or corrupt file is measured again
    profile = measure_profile(model, runner, kv, bytes_per_token, progress=progress)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    profile.save(path)
    return profile
