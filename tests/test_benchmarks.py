"""The benchmark harness cannot rot: traces are seeded and well-formed, the HTTP replayer runs a trace
end to end against the live test server (the session-scoped `server` fixture of conftest.py, so the
model is not loaded again), and the sustainable-rate rule is right on synthetic data. Nothing here
asserts on time."""
from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest

from bench_modules import load_bench
from live_server import MODEL

workload = load_bench("workload")
replay = load_bench("replay")
sustain = load_bench("sustain")


@pytest.mark.parametrize("augment", ("mixed",) + workload.AUGMENTS)
def test_traces_are_seeded_and_well_formed(augment, tmp_path):
    make = lambda seed: workload.generate_trace(2.0, duration=30, augment=augment, seed=seed,  # noqa: E731
                                                **workload.CPU_SCALE)
    trace = make(0)
    assert trace == make(0) and trace != make(1)
    assert trace and [r["arrival"] for r in trace] == sorted(r["arrival"] for r in trace)
    assert all(0 < r["arrival"] < 30 for r in trace)
    assert len({r["id"] for r in trace}) == len(trace)
    for r in trace:
        assert augment == "mixed" or r["augment"] == augment
        *middle, last = r["segments"]
        assert last["interception"] is None and last["returned_tokens"] == 0
        assert len(middle) <= workload.CPU_SCALE["max_interceptions"]
        for seg in middle:
            assert seg["interception"]["duration_s"] > 0 and seg["returned_tokens"] >= 1
            assert seg["interception"]["kind"] in replay.INTERCEPT_KINDS
        assert all(seg["decode_tokens"] >= 1 for seg in r["segments"])
        contexts = workload.contexts_at_interceptions(r)
        assert all(c < workload.CPU_SCALE["max_context"] for c in contexts)
    path = tmp_path / "t.jsonl"
    workload.write_jsonl(trace, path)
    assert workload.read_jsonl(path) == trace


def test_long_context_traces_are_seeded_bounded_and_per_tool():
    long_context = load_bench("long_context")
    trace = long_context.long_context_trace(0.2, 300, seed=0)
    assert trace == long_context.long_context_trace(0.2, 300, seed=0) != long_context.long_context_trace(0.2, 300, seed=1)
    assert [r["arrival"] for r in trace] == sorted(r["arrival"] for r in trace) and len(trace) > 20
    contexts = []
    for r in trace:
        *middle, last = r["segments"]
        assert last["interception"] is None and middle
        for seg in middle:
            share, kind, _, cap, _ = long_context.TOOLS[seg["interception"]["tool"]]
            assert seg["interception"]["kind"] == kind and 0 < seg["interception"]["duration_s"] <= cap
        ctx = workload.contexts_at_interceptions(r)
        assert max(ctx) + last["decode_tokens"] <= long_context.MAX_CONTEXT and ctx == sorted(ctx)
        contexts += ctx
    # Long and growing (10k-100k tokens), with minutes-long tails among the tool times.
    assert min(contexts) >= 8_000 and max(contexts) > 60_000
    assert max(s["interception"]["duration_s"] for r in trace for s in r["segments"][:-1]) > 60
    small = long_context.long_context_trace(0.2, 300, seed=0, context_scale=0.05, max_context=8192,
                                            interception_scale=0.1)
    assert all(max(workload.contexts_at_interceptions(r), default=0) <= 8192 for r in small)


def test_parts_sim_sustainable_table_reads_the_rate_sweep():
    parts_sim = load_bench("parts_sim")
    lat = {"infercept-paper": {1: 0.010, 2: 0.015, 3: 0.030}, "x": {1: 0.011, 2: 0.012, 3: 0.018}}
    doc = {"workloads": ["long@1", "long@2", "long@3", "burst"], "seeds": [0], "policies": list(lat),
           "results": [{"workload": f"long@{r}", "policy": p, "seed": 0, "normalized_latency": v}
                       for p, by in lat.items() for r, v in by.items()]}
    text = parts_sim.sustainable_table(doc)
    # SLO 20 ms: the paper crosses it between 2 and 3 (2 + 5/15); x never does (> 3, a lower bound).
    assert "| infercept-paper | 2.33 | 2.33 | 1.00x |" in text and "| x | 3 | >3 | 1.29x |" in text
    assert "burst" not in text


