"""The GPU check (benchmarks/gpu/, `make gpu-check`) cannot rot between the rare runs on a GPU host: its
Python steps run here on a two-layer model of the embedded tokenizer's vocabulary, in float32 on the CPU,
in the same order as run.sh (models, the profile against the hand-written one, engine vs transformers,
the engine trace, the summary). What cannot run here (the wheels' install, CUDA) is `make gpu-check DRY=1`'s
and the GPU host's. Nothing here asserts on time."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench_modules import BENCH, load_bench

GPU = BENCH / "gpu"


def load_gpu(name: str):
    """A module of benchmarks/gpu/, loaded by path (its modules import each other by file name)."""
    sys.path.insert(0, str(GPU))
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_models, summary = load_gpu("make_models"), load_gpu("summary")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="2" tests="6"><testcase classname="tests.test_gpu" name="test_a"/><testcase classname="tests.test_gpu"
name="test_b"><failure message="x"/></testcase></testsuite></testsuites>"""


@pytest.fixture(scope="module")
def tiny_model(default_model_dir, tmp_path_factory):
    """The dry run's stand-in for the 8B shape, in two shards (the 8B model is written in four)."""
    make_models.SHARD_BYTES, saved = 4 << 20, make_models.SHARD_BYTES
    try:
        info = make_models.make_model(default_model_dir, tmp_path_factory.mktemp("models") / "tiny", "tiny")
    finally:
        make_models.SHARD_BYTES = saved
    return info


def test_random_model_has_the_shape_and_loads_in_the_engine_and_transformers(tiny_model, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import hf_greedy
    from infercept.engine import LLM, SamplingParams

    path = Path(tiny_model["path"])
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and index["metadata"]["total_size"] == tiny_model["bytes"]
    assert not (path / "model.safetensors").exists()
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in make_models.SHAPES["tiny"]} == make_models.SHAPES["tiny"]
    assert config["vocab_size"] == json.loads((Path(default_model_dir) / "config.json").read_text())["vocab_size"]
    assert (path / "tokenizer.json").read_bytes() == (Path(default_model_dir) / "tokenizer.json").read_bytes()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == tiny_model["parameters"]
    assert all(bool((p == 1).all()) for n, p in hf.named_parameters() if n.endswith("norm.weight"))
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_gb=0.02, host_kv_gb=0.01, progress=False)
    ids = llm.tokenizer.encode("The capital of France is")
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, ids, 6)


