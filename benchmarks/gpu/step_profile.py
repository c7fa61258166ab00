"""Where an engine step's time goes, so a GPU run leaves enough to speed the engine up without a GPU at
hand: decode steps at batch 1 and 32, mixed steps (a 128-token prompt's prefill beside 8 decodes), decode
steps at batch 8 with one request under a grammar, steps that queue swap copies (64 blocks each way beside
8 decodes) and a 1,000-token prefill, each timed step by step (wall time of `engine.step()` beside the
runner's share), under cProfile (the Python functions a step spends its host time in) and under
torch.profiler (the kernels and their device time, and the host time of each op); and the host time of
the decode graph's launch, alone and inside steps.

    python3 benchmarks/gpu/step_profile.py --model /tmp/llama3-8b --out RESULTS_DIR

Writes `step_profile.json` (per-workload step times) and `step_profile.txt` (the tables) into RESULTS_DIR.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import time
import traceback
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A grammar that holds a request's turn for hundreds of tokens whatever the weights: EOS is only allowed
# after 2,000 characters.
LONG_GRAMMAR = "[a-z ]{2000}"


def _start(llm, prompts: list[list[int]], new_tokens: int, guided_first: bool = False) -> list[str]:
    """Adds the prompts and steps until every one is prefilled: what follows is decode only. With
    `guided_first`, the first prompt's tokens are constrained by `LONG_GRAMMAR`."""
    from infercept.engine import SamplingParams
    from infercept.engine.sampling_params import GuidedDecodingParams

    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True) for _ in prompts]
    if guided_first:
        params[0] = SamplingParams(temperature=0, max_tokens=new_tokens,
                                   guided=GuidedDecodingParams(regex=LONG_GRAMMAR))
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while any(engine.scheduler.requests[i].num_computed_tokens < len(p) for i, p in zip(ids, prompts)):
        engine.step()
    return ids


def _finish(llm) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def timed_steps(llm, steps: int, before_step=None) -> dict:
    """Wall time of each `engine.step()` and of the runner's part of it (`runner.run` up to its sampled
    ids on the host), in ms: the rest is scheduling and output processing. `before_step()`, untimed,
    runs before each."""
    engine, runner = llm.engine, llm.engine.runner
    run = runner.run
    runner_ms: list[float] = []

    def timed_run(output, while_running=None, **kwargs):
        start = time.perf_counter()
        result = run(output, while_running, **kwargs)
        runner_ms.append(1e3 * (time.perf_counter() - start))
        return result

    runner.run = timed_run
    step_ms = []
    try:
        for _ in range(steps):
            if before_step is not None:
                before_step()
            start = time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - start))
    finally:
        runner.run = run
    return {"step_ms_median": statistics.median(step_ms), "runner_ms_median": statistics.median(runner_ms),
            "step_ms": [round(t, 3) for t in step_ms], "runner_ms": [round(t, 3) for t in runner_ms]}


def python_profile(llm, steps: int, top: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def kernel_profile(fn, device: torch.device, top: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    averages = prof.key_averages()
    parts = [averages.table(sort_by="self_cpu_time_total", row_limit=top)]
    if device.type == "cuda":
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=top))
    return "\n".join(parts)