def test_parts_sim_long_tight_is_long_with_a_quarter_of_the_device_pool():
    parts_sim = load_bench("parts_sim")
    args = dict(window=150.0, drain=300.0, token_scale=16, long_window=600.0, long_drain=1200.0)
    long, tight = (parts_sim.build_workload(f"{name}@0.05", 0, args) for name in ("long", "long-tight"))
    assert tight.device_blocks == long.device_blocks // 4 and tight.host_blocks == long.host_blocks
    assert (tight.trace, tight.profile, tight.token_scale, tight.window, tight.until) == \
        (long.trace, long.profile, long.token_scale, long.window, long.until)


def test_srpt_oracle_bound_serves_the_program_with_less_left_first():
    """Two programs arrive together with room to run one at a time: in arrival order the long one (first
    in the trace) finishes first; ordered by the tokens left (`srpt-oracle`), the short one does."""
    parts_sim = load_bench("parts_sim")
    from infercept.engine.policy.profile import h100_llama3_8b
    from infercept.engine.simulation import SimulatedEngine

    def program(pid, decode):
        return {"id": pid, "arrival": 0.0, "prompt_tokens": 64,
                "segments": [{"decode_tokens": decode, "interception": None, "returned_tokens": 0}]}

    trace = [program("long", 200), program("short", 8)]
    finish = {}
    for oracle in (False, True):
        engine = SimulatedEngine("infercept", h100_llama3_8b(), 1000, 1000, max_num_seqs=1)
        if oracle:
            parts_sim.order_by_remaining_tokens(engine, trace, token_scale=1)
        records = {r.request_id: r for r in engine.run_trace(trace).records}
        finish[oracle] = records["short"].finish < records["long"].finish
    assert finish == {False: False, True: True}


def test_cpu_scale_flag_fills_only_the_knobs_left_at_default():
    parser = __import__("argparse").ArgumentParser()
    workload.add_scale_args(parser)
    knobs = workload.scale_knobs(parser.parse_args(["--cpu-scale", "--context-scale", "0.5"]))
    assert knobs == workload.CPU_SCALE | {"context_scale": 0.5}
    assert workload.scale_knobs(parser.parse_args([]))["context_scale"] == 1.0


def test_synthetic_tokens_are_deterministic():
    a = replay.synthetic_tokens("r1", "prompt", 50, seed=0)
    assert a == replay.synthetic_tokens("r1", "prompt", 50, seed=0)
    assert a != replay.synthetic_tokens("r2", "prompt", 50, seed=0)
    assert all(replay.TOKEN_ID_RANGE[0] <= t < replay.TOKEN_ID_RANGE[1] for t in a)


def two_request_trace() -> list[dict]:
    def seg(decode, duration=None, returned=0):
        inter = {"kind": "tool", "tool": "qa", "duration_s": duration} if duration is not None else None
        return {"decode_tokens": decode, "interception": inter, "returned_tokens": returned}

    return [{"id": "a", "augment": "qa", "arrival": 0.0, "prompt_tokens": 40,
             "segments": [seg(5, 0.2, 6), seg(4, 0.1, 3), seg(3)]},
            {"id": "b", "augment": "qa", "arrival": 0.1, "prompt_tokens": 25, "segments": [seg(4, 0.05, 2), seg(6)]}]


@pytest.mark.parametrize("api", ("resume", "session", "discard"))
def test_replayer_runs_a_trace_end_to_end(server, api):
    server.abort_paused()
    trace = two_request_trace()
    # Each api its own synthetic tokens: a prefix cached by another api's run would count as cached here.
    records = asyncio.run(replay.replay(trace, server.base, api=api, model=MODEL, until=120,
                                        seed=replay.APIS.index(api)))
    summary = replay.summarize(records, elapsed=1.0)
    assert summary["finished"] == 2 and summary["errors"] == 0, summary["first_error"]
    for spec, rec in zip(trace, records):
        assert rec.steps == len(spec["segments"])
        assert rec.output_tokens == sum(s["decode_tokens"] for s in spec["segments"])
        wanted_interception = sum(s["interception"]["duration_s"] for s in spec["segments"] if s["interception"])
        assert wanted_interception <= rec.interception_s < rec.e2e
        assert 0 < rec.ttft <= rec.e2e
        assert math.isfinite(rec.normalized_latency) and rec.normalized_latency > 0
        # Each step's prompt is the whole history: prompt + every decoded and returned token before it.
        history, sent, paused_kv = spec["prompt_tokens"], 0, 0
        for s in spec["segments"]:
            sent += history
            history += s["decode_tokens"]
            if s["interception"]:
                # The server's fixture preserves paused KV: all of it is reused but for the last sampled
                # token, whose KV is only computed when it is fed back.
                paused_kv += history - 1
            history += s["returned_tokens"]
        assert rec.prompt_tokens == sent
        if api in ("resume", "session"):  # every step after the first resumed its paused generation
            assert rec.cached_tokens == paused_kv
        else:
            assert rec.cached_tokens <= sent
    server.abort_paused()
    server.assert_no_leak()