def test_the_check_steps_and_their_summary(tiny_model, tmp_path, monkeypatch):
    """profile_vs_hand, decode_vs_hf, step_profile and engine_trace on the tiny model as run.sh calls them (smaller), then
    the summary of what they wrote."""
    monkeypatch.setenv("INFERCEPT_CACHE", str(tmp_path / "cache"))  # the engine's cached start-up profile
    model, res = tiny_model["path"], tmp_path / "res"
    res.mkdir()
    (res / "model_big.json").write_text(json.dumps(tiny_model))
    probe = load_gpu("probe")
    probe.main(["--label", "start", "--out", str(res), "--device", "cpu"])
    load_gpu("profile_vs_hand").main(["--model", model, "--out", str(res), "--dtype", "float32", "--device", "cpu",
                                      "--kv-cache-gb", "0.02", "--host-kv-gb", "0.02", "--repeats", "1"])
    load_gpu("decode_vs_hf").main(["--model", model, "--out", str(res), "--dtype", "float32", "--device", "cpu",
                                   "--batches", "1", "2", "--prompt-len", "8", "--decode-tokens", "8",
                                   "--prefill-len", "64", "--kv-cache-gb", "0.02"])
    load_gpu("step_profile").main(["--model", model, "--out", str(res), "--dtype", "float32", "--device", "cpu",
                                   "--batches", "1", "--steps", "4", "--prefill-len", "64", "--kv-cache-gb", "0.02",
                                   "--mixed-chunk", "16", "--mixed-decodes", "2", "--grammar-batch", "2",
                                   "--swap-blocks", "4", "--eager-too",
                                   "--async-output", "--async-scheduling"])  # as on a GPU: decode steps timed 3 ways
    load_bench("engine_trace").main(
        ["--model", model, "--policies", "prefix-cache", "infercept", "--rate", "2", "--window", "1", "--until", "3",
         "--context-scale", "0.05", "--decode-scale", "0.05", "--interception-scale", "0.01",
         "--max-interceptions", "1", "--max-context", "128", "--kv-cache-gb", "0.002", "--host-kv-gb", "0.01",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--threads", "1",
         "--json", str(res / "engine_trace_kv0.002gib.json"), "--step-log", str(res / "steps_kv0.002gib")])
    step_counts = {}
    for policy in ("prefix-cache", "infercept"):  # each policy's step log, a line a step
        lines = [json.loads(x) for x in (res / "steps_kv0.002gib" / f"{policy}.jsonl").read_text().splitlines()]
        assert lines and all(line["copy_wait_s"] == 0.0 and line["s"] > 0 for line in lines)  # a CPU: no waits
        assert all(0 <= line["device_s"] < line["s"] for line in lines) and any(line["device_s"] for line in lines)
        assert all(0 < line["schedule_s"] and 0 <= line["copies_s"] and 0 < line["update_s"] and 0 <= line["inputs_s"]
                   and line["device_s"] + line["schedule_s"] + line["inputs_s"] + line["copies_s"] + line["update_s"]
                   < line["s"] for line in lines)  # parts of the step, apart
        step_counts[policy] = len(lines)
    # Triton's interpreter is chosen when Triton is imported: the tilings' step runs in a process of its own.
    subprocess.run([sys.executable, str(GPU / "prefill_tiles.py"), "--dry", "--out", str(res)], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    # The same trace simulated on the profile just measured (the simulation's side of the engine's run).
    simulate = ["--simulate", str(res / "profile.json"), "--policies", "prefix-cache", "infercept", "--rate", "2",
                "--window", "1", "--until", "3", "--context-scale", "0.05", "--decode-scale", "0.05",
                "--interception-scale", "0.01", "--max-interceptions", "1", "--max-context", "128",
                "--kv-cache-gb", "0.002", "--host-kv-gb", "0.01", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
    load_bench("engine_trace").main(simulate + ["--json", str(tmp_path / "simulated.json")])
    simulated = json.loads((tmp_path / "simulated.json").read_text())["rows"]
    assert [r["policy"] for r in simulated] == ["prefix-cache", "infercept"]
    assert all(r["steps"] > 0 and r["finished"] > 0 and 0 < r["schedule_ms"] and r["copy_wait_ms"] >= 0
               and 0 < r["device_ms"] <= r["step_ms"] for r in simulated), simulated
    # Charging the host time fitted to the engine's step logs: the simulated steps take longer than the
    # device's time and the copy waits by about the fit.
    host_cost = load_gpu("host_cost")
    fit = host_cost.fit(host_cost.read_steps(res / "steps_kv0.002gib"))
    load_bench("engine_trace").main(simulate + ["--host-ms", str(fit["fixed_ms"]), str(fit["per_sequence_ms"]),
                                                str(fit["swap_step_ms"]), "--json",
                                                str(res / "engine_trace_kv0.002gib.simulated_host.json")])
    charged = json.loads((res / "engine_trace_kv0.002gib.simulated_host.json").read_text())["rows"]
    assert all(r["step_ms"] - r["device_ms"] - r["copy_wait_ms"] > 0.5 * fit["fixed_ms"] > 0 for r in charged), charged
    assert all(r["step_ms"] - r["device_ms"] - r["copy_wait_ms"] < 1e-6 for r in simulated), simulated
    (res / "pytest.xml").write_text(JUNIT)
    (res / "steps.tsv").write_text("setup\t0\t3\npytest -m gpu\t1\t40\nengine trace 1 GiB\t124\t90\n"
                                   "engine trace 16 GiB\tskipped\t0\n")

    probe.main(["--label", "end", "--out", str(res), "--device", "cpu"])
    s = summary.summarize(res, seconds=123.0, dry=True)
    assert set(s["probe"]) == {"start", "end"} and s["probe"]["end"]["card"] is None  # a CPU: no nvidia-smi
    assert all(s["probe"]["start"][key] > 0 for key, _, _ in summary.PROBE_READINGS)
    assert json.loads(json.dumps(s, allow_nan=False)) == s  # strict JSON: no infinities
    required = ("card", "driver", "torch", "cuda", "date", "t_fwd_1_ms", "decode_batch1_tok_s", "decode_batch32_tok_s",
                "prefill_tok_s", "pytest", "engine_trace_normalized_latency", "weight_stream_bound_batch1_tok_s",
                "seconds")
    assert set(required) <= set(s)
    assert s["card"] == "cpu" and s["shape"] == "tiny" and s["seconds"] == 123.0
    assert s["t_fwd_1_ms"] > 0 and set(s["t_fwd_ms"]) == {"1", "32", "128", "256", "512", "1024"}
    assert s["saturation_point"]["hand_written"] == 256
    assert s["attention_read_ns_per_token"]["measured"] >= 0 and s["attention_pair_ps"]["hand_written"] > 0
    assert set(s["decode_tok_s"]) == {"1", "2"} and s["decode_batch32_tok_s"] is None and s["prefill_tok_s"] > 0
    assert s["weight_bytes"] == 2 * tiny_model["bytes"]  # float32 in the engine, bf16 on disk
    assert s["hbm_bytes_per_s"] is None and s["weight_stream_bound_batch1_tok_s"] is None  # a CPU: no datasheet
    assert s["pytest"] == {"passed": 3, "failed": 1, "errors": 0, "skipped": 2,
                           "failed_tests": ["tests.test_gpu::test_b"]}
    assert set(s["engine_trace_normalized_latency"]["0.002 GiB"]) == {"prefix-cache", "infercept"}
    for r in s["engine_trace"]["0.002 GiB"]["rows"]:  # the model's and the scheduler's times are parts of the step's
        assert r["steps"] > 0 and 0 < r["schedule_ms"] < r["step_ms"] and r["copy_wait_ms"] == 0.0, r
        assert 0 < r["device_ms"] and r["device_ms"] + r["schedule_ms"] < r["step_ms"], r
    for policy, kinds in s["engine_trace_host_ms"]["0.002 GiB"].items():  # from the step logs
        assert sum(k["steps"] for k in kinds.values()) == step_counts[policy]
        assert all(0 < k["schedule_ms"] < k["host_ms"] for k in kinds.values() if k["steps"]), kinds
        assert list(kinds) == list(summary.STEP_KINDS)  # by prefill, by swaps
        assert all(k["rest_ms"] == pytest.approx(k["host_ms"] - k["schedule_ms"] - k["inputs_ms"] - k["copies_ms"]
                                                 - k["copy_wait_ms"] - k["update_ms"])
                   and k["inputs_ms"] > 0 and k["update_ms"] > 0 for k in kinds.values() if k["steps"]), kinds
        assert all(k["copies_during_pass_ms"] == 0 == k["output_stage_during_pass_ms"]  # a CPU: nothing overlaps
                   for k in kinds.values() if k["steps"])
    assert [st["rc"] for st in s["steps"]] == [0, 1, 124, None]
    text = summary.markdown(s)
    assert "(timed out)" in text and "skipped: no time left" in text and "Attention over the context" in text
    assert "| 0.002 GiB | infercept |" in text and "3 passed, 1 failed" in text
    assert s["engine_trace"]["0.002 GiB"]["host_ms"] == pytest.approx(
        [fit["fixed_ms"], fit["per_sequence_ms"], fit["swap_step_ms"]])
    assert "| 0.002 GiB | infercept, simulated with the host's time |" in text
    assert "synchronous scheduling" not in text  # a CPU's default, not a rerun
    rerun = json.loads((res / "engine_trace_kv0.002gib.json").read_text())
    assert [r["async_scheduling"] for r in rerun["rows"]] == [False, False]  # what the engine ran: a CPU's default
    rerun["command"] += " --no-async-scheduling"  # as run.sh reruns a failed trace
    (res / "engine_trace_kv0.002gib.json").write_text(json.dumps(rerun))
    assert "| 0.002 GiB | infercept, synchronous scheduling |" in summary.markdown(summary.summarize(res, dry=True))
    assert "A trace step beyond the device's pass" in text and "| matmul, TFLOP/s |" in text
    verdicts = {t["target"]: t["verdict"] for t in s["targets"]}  # the dry run's tiny sizes: verdicts only
    assert verdicts["decode at batch 32, tok/s"] == "not measured"  # batches 1 and 2 only
    assert verdicts["gpu tests failed or in error"] == "missed" and "| gpu tests failed or in error | <= 0 | 1 | missed |" in text
    assert set(verdicts.values()) <= {"met", "missed", "not measured"} and len(verdicts) == 6
    assert (res / "profile.json").exists() and (res / "decode_vs_hf.md").exists()
    assert s["decode_step_batch1_ms"] > 0 and s["decode_step_batch32_ms"] is None
    assert s["sync_output_decode_step_batch1_ms"] > 0 and s["sync_output_decode_step_batch32_ms"] is None
    assert s["sync_scheduling_decode_step_batch1_ms"] > 0 and "| planned after the samples |" in text
    steps = json.loads((res / "step_profile.json").read_text())
    assert "error" not in steps and steps["prefill"]["tok_s"] > 0 and steps["eager"]["decode_batch1"]["step_ms"]
    assert "cumulative" in (res / "step_profile.txt").read_text()  # the cProfile table
    assert s["mixed_step"] == "16 prefill tokens + 2 decodes" and s["mixed_step_ms"] > 0 and s["eager_mixed_step_ms"] > 0
    assert "| mixed: 16 prefill tokens + 2 decodes |" in text
    steps_table = text.split("**Steps**")[1]  # graphs' path, eager, planned after the samples, output stage after
    decode_row = next(line for line in steps_table.splitlines() if line.startswith("| decode, batch 1 |"))
    assert decode_row.count("|") == 6 and "–" not in decode_row, decode_row
    assert s["swap_step"] == "4 blocks each way beside 2 decodes" and s["swap_copies_host_ms"] > 0
    assert s["swap_copies_overlapped_host_ms"] == 0  # a CPU copies before the pass
    assert s["swap_step_ms"] > 0 and s["swap_step_without_copies_ms"] > 0 and "Swap copies, 4 blocks" in text
    assert s["decode_graph_launch_batch1_ms"] is None  # a CPU: no graphs; as a GPU run reports it:
    s["decode_graph_launch_batch1_ms"] = {"alone": 0.009, "in_step": 0.5, "after_sync": 0.02, "step_ms_after_sync": 6.1}
    assert "0.009 ms replayed alone, 0.500 ms in a step, 0.020 ms" in summary.markdown(s)
    assert s["grammar_step"] == "decode, batch 2, one under a grammar" and s["grammar_step_ms"] > 0
    assert s["sync_scheduling_grammar_step_ms"] > 0 and "| decode, batch 2, one under a grammar |" in text
    assert "not for this" not in text  # a dry run says its sizes say nothing; a card other than an H100:
    assert "set for an H100, not for this NVIDIA H200" in summary.markdown({**s, "dry_run": False,
                                                                           "card": "NVIDIA H200"})
    tiles = json.loads((res / "prefill_tiles.json").read_text())["rows"]
    assert len(tiles) == 6 and sum(r["engine"] for r in tiles) == 3  # two tilings, three cases
    assert all(r["max_abs_diff"] < 1e-4 for r in tiles), tiles  # every tiling against SDPA in fp32
    assert set(s["prefill_kernel"]) == {"prefill_40", "chunk_16_after_48", "mixed_8_2x30"}


def test_batch1_bound_uses_the_cards_hbm_bandwidth():
    card = load_gpu("card")
    assert card.hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert card.hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert card.hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12 and card.hbm_bytes_per_s("Tesla T4") is None
    assert card.slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_wheels_are_installed_only_where_the_host_misses_what_is_needed(tmp_path):
    select = load_gpu("select_wheels").select
    (tmp_path / "manifest.json").write_text(json.dumps({"wheels": [
        {"file": "transformers-5.23.0-py3-none-any.whl", "name": "transformers", "version": "5.23.0",
         "need": "==5.23.0"},
        {"file": "huggingface_hub-1.33.0-py3-none-any.whl", "name": "huggingface-hub", "version": "1.33.0",
         "need": "<3.0,>=1.31.0"},
        {"file": "llguidance-1.9.1.whl", "name": "llguidance", "version": "1.9.1", "need": ">=1.0"}]}))
    host = {"transformers": "5.17.0", "huggingface-hub": "1.32.0"}
    assert [(p.name, why) for p, why in select(tmp_path, host.get)] == [
        ("transformers-5.23.0-py3-none-any.whl", "transformers 5.17.0 misses ==5.23.0"),
        ("llguidance-1.9.1.whl", "llguidance absent")]
    assert select(tmp_path, {"transformers": "5.23.0", "huggingface-hub": "2.0", "llguidance": "1.2"}.get) == []


def test_pack_ships_the_project_pin_and_links_every_top_level_package():
    pack, link = load_gpu("pack"), load_gpu("link_package")
    pyproject = tomllib.loads((BENCH.parent / "pyproject.toml").read_text())
    assert pack.project_pin("transformers") in pyproject["project"]["dependencies"]
    assert pack.to_download()[0] == pack.project_pin("transformers")
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    top = link.top_level_packages()
    assert {f"infercept.{k}" for k in top} == {n for n in dirs if n.count(".") == 1}
    assert all(dirs[f"infercept.{k}"] == v and (BENCH.parent / v / "__init__.py").exists() for k, v in top.items())


# The server's dependencies, which the GPU host does not have: a gpu-marked test file that imports one, at
# any depth, fails the host's whole pytest step at collection (a helper moved into live_server.py, which
# imports openai, once did).
SERVER_ONLY = ("openai", "fastapi", "starlette", "uvicorn", "sse_starlette", "mcp", "langchain_core", "agents",
               "pydantic_ai", "prometheus_client")


def test_gpu_marked_test_files_collect_without_the_servers_dependencies():
    tests = Path(__file__).parent
    files = [str(p) for p in sorted(tests.glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    assert len(files) >= 4, files
    blocked = ("import sys, pytest; sys.modules.update(dict.fromkeys(%r)); "
               "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'gpu', *sys.argv[1:]]))"
               % (SERVER_ONLY,))
    result = subprocess.run([sys.executable, "-c", blocked, *files], cwd=tests.parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_the_summary_says_when_the_machine_slowed_during_the_check():
    """probe.py's readings before and after the steps: a reading under 80% of the start's speed at the end
    (a lower throughput, a longer time) is named, in the summary and its markdown."""
    start = {"matmul_tflops": 700.0, "device_copy_tb_s": 3.0, "launch_us": 5.0, "python_loop_ns": 40.0}
    steady = dict(start, matmul_tflops=650.0, launch_us=6.0)
    assert summary.machine_slowed({"start": start, "end": steady}) == []
    slowed = dict(start, device_copy_tb_s=1.5, python_loop_ns=80.0)
    assert summary.machine_slowed({"start": start, "end": slowed}) == ["device copy, TB/s", "a Python loop step, ns"]
    assert summary.machine_slowed({"start": start}) == [] and summary.machine_slowed(None) == []
    text = "\n".join(summary._probe_lines({"probe": {"start": start, "end": slowed},
                                            "machine_slowed": ["device copy, TB/s"]}))
    assert "| device copy, TB/s | 3 | 1.5 |" in text and "The machine slowed during the check" in text


def test_the_host_cost_fit_recovers_a_known_line(tmp_path):
    """`host_cost.py` fits the host's unhidden time a step (the step's less the device's and the copy
    waits) as fixed + per sequence over steps without copies, and the mean residual of steps with
    copies; `--without-copies` takes their queueing out too."""
    import gzip

    host_cost = load_gpu("host_cost")
    rows = []
    for i in range(40):
        seqs, swaps = 1 + i % 7, i % 3 == 0
        host = 0.0006 + 0.00003 * seqs + (0.0008 if swaps else 0.0)
        rows.append({"s": 0.009 + host + 0.0002 * swaps, "device_s": 0.009, "copy_wait_s": 0.0002 * swaps,
                     "seqs": seqs, "swap_in": 4 * swaps, "swap_out": 2 * swaps, "copies_s": 0.0005 * swaps})
    rows.append({"s": 0.001, "device_s": 0.0, "copy_wait_s": 0.0, "seqs": 0, "swap_in": 0, "swap_out": 0})  # idle
    with gzip.open(tmp_path / "infercept.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    fit = host_cost.fit(host_cost.read_steps(tmp_path))
    assert fit["fixed_ms"] == pytest.approx(0.6) and fit["per_sequence_ms"] == pytest.approx(0.03)
    assert fit["swap_step_ms"] == pytest.approx(0.8) and fit["steps_with_copies"] == 14
    assert host_cost.fit(host_cost.read_steps(tmp_path), without_copies=True)["swap_step_ms"] == pytest.approx(0.3)
    one_size = host_cost.fit([r for r in rows if r["seqs"] == 2])
    assert one_size["fixed_ms"] == pytest.approx(0.66) and one_size["per_sequence_ms"] == 0
    with pytest.raises(ValueError, match="no step without copies"):
        host_cost.fit([r for r in rows if r["swap_in"]])