def decode_workload(llm, batch: int, steps: int, prompt_len: int, report: list[str], result: dict) -> None:
    device = llm.engine.config.device
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
    # Enough tokens for the timed, the launch's, the cProfile and the torch.profiler steps.
    _start(llm, prompts, new_tokens=5 * steps + 8)
    for _ in range(3):  # warm-up
        llm.engine.step()
    result[f"decode_batch{batch}"] = timed_steps(llm, steps)
    report.append(f"## decode, batch {batch}: engine.step() median {result[f'decode_batch{batch}']['step_ms_median']:.2f} "
                  f"ms, runner.run median {result[f'decode_batch{batch}']['runner_ms_median']:.2f} ms\n")
    launch = graph_launch_ms(llm, batch, steps)
    if launch is not None:
        result[f"decode_batch{batch}"]["graph_launch_ms"] = launch
        report.append(f"The decode graph's launch (`replay()`, host time, median ms): alone {launch['alone']:.3f}, "
                      f"in a step {launch['in_step']:.3f}, in a step with the stream synchronized first "
                      f"{launch['after_sync']:.3f} (those steps {launch['step_ms_after_sync']:.2f} ms)\n")
    report.append(f"### cProfile over {steps} steps\n" + python_profile(llm, steps))
    report.append(f"### torch.profiler over {steps // 2} steps\n"
                  + kernel_profile(lambda: [llm.engine.step() for _ in range(steps // 2)], device))
    _finish(llm)
    without_overlap(llm, lambda: _start(llm, prompts, new_tokens=steps + 8), steps, f"decode, batch {batch}",
                    result[f"decode_batch{batch}"], report)


def without_overlap(llm, start, steps: int, label: str, row: dict, report: list[str]) -> None:
    """The steps `start()` begins, timed with the host's work less overlapped, side by side, switched while
    nothing is pending: each step planned once the last one's samples are read (--no-async-scheduling),
    and also each step's output stage after its pass (--no-async-output). Into `row`."""
    engine = llm.engine
    variants = [("sync_scheduling", "each step planned after the last one's samples are read (--no-async-scheduling)",
                 True)] * engine.async_scheduling
    variants += [("sync_output", "the output stage after each pass (--no-async-output)", False)] * engine.async_output
    default = (engine.async_output, engine.async_scheduling)
    for key, what, async_output in variants:
        engine.async_output, engine.async_scheduling = async_output, False
        try:
            start()
            for _ in range(3):
                engine.step()
            timed = timed_steps(llm, steps)
            _finish(llm)
        finally:
            engine.async_output, engine.async_scheduling = default
        row[f"{key}_step_ms_median"] = timed["step_ms_median"]
        report.append(f"## {label}, {what}: engine.step() median {timed['step_ms_median']:.2f} ms\n")


def grammar_workload(llm, batch: int, steps: int, report: list[str], result: dict) -> None:
    """Decode steps at `batch` where one request's tokens follow a grammar: its next mask needs its last
    token on the host, so with async scheduling its sampling waits for the step before's samples (the pass
    launched first), and without it the whole step does."""
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(32)] for i in range(batch)]
    start = functools.partial(_start, llm, prompts, steps + 8, True)
    start()
    for _ in range(3):
        llm.engine.step()
    row = result[f"grammar_batch{batch}"] = timed_steps(llm, steps)
    _finish(llm)
    report.append(f"## decode, batch {batch}, one request under a grammar: engine.step() median "
                  f"{row['step_ms_median']:.2f} ms, runner.run median {row['runner_ms_median']:.2f} ms\n")
    without_overlap(llm, start, steps, f"decode, batch {batch}, one request under a grammar", row, report)


def graph_launch_ms(llm, batch: int, steps: int) -> dict | None:
    """Host time of the decode graph's launch (`replay()`), medians in ms: replayed alone with the GPU
    idle and its stream empty (`alone`: it replays the last step's staged inputs, which rewrites the same
    KV slots with the same values), inside `steps` engine steps (`in_step`), and inside `steps` more
    with the stream synchronized just before it (`after_sync`, with those steps' median `step_ms`): what
    the work a step queues before the launch costs it. None without graphs."""
    runner = llm.engine.runner
    if not runner.cuda_graphs:
        return None
    graphs = runner.graph_sets[0]
    graph = graphs.graphs[graphs.padded(batch)]
    alone = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        alone.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    launch, times = graphs.launch, {False: [], True: []}

    def timed_launch(size: int, synchronize: bool) -> torch.Tensor:
        if synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = launch(size)
        times[synchronize].append(1e3 * (time.perf_counter() - start))
        return hidden

    try:
        graphs.launch = lambda size: timed_launch(size, False)
        timed_steps(llm, steps)
        graphs.launch = lambda size: timed_launch(size, True)
        synced = timed_steps(llm, steps)
    finally:
        graphs.launch = launch
    return {"alone": statistics.median(alone), "in_step": statistics.median(times[False]),
            "after_sync": statistics.median(times[True]), "step_ms_after_sync": synced["step_ms_median"]}


def swap_workload(llm, decodes: int, blocks: int, steps: int, report: list[str], result: dict) -> None:
    """Decode steps of `decodes` requests, each step also copying `blocks` device blocks out to the host
    and `blocks` others in, as a step of the policy's swaps queues them (blocks no request holds: the
    data is of no use, the copies' cost is the point): the host time of queueing them and what the
    step gains in all, beside the same steps without copies."""
    engine = llm.engine
    bm, device = engine.block_manager, engine.config.device
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(32)] for i in range(decodes)]
    _start(llm, prompts, new_tokens=4 * steps + 8)
    for _ in range(3):
        engine.step()
    plain = timed_steps(llm, steps)
    free = list(bm.device.free_ids)[-2 * blocks:]  # the free queue's end: taken last, by nothing meanwhile
    swap_out, swap_in = list(zip(free[:blocks], range(blocks))), list(zip(range(blocks), free[blocks:]))
    schedule = engine.scheduler.schedule

    def with_copies():
        out = schedule()
        out.swap_out += swap_out
        out.swap_in += swap_in
        return out

    copies_ms, overlapped_ms = [], []
    run = engine.runner.run

    def run_and_time(output, while_running=None, **kwargs):
        result = run(output, while_running, **kwargs)
        copies_ms.append(1e3 * engine.runner.copy_host_seconds)
        overlapped_ms.append(1e3 * engine.runner.copy_overlapped_host_seconds)
        return result

    engine.scheduler.schedule, engine.runner.run = with_copies, run_and_time
    try:
        row = timed_steps(llm, steps)
        report.append(f"## swap copies, {blocks} blocks out and {blocks} in beside {decodes} decodes: engine.step() "
                      f"median {row['step_ms_median']:.2f} ms ({plain['step_ms_median']:.2f} without the copies), "
                      f"queueing the copies median {statistics.median(copies_ms):.3f} ms of host time before the pass, "
                      f"{statistics.median(overlapped_ms):.3f} ms while it ran\n")
        row["without_copies_step_ms_median"] = plain["step_ms_median"]
        row["copies_host_ms_median"] = statistics.median(copies_ms)
        row["copies_overlapped_host_ms_median"] = statistics.median(overlapped_ms)
        result[f"swap_{blocks}_beside_{decodes}"] = row
        report.append(f"### cProfile over {steps} steps\n" + python_profile(llm, steps))
        report.append(f"### torch.profiler over {steps // 2} steps\n"
                      + kernel_profile(lambda: [engine.step() for _ in range(steps // 2)], device))
    finally:
        engine.scheduler.schedule, engine.runner.run = schedule, run
    _finish(llm)


def mixed_steps(llm, decodes: int, chunk: int, steps: int) -> dict:
    """`steps` steps that each prefill a new `chunk`-token prompt (one output token) beside `decodes`
    running requests' decodes, timed as `timed_steps` does."""
    from infercept.engine import SamplingParams

    engine = llm.engine
    _start(llm, [[100 + (i * 7 + j) % 1000 for j in range(32)] for i in range(decodes)], new_tokens=steps + 16)
    for _ in range(3):
        engine.step()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = iter([[200 + (i * 11 + j) % 1000 for j in range(chunk)] for i in range(steps)])
    result = timed_steps(llm, steps, before_step=lambda: engine.add_request(next(prompts), one))
    _finish(llm)
    return result


def mixed_workload(llm, decodes: int, chunk: int, steps: int, report: list[str], result: dict) -> None:
    row = result[f"mixed_{chunk}_plus_{decodes}"] = mixed_steps(llm, decodes, chunk, steps)
    report.append(f"## mixed, a {chunk}-token prefill beside {decodes} decodes: engine.step() median "
                  f"{row['step_ms_median']:.2f} ms, runner.run median {row['runner_ms_median']:.2f} ms\n")


def prefill_workload(llm, prompt_len: int, report: list[str], result: dict) -> None:
    from infercept.engine import SamplingParams

    device = llm.engine.config.device
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = [100 + j % 1000 for j in range(prompt_len)]
    llm.generate([prompt], params)  # warm-up at this very length
    times = []
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(1e3 * (time.perf_counter() - start))
    result["prefill"] = {"tokens": prompt_len, "ms": [round(t, 3) for t in times],
                         "tok_s": prompt_len / (statistics.median(times) / 1e3)}
    report.append(f"## prefill, {prompt_len} tokens: {statistics.median(times):.2f} ms (median of 3)\n")
    report.append("### torch.profiler, one prefill\n" + kernel_profile(lambda: llm.generate([prompt], params), device))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-len", type=int, default=1000)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--mixed-chunk", type=int, default=128, help="prompt tokens a mixed step prefills")
    ap.add_argument("--mixed-decodes", type=int, default=8, help="decodes beside it")
    ap.add_argument("--grammar-batch", type=int, default=8,
                    help="decodes in the steps where one request follows a grammar")
    ap.add_argument("--swap-blocks", type=int, default=64, help="blocks a swap step copies each way")
    ap.add_argument("--eager-too", action="store_true",
                    help="also time the decode and mixed steps with --enforce-eager")
    ap.add_argument("--async-output", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's output stage beside the next step's pass (default: the engine's own, on "
                         "a GPU); where on, decode steps are also timed with it off")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine plans each step while the one before computes (default: the engine's own, on "
                         "a GPU); where on, decode steps are also timed with it off")
    args = ap.parse_args(argv)

    from infercept.engine import LLM

    result: dict = {"torch": torch.__version__}
    report = [f"# engine step profile: {args.model}, {args.dtype}\n"]
    kwargs = dict(dtype=args.dtype, device=args.device, kv_cache_gb=args.kv_cache_gb,
                  max_num_batched_tokens=max(1024, args.prefill_len), enable_prefix_caching=False, progress=False,
                  async_output=args.async_output, async_scheduling=args.async_scheduling)
    try:
        llm = LLM(args.model, **kwargs)
        result["kernels"] = llm.engine.runner.kernels
        report.append(f"engine kernels {result['kernels']}\n")
        for batch in args.batches:
            decode_workload(llm, batch, args.steps, 32, report, result)
        mixed_workload(llm, args.mixed_decodes, args.mixed_chunk, args.steps, report, result)
        grammar_workload(llm, args.grammar_batch, args.steps, report, result)
        swap_workload(llm, args.mixed_decodes, args.swap_blocks, args.steps, report, result)
        prefill_workload(llm, args.prefill_len, report, result)
        del llm
    except Exception:  # the eager comparison below still runs, and the error is in the report
        report.append("## the default engine failed\n" + traceback.format_exc())
        result["error"] = traceback.format_exc(limit=3)
    if args.eager_too:
        # The same decode and mixed steps without CUDA graphs, timed only: what the graphs save, side by side.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        llm = LLM(args.model, **kwargs, enforce_eager=True)
        result["eager"] = {"kernels": llm.engine.runner.kernels}
        for batch in args.batches:
            prompts = [[100 + (i * 7 + j) % 1000 for j in range(32)] for i in range(batch)]
            _start(llm, prompts, new_tokens=args.steps + 8)
            for _ in range(3):
                llm.engine.step()
            row = result["eager"][f"decode_batch{batch}"] = timed_steps(llm, args.steps)
            report.append(f"## eager (--enforce-eager), decode, batch {batch}: engine.step() median "
                          f"{row['step_ms_median']:.2f} ms, runner.run median {row['runner_ms_median']:.2f} ms\n")
            _finish(llm)
        row = result["eager"]["mixed"] = mixed_steps(llm, args.mixed_decodes, args.mixed_chunk, args.steps)
        report.append(f"## eager (--enforce-eager), mixed, a {args.mixed_chunk}-token prefill beside "
                      f"{args.mixed_decodes} decodes: engine.step() median {row['step_ms_median']:.2f} ms\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "step_profile.txt").write_text("\n".join(report))
    print("\n".join(part.splitlines()[0] for part in report if part.startswith("#")))


if __name__ == "__main__":
    main()