def test_summary_counts_unfinished_requests_as_slow():
    done = replay.RequestRecord("a", "qa", 0.0, steps=2, ttft=0.1, e2e=3.0, interception_s=1.0, output_tokens=4,
                                prompt_tokens=10, cached_tokens=5, finished=True)
    cut = replay.RequestRecord("b", "qa", 1.0, steps=1, ttft=0.2, e2e=5.0, output_tokens=2)
    nothing = replay.RequestRecord("c", "qa", 2.0, e2e=4.0)
    assert done.normalized_latency == pytest.approx(0.5)
    s = replay.summarize([done, cut], elapsed=10.0)
    assert s["finished"] == 1 and s["completed_per_s"] == pytest.approx(0.1)
    assert s["normalized_latency_mean"] == pytest.approx((0.5 + 2.5) / 2)
    assert s["cached_share"] == pytest.approx(0.5)
    # Cut off before its first token: as if that token came at the cut-off (4 s for one token).
    assert replay.summarize([done, nothing], elapsed=10.0)["normalized_latency_mean"] == pytest.approx((0.5 + 4.0) / 2)
    failed = replay.RequestRecord("d", "qa", 2.0, error="HTTP 500")
    assert math.isinf(replay.summarize([done, failed], elapsed=10.0)["normalized_latency_mean"])


def test_sustainable_rate():
    rule = sustain.sustainable_rate
    assert rule({1: 0.1, 2: 0.2, 3: 0.5}, slo=0.3) == (pytest.approx(2 + (0.3 - 0.2) / (0.5 - 0.2)), True)
    assert rule({1: 0.1, 2: 0.2}, slo=0.3) == (2, False)  # never crossed: a lower bound
    assert rule({1: 0.4, 2: 0.5}, slo=0.3) == (0.0, True)
    assert rule({1: 0.1, 2: math.inf}, slo=0.3) == (1, True)
    assert rule({1: 0.1, 2: math.nan}, slo=0.3) == (1, True)
    assert rule({1: 0.1, 2: 0.3}, slo=0.3) == (2, False)  # at the SLO is within it
    # Overloaded at 2 means not sustainable at 3, even if a noisy run dips under the SLO there.
    assert rule({3: 0.1, 1: 0.1, 2: 0.9}, slo=0.5) == (pytest.approx(1.5), True)
    assert rule({}, slo=1.0) == (0.0, False)
    assert sustain.ratio_text(3.0, 2.0) == "1.50x" and sustain.ratio_text(1.0, 0.0) == "–"


def test_sweep_reads_recompute_and_waste_from_metrics():
    sweep = load_bench("sweep")
    before = {"infercept_computed_tokens_total": 100, "infercept_recomputed_tokens_total": 10,
              "infercept_engine_forward_seconds_total": 5.0, "infercept_recompute_seconds_total": 1.0,
              "infercept_memory_waste_byte_seconds_total": 0.0}
    after = {"infercept_computed_tokens_total": 300, "infercept_recomputed_tokens_total": 60,
             "infercept_engine_forward_seconds_total": 15.0, "infercept_recompute_seconds_total": 2.0,
             "infercept_memory_waste_byte_seconds_total": 200.0}
    shares = sweep.engine_shares(before, after, seconds=10.0, pool_bytes=1000.0)
    # Time share from the engine's recompute seconds (1 s of 10), token share apart (50 of 200).
    assert shares["recompute_time_share"] == pytest.approx(0.1) and shares["recompute_seconds"] == pytest.approx(1.0)
    assert shares["recompute_token_share"] == pytest.approx(0.25)
    assert shares["memory_waste_pct"] == pytest.approx(2.0)
    results = {"discard": {0.5: {"normalized_latency_mean": 0.1}, 1.0: {"normalized_latency_mean": 0.5}},
               "infercept": {0.5: {"normalized_latency_mean": 0.1}, 1.0: {"normalized_latency_mean": 0.15}}}
    text = sweep.report(results, [0.5, 1.0], slo=None, header="# t")
    assert "| infercept | ≥ 1.00 |" in text and "| discard | 0.62 |" in text
    assert "infercept / discard: 1.60x" in text and "median normalized latency <=" not in text
    # With medians, the paper's definition gets its own SLO (2x the best median at the lowest rate).
    for by, medians in ((results["discard"], (0.08, 0.24)), (results["infercept"], (0.08, 0.1))):
        for rate, median in zip((0.5, 1.0), medians):
            by[rate]["normalized_latency_median"] = median
    text = sweep.report(results, [0.5, 1.0], slo=None, header="# t")
    median_part = text[text.index("median normalized latency <= 0.16 s/token"):]
    assert "| discard | 0.75 |" in median_part and "infercept / discard: 1.33x" in median_part
    assert "infercept / discard: 1.60x" in text[:text.index(median_part)]


def test_vllm_peer_gets_infercepts_kv_token_capacity_and_cores(default_model_dir):
    """The peer's KV pool holds as many tokens as InferCept's `--kv-cache-gb` pool (in bf16), or as its
    device and host pools together, in vLLM's block size, and runs on the same cores; the sweep skips it
    when no interpreter can import vllm."""
    sweep = load_bench("sweep")
    per_token = sweep.kv_bytes_per_token(default_model_dir)
    assert per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 30 layers x 3 KV heads x 64, bf16
    args = argparse.Namespace(kv_cache_gb=0.03, host_kv_gb=0.1, peer_python="/venv/bin/python",
                              peer_dtype="float32", max_num_batched_tokens=128, threads=1)
    for pool, gib in (("device", 0.03), ("total", 0.13)):  # the device pool alone, or device + host
        argv, env = sweep.vllm_argv(8100, args, pool)
        flags = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--")}
        blocks = int(flags["--num-gpu-blocks-override"])
        assert argv[0] == "/venv/bin/python" and flags["--block-size"] == str(sweep.VLLM_BLOCK)
        assert blocks * sweep.VLLM_BLOCK <= gib * 1024 ** 3 / per_token < (blocks + 1) * sweep.VLLM_BLOCK
        assert int(flags["--max-model-len"]) < blocks * sweep.VLLM_BLOCK and flags["--dtype"] == "float32"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    assert set(sweep.PEER_POOLS) == {"device", "total"}
    assert sweep.peer_python("/x/python") == "/x/python"


def test_spot_speed_measures_fresh_prefill_and_exact_decode(server):
    """The speed spot check against the live server: every request decodes exactly the tokens asked for
    and none of its prompt comes from the prefix cache (else `SpotCheckError`), over two rounds that
    would hit the cache if the prompts repeated."""
    spot_speed = load_bench("spot_speed")
    speeds = asyncio.run(spot_speed.measure(server.base, MODEL, batches=(1, 3), prompt_tokens=40, new_tokens=3,
                                            seed=0))
    assert set(speeds) == {1, 3}
    assert all(math.isfinite(v) and v > 0 for v in speeds.values())
    server.assert_no_leak()


def test_tool_loop_resumes_a_forced_call_loop(server):
    """The tool-loop benchmark's loop against the live test server (preserve policy): every step makes
    a forced call, and the resumed step reuses the paused context."""
    import openai

    tool_loop = load_bench("tool_loop")
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    records = tool_loop.run_loop(client, MODEL, steps=2, max_tokens=40, sections=6)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["calls"] and r["calls"][0]["name"] == "get_weather" and r["ttft_s"] > 0 for r in records)
    assert records[0]["cached_tokens"] == 0  # a fresh nonce: nothing to reuse
    assert records[1]["cached_tokens"] >= 0.9 * records[1]["prompt_tokens"]
    summary = tool_loop.summarize([records])
    assert summary["resumed_steps"] == 1 and summary["resumed_cached_share"] >= 0.9
    server.abort_paused()


def test_claims_recompute_sustainable_rates_from_request_records(tmp_path, monkeypatch):
    claims = load_bench("claims")
    records = tmp_path / "sweep_x" / "records"
    records.mkdir(parents=True)
    # (system, rate) -> normalized latencies of its requests (e2e = latency x 10 tokens, no interception)
    runs = {("swap", 0.5): [0.1, 0.1], ("swap", 1.0): [0.3, 0.5], ("infercept", 0.5): [0.1, 0.1],
            ("infercept", 1.0): [0.15, 0.15]}
    for (system, rate), latencies in runs.items():
        lines = [replay.RequestRecord(f"r{i}", "mixed", 0.0, e2e=x * 10, output_tokens=10, finished=True).to_dict()
                 for i, x in enumerate(latencies)]
        (records / f"{system}_{rate:g}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    sweep = claims.Sweep.load(tmp_path / "sweep_x")
    sustainable = sweep.sustainable()  # SLO 0.2: swap crosses between 0.5 and 1.0, infercept never
    assert sustainable["swap"] == (pytest.approx(0.5 + 0.5 * (0.2 - 0.1) / (0.4 - 0.1)), True)
    assert sustainable["infercept"] == (1.0, False)
    assert claims.ratio(sustainable["infercept"], sustainable["swap"]) == "≥ 1.50x"
    assert claims.ratio((0.8, True), (0.4, True)) == "2.00x"
    assert claims.ratio((1.0, False), (1.0, False)).startswith("≈")
    assert claims.ratio((0.45, True), (0.0, True)).startswith("∞")
    assert claims.ratio((1.05, True), (1.25, False)) == "≤ 0.84x"  # the peer never crossed: an upper bound


def test_readme_headline_table_is_what_claims_prints():
    """The README's "Measured" table is pasted from `benchmarks/claims.py`: a number in it that the
    result files do not give fails here. `--check` checks benchmarks/README.md's full table too."""
    claims = load_bench("claims")
    assert claims.main(["--check"]) == 0
    assert claims.readme_table(claims.README.read_text()) == claims.headline_table()


def test_benchmarks_readme_full_table_is_what_claims_full_prints():
    """benchmarks/README.md's "Headline numbers" table is `claims.py --full`, pasted between its own markers,
    and holds every headline row of the README's table."""
    claims = load_bench("claims")
    rows = claims.all_rows()
    full = claims.block(claims.BENCH_README.read_text(), claims.FULL_BEGIN, claims.FULL_END)
    assert full == claims.full_table(rows)
    assert claims.check(rows) == []
    headline = [r for r in rows if r.headline]
    assert 1 <= len(headline) <= claims.HEADLINE_ROWS
    assert all(f"| {claims._cell(r.label())} | {claims._cell(r.measured)} |" in full for r in headline)


def test_claims_rows_state_what_each_side_had():
    """Every printed row names each side's device and host pool, its dtype, the repeats and the machine, and
    links a section of benchmarks/README.md that exists; where InferCept loses to vLLM given the same KV
    memory, the headline shows it."""
    claims = load_bench("claims")
    rows = claims.all_rows()
    sections = claims.headings(claims.BENCH_README.read_text())
    for row in rows:
        assert len(row.sides) >= 2 and row.repeats and row.machine and row.sources, row.claim
        assert row.section in sections, row.section
        text = claims.memory_text(row.sides)
        assert "device" in text or "grown as needed" in text
        assert all(side.dtype for side in row.sides)
        assert "host" in text
    headline = claims.headline_table(rows)
    assert "≤ 0.87x" in headline  # the EPYC trace where vLLM, given device + host pools, sustains more
    assert headline.count("](benchmarks/README.md#") == len([r for r in rows if r.headline])


def test_claims_refuse_an_unequal_memory_ratio_unless_the_row_says_so():
    claims = load_bench("claims")
    device, host = claims.Pool.of_gib(0.03), claims.Pool.of_gib(0.1)
    assert (device.tokens, host.tokens) == (1392, 4656)  # the sweeps' pools in tokens of the embedded model
    assert claims.Pool.of_gib(0.13, claims.VLLM_BLOCK).tokens == 6048  # the vLLM peer given both pools
    infercept = claims.ours("infercept", device, host)
    prefix_cache = claims.ours("prefix-cache", device, host)  # same pools, but it never uses its host pool
    vllm_total = claims.Side("vLLM", "bf16", claims.Pool.of_gib(0.13, claims.VLLM_BLOCK))
    args = ("claim", "1.5x")
    rest = ("one run", "a CPU, a date", ("`x`",), "section")
    with pytest.raises(claims.UnequalMemory):
        claims.Row(*args, (infercept, prefix_cache), *rest)
    with pytest.raises(claims.UnequalMemory):
        claims.Row(*args, (infercept, claims.Side("transformers", "bf16", None)), *rest)
    with pytest.raises(claims.UnequalMemory):  # labelled unequal, but the sides had the same memory
        claims.Row(*args, (infercept, vllm_total), *rest, unequal_memory="vLLM had no host pool")
    row = claims.Row(*args, (infercept, prefix_cache), *rest, unequal_memory="prefix-cache never uses its host pool")
    assert "**Unequal memory:** prefix-cache never uses its host pool." in row.label()
    assert claims.Row(*args, (infercept, vllm_total), *rest).label() == "claim"
    assert "prefix-cache never uses the host pool" in claims.memory_text((infercept, prefix_cache))


def test_vllm_pressure_trace_and_server_command():
    """benchmarks/vllm_pressure.py: its default agents, and one server command for every policy
    but the policy itself (same pool, same chunk size)."""
    pressure = load_bench("vllm_pressure")
    args = pressure.argparse.Namespace(agents=24, rate=4.0, prompt=1000, steps=5, decode=32, returned=32, tool_s=2.0,
                                       seed=0, dtype="bfloat16", max_num_batched_tokens=256, max_model_len=4096,
                                       host_kv_gb=1.0, vllm_python=None)
    trace = pressure.agent_trace(args)
    assert len(trace) == 24 and all(r["prompt_tokens"] == 1000 and len(r["segments"]) == 5 for r in trace)
    assert [s["interception"] is None for s in trace[0]["segments"]] == [False] * 4 + [True]
    arrivals = [r["arrival"] for r in trace]
    assert arrivals == sorted(arrivals) and 3 < len(trace) / arrivals[-1] < 6  # ~4 agents/s
    assert pressure.agent_trace(args) == trace  # seeded
    a, b = (pressure.server_argv(p, 8000, args, 0.1) for p in ("prefix-cache", "infercept"))
    assert [x for x in a if x != "prefix-cache"] == [x for x in b if x != "infercept"]
    assert a[a.index("--backend") + 1] == "vllm" and a[a.index("--kv-cache-gb") + 1] == "0.100000"
    assert a[a.index("--host-kv-gb") + 1] == "1"  # (stock vLLM has no sessions: it never uses it)
    # POLICY@total: the host pool's bytes as device pool too, and no host pool (the equal-memory baseline)
    c = pressure.server_argv("prefix-cache@total", 8000, args, 0.1)
    assert c[c.index("--policy") + 1] == "prefix-cache" and c[c.index("--kv-cache-gb") + 1] == "1.100000"
    assert c[c.index("--host-kv-gb") + 1] == "0"
    sweep = load_bench("sweep")
    assert sweep.system_pools("infercept", 0.03, 0.1) == ("infercept", 0.03, 0.1)
    assert sweep.system_pools("infercept@total", 0.03, 0.1) == ("infercept", 0.13, 0.0)
    with pytest.raises(ValueError):
        sweep.system_pools("infercept@device", 0.03, 0.1)


def test_burst_trace_and_numbers():
    """benchmarks/burst.py: the burst by default (24 agents within 0.1 s, 1,000-token prompts, 5 turns
    of 32 tokens, 0.5 s tools, a 4 GiB pool), and its numbers from request records."""
    burst = load_bench("burst")
    args = burst.parse_args(["--repeats", "2"])
    assert (args.kv_cache_gb, args.repeats, args.policies) == (4.0, 2, ["infercept", "infercept-paper", "prefix-cache"])
    trace = burst.burst_trace(args)
    assert len(trace) == 24 and all(r["prompt_tokens"] == 1000 and len(r["segments"]) == 5 for r in trace)
    assert [s["interception"] is None for s in trace[0]["segments"]] == [False] * 4 + [True]
    assert trace[0]["segments"][0]["interception"]["duration_s"] == 0.5
    arrivals = [r["arrival"] for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[-1] <= 0.1 and burst.burst_trace(args) == trace
    replay = load_bench("replay")
    records = [replay.RequestRecord("a", "agent", 0.0, ttft=2.0, step_ttfts=[1.0, 0.1, 0.2], e2e=10.0, finished=True,
                                    output_tokens=20, interception_s=4.0),
               replay.RequestRecord("b", "agent", 0.0, ttft=4.0, step_ttfts=[3.0, 0.3], e2e=20.0, finished=True,
                                    output_tokens=20),
               replay.RequestRecord("c", "agent", 0.0, ttft=5.0, step_ttfts=[5.0], e2e=30.0, output_tokens=10)]
    s = replay.summarize(records, 30.0)
    assert (s["normalized_latency_median"], s["ttft_median"], s["resumed_ttft_median"]) == (1.0, 4.0, 0.2)
    # completion: finish - arrival; the one cut off is infinitely late
    assert (s["completion_p50"], s["completion_p90"]) == (20.0, math.inf)


def test_measured_h100_profile_loads_and_the_h100_simulations_run_on_it():
    """`--profile` (policy_sim.py, parts_sim.py) puts the profile measured on an H100 under the H100 setup:
    same pools, its T_fwd and copies; long-context workloads add the hand-written attention terms."""
    from bench_modules import BENCH
    from infercept.engine.policy import Profile
    from infercept.engine.policy.profile import h100_llama3_8b
    from infercept.engine.simulation import coarsen_profile

    policy_sim, parts_sim = load_bench("policy_sim"), load_bench("parts_sim")
    path = str(BENCH / "profiles" / "h100_llama3_8b_measured_2026-11-26.json")
    measured, hand = Profile.load(path), h100_llama3_8b()
    assert (measured.S, measured.M, measured.block_size) == (1024, hand.M, hand.block_size)
    assert not measured.has_attention and measured.t_fwd(1) != hand.t_fwd(1)
    setup = policy_sim.setup_named("h100_llama3_8b", path)
    assert policy_sim.setup_named("h100_llama3_8b") is policy_sim.SETUPS["h100_llama3_8b"]
    assert setup.profile() == measured and setup.pool_blocks() == policy_sim.SETUPS["h100_llama3_8b"].pool_blocks()
    opts = dict(setup="h100_llama3_8b", window=20.0, drain=0.0, seed=0, token_scale=16, oracle=False)
    steps = {p: policy_sim.run_one("infercept", 1.0, opts | {"profile": p})["normalized_latency"] for p in (None, path)}
    assert steps[None] != steps[path]
    args = dict(window=150.0, drain=300.0, token_scale=16, long_window=600.0, long_drain=1200.0)
    assert parts_sim.build_workload("mix@14", 0, args | {"profile": path}).profile == coarsen_profile(measured, 16)
    long_hand = parts_sim.build_workload("long@0.05", 0, args).profile
    long_measured = parts_sim.build_workload("long@0.05", 0, args | {"profile": path}).profile
    assert long_hand == coarsen_profile(h100_llama3_8b(attention=True), 16)
    assert long_measured.t_fwd_samples == coarsen_profile(measured, 16).t_fwd_samples
    assert (long_measured.attention_read_s_per_token, long_measured.attention_pair_s) == \
        (long_hand.attention_read_s_per_token, long_hand.attention_pair_s) != (0, 0)


def test_host_step_times_each_host_part_of_a_decode_step(tmp_path):
    """benchmarks/host_step.py on a few short sequences: every part of the host's work timed, the whole the
    sum of the parts."""
    host_step = load_bench("host_step")
    host_step.main(["--batch", "2", "--context", "40", "--steps", "3", "--json", str(tmp_path / "host.json")])
    result = json.loads((tmp_path / "host.json").read_text())
    assert set(result["ms"]) == set(host_step.PARTS) and all(ms > 0 for ms in result["ms"].values()), result
    assert result["host_ms"] == pytest.approx(sum(result["ms"].values()))
