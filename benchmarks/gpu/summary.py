"""Gather one GPU check's result files into `summary.json` and `summary.md` and print the latter: one
place to read what a run found (and what failed or timed out), in a form a later run can be compared
with field by field. Every input is optional: a step that failed leaves its fields null.

    python3 benchmarks/gpu/summary.py RESULTS_DIR --seconds 312

Reads from RESULTS_DIR: steps.tsv (run.sh: step, exit status or "skipped", seconds), probe.json, pytest.xml, profile_vs_hand.json,
decode_vs_hf.json, model_*.json (make_models.py), engine_trace_kv<GiB>gib.json (engine_trace.py) and the
traces' step logs, steps_kv<GiB>gib/.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from card import card_name, driver_version, hbm_bytes_per_s  # noqa: E402
from host_cost import step_logs_of  # noqa: E402

TRACE_FILE = re.compile(r"engine_trace_kv(.+)gib\.json$")
STEP_LOGS = re.compile(r"steps_kv(.+)gib$")


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finite(x):
    """JSON has no infinity: a run in which most requests never finished has an infinite median."""
    return x if not isinstance(x, float) or math.isfinite(x) else None


def pytest_counts(path: Path) -> dict | None:
    """passed / failed / errors / skipped and the ids of failed tests, from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def steps(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        name, rc, seconds = line.split("\t")
        out.append({"step": name, "rc": None if rc == "skipped" else int(rc), "seconds": int(seconds)})
    return out


# The kinds of trace step the time beyond the device's pass is split by (`step_kind`), in table order.
STEP_KINDS = ("decode, no swaps", "decode, swaps", "prefill, no swaps", "prefill, swaps")


def step_kind(r: dict) -> str:
    """Whether a logged step ran prefill tokens (a mixed step: other graphs, more inputs) and whether it
    queued swap copies."""
    swaps = "swaps" if r["swap_in"] or r["swap_out"] else "no swaps"
    return f"{'prefill' if r['prefill_tokens'] else 'decode'}, {swaps}"


def host_split(step_logs: Path) -> dict:
    """From a trace's step logs (engine_trace.py --step-log, one `POLICY.jsonl[.gz]` each): a step's time
    beyond the device's pass (the step's less the device's), mean ms, by kind of step (`STEP_KINDS`), and
    of it the host's planning, staging of inputs and queueing of copies before the pass, the pass's
    waits for copies (the device's compute stream standing still), the host's applying of the samples
    (the output stage) and the rest, the host's other work (a part logs from before it was logged lack
    is null and stays in the rest, where planning or copies are: the rest is null), with the blocks
    swapped in and out a step and the host's work while the pass ran (not part of the step's time beyond
    the pass): queueing the copies queued then, and the step before's output stage (`async_output`)."""
    split = {}
    for policy, rows in step_logs_of(step_logs).items():
        split[policy] = {}
        for kind in STEP_KINDS:
            chosen = [r for r in rows if step_kind(r) == kind]

            def mean(values):
                values = list(values)
                return sum(values) / len(values) if values and len(values) == len(chosen) else None
            host = mean(1e3 * (r["s"] - r["device_s"]) for r in chosen)
            planning = mean(1e3 * r["schedule_s"] for r in chosen if "schedule_s" in r)
            inputs = mean(1e3 * r["inputs_s"] for r in chosen if "inputs_s" in r)
            copies = mean(1e3 * r["copies_s"] for r in chosen if "copies_s" in r)
            overlapped = mean(1e3 * r["copies_overlapped_s"] for r in chosen if "copies_overlapped_s" in r)
            output_stage = mean(1e3 * r["output_stage_overlapped_s"] for r in chosen
                                if "output_stage_overlapped_s" in r)
            waits = mean(1e3 * r["copy_wait_s"] for r in chosen)
            update = mean(1e3 * r["update_s"] for r in chosen if "update_s" in r)
            parts = (host, planning, copies, waits)
            split[policy][kind] = {
                "steps": len(chosen), "host_ms": host, "schedule_ms": planning, "inputs_ms": inputs,
                "copies_ms": copies, "copies_during_pass_ms": overlapped, "copy_wait_ms": waits,
                "output_stage_during_pass_ms": output_stage,
                "update_ms": update,
                "rest_ms": (host - planning - copies - waits - (inputs or 0.0) - (update or 0.0)
                            if None not in parts else None),
                "swap_in_blocks": mean(r["swap_in"] for r in chosen),
                "swap_out_blocks": mean(r["swap_out"] for r in chosen)}
    return split


def _host_ms(command: str | None) -> list[float] | None:
    """The host's time a step a simulation charged (`--host-ms FIXED PER_SEQUENCE SWAP_STEP`), from its
    command."""
    words = (command or "").split()
    if "--host-ms" not in words:
        return None
    i = words.index("--host-ms")
    return [float(w) for w in words[i + 1:i + 4]]


def summarize(res: Path, seconds: float | None = None, dry: bool = False) -> dict:
    import torch

    card = card_name()
    s = {"card": card, "driver": driver_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "dry_run": dry}
    try:
        import transformers
        s["transformers"] = transformers.__version__
    except ImportError:
        s["transformers"] = None

    model = _load(res / "model_big.json") or {}
    s["shape"] = model.get("shape")
    s["parameters"] = model.get("parameters")

    prof = _load(res / "profile_vs_hand.json")
    t_fwd = {r["tokens"]: r for r in (prof or {}).get("t_fwd_ms", [])}
    s["t_fwd_1_ms"] = t_fwd[1]["measured"] if 1 in t_fwd else None
    s["t_fwd_ms"] = {str(n): r["measured"] for n, r in t_fwd.items()} or None
    s["t_fwd_hand_written_ms"] = {str(n): r["hand_written"] for n, r in t_fwd.items()} or None
    for key in ("saturation_point", "d2h_gb_s", "h2d_gb_s", "copy_overlap", "attention_read_ns_per_token",
                "attention_pair_ps"):
        s[key] = (prof or {}).get(key)

    dec = _load(res / "decode_vs_hf.json") or {}
    rows = dec.get("rows", [])
    decode = {str(r["batch"]): r for r in rows if "batch" in r}
    prefill = next((r for r in rows if "prefill_tokens" in r), None)
    s["decode_tok_s"] = {b: r["infercept_tok_s"] for b, r in decode.items()} or None
    s["transformers_decode_tok_s"] = {b: r["transformers_tok_s"] for b, r in decode.items()} or None
    s["decode_batch1_tok_s"] = decode["1"]["infercept_tok_s"] if "1" in decode else None
    s["decode_batch32_tok_s"] = decode["32"]["infercept_tok_s"] if "32" in decode else None
    s["prefill_tok_s"] = prefill["infercept_tok_s"] if prefill else None
    s["transformers_prefill_tok_s"] = prefill["transformers_tok_s"] if prefill else None
    s["engine_kernels"] = dec.get("kernels")

    # Steps as the engine runs them (CUDA graphs where captured), and the same steps with --enforce-eager.
    step_profile = _load(res / "step_profile.json") or {}
    eager = step_profile.get("eager") or {}
    for batch in (1, 32):
        row = step_profile.get(f"decode_batch{batch}") or {}
        s[f"decode_step_batch{batch}_ms"] = row.get("step_ms_median")
        s[f"decode_runner_batch{batch}_ms"] = row.get("runner_ms_median")
        s[f"eager_decode_step_batch{batch}_ms"] = (eager.get(f"decode_batch{batch}") or {}).get("step_ms_median")
        s[f"sync_output_decode_step_batch{batch}_ms"] = row.get("sync_output_step_ms_median")
        s[f"sync_scheduling_decode_step_batch{batch}_ms"] = row.get("sync_scheduling_step_ms_median")
    grammar = next((k for k in step_profile if k.startswith("grammar_batch")), None)
    s["grammar_step"] = grammar and f"decode, batch {grammar.removeprefix('grammar_batch')}, one under a grammar"
    for key, field in (("grammar_step_ms", "step_ms_median"),
                       ("sync_scheduling_grammar_step_ms", "sync_scheduling_step_ms_median"),
                       ("sync_output_grammar_step_ms", "sync_output_step_ms_median")):
        s[key] = grammar and step_profile[grammar].get(field)
    mixed = next((k for k in step_profile if k.startswith("mixed_")), None)
    s["mixed_step"] = mixed and mixed.removeprefix("mixed_").replace("_plus_", " prefill tokens + ") + " decodes"
    s["mixed_step_ms"] = mixed and step_profile[mixed].get("step_ms_median")
    s["eager_mixed_step_ms"] = (eager.get("mixed") or {}).get("step_ms_median")
    s["decode_graph_launch_batch1_ms"] = (step_profile.get("decode_batch1") or {}).get("graph_launch_ms")
    swap = next((k for k in step_profile if k.startswith("swap_")), None)
    s["swap_step"] = swap and swap.removeprefix("swap_").replace("_beside_", " blocks each way beside ") + " decodes"
    for key, field in (("swap_step_ms", "step_ms_median"), ("swap_step_without_copies_ms", "without_copies_step_ms_median"),
                       ("swap_copies_host_ms", "copies_host_ms_median"),
                       ("swap_copies_overlapped_host_ms", "copies_overlapped_host_ms_median")):
        s[key] = swap and step_profile[swap].get(field)

    # Batch-1 decode streams every weight once a step: tokens/s <= HBM bandwidth / weight bytes.
    s["weight_bytes"] = dec.get("weight_bytes")
    s["hbm_bytes_per_s"] = hbm_bytes_per_s(card)
    if s["weight_bytes"] and s["hbm_bytes_per_s"]:
        s["weight_stream_bound_batch1_ms"] = 1e3 * s["weight_bytes"] / s["hbm_bytes_per_s"]
        s["weight_stream_bound_batch1_tok_s"] = s["hbm_bytes_per_s"] / s["weight_bytes"]
        s["decode_batch1_share_of_bound"] = (s["decode_batch1_tok_s"] / s["weight_stream_bound_batch1_tok_s"]
                                             if s["decode_batch1_tok_s"] else None)
    else:
        s["weight_stream_bound_batch1_ms"] = s["weight_stream_bound_batch1_tok_s"] = None
        s["decode_batch1_share_of_bound"] = None

    # The prefill kernel per case: the engine's tiling, the fastest measured and SDPA, us a layer.
    tiles = (_load(res / "prefill_tiles.json") or {}).get("rows", [])
    kernel = {}
    for case in dict.fromkeys(r["case"] for r in tiles):
        timed = [r for r in tiles if r["case"] == case and r.get("us") is not None]
        engine = next((r for r in timed if r["engine"]), None)
        fastest = min(timed, key=lambda r: r["us"]) if timed else None
        kernel[case] = {"engine_us": engine and engine["us"], "sdpa_us": timed[0]["sdpa_us"] if timed else None,
                        "fastest_us": fastest and fastest["us"], "fastest_tiling": fastest and fastest["tiling"]}
    s["prefill_kernel"] = kernel or None

    s["pytest"] = pytest_counts(res / "pytest.xml")

    latency, trace = {}, {}
    for path in sorted(res.glob("engine_trace_kv*gib.json"), key=lambda p: float(TRACE_FILE.search(p.name)[1])):
        pool = f"{TRACE_FILE.search(path.name)[1]} GiB"
        data = _load(path) or {}
        latency[pool] = {r["policy"]: _finite(r["normalized_latency"]) for r in data.get("rows", [])}
        trace[pool] = {"command": data.get("command"),
                       "rows": [{k: _finite(r.get(k)) for k in ("policy", "requests", "finished", "normalized_latency",
                                                           "ttft_median", "recompute_time_share",
                                                           "swapped_out_blocks", "steps", "step_ms", "device_ms",
                                                           "schedule_ms", "copy_wait_ms", "duration_s")}
                                for r in data.get("rows", [])]}
        for kind in ("simulated", "simulated_host"):
            simulated = _load(path.with_name(path.name.replace(".json", f".{kind}.json"))) or {}
            trace[pool][f"{kind}_rows"] = [{k: _finite(r.get(k)) for k in (
                "policy", "requests", "finished", "normalized_latency", "steps", "step_ms", "device_ms", "schedule_ms",
                "copy_wait_ms")} for r in simulated.get("rows", [])]
            if kind == "simulated_host":
                trace[pool]["host_ms"] = _host_ms(simulated.get("command"))
    s["engine_trace_normalized_latency"] = latency or None
    s["engine_trace"] = trace or None
    logs = sorted(res.glob("steps_kv*gib"), key=lambda p: float(STEP_LOGS.search(p.name)[1]))
    s["engine_trace_host_ms"] = {f"{STEP_LOGS.search(p.name)[1]} GiB": host_split(p) for p in logs} or None
    s["steps"] = steps(res / "steps.tsv")
    s["seconds"] = seconds
    s["targets"] = targets(s)
    s["probe"] = _load(res / "probe.json")
    s["machine_slowed"] = machine_slowed(s["probe"])
    return s


# probe.py's readings and whether a higher value is the faster machine.
PROBE_READINGS = (("matmul_tflops", "matmul, TFLOP/s", True), ("device_copy_tb_s", "device copy, TB/s", True),
                  ("launch_us", "a kernel queued, us", False), ("python_loop_ns", "a Python loop step, ns", False))
SLOWED = 0.8  # a reading at the end under 80% of the start's speed: the machine slowed during the check


def machine_slowed(probe: dict | None) -> list[str]:
    """The readings by which the machine ran slower at the end of the check than at its start."""
    start, end = (probe or {}).get("start"), (probe or {}).get("end")
    if not start or not end:
        return []
    return [label for key, label, higher in PROBE_READINGS
            if start.get(key) and end.get(key) and (end[key] / start[key] if higher else start[key] / end[key]) < SLOWED]


# What the engine is built to reach on an H100 with the 8B shape: (what, the summary's value, at least
# (True) or at most, the bound).
TARGETS = (
    ("T_fwd(1), ms", lambda s: s["t_fwd_1_ms"], False, 7.5),
    ("decode at batch 1, tok/s", lambda s: s["decode_batch1_tok_s"], True, 150.0),
    ("decode at batch 32, tok/s", lambda s: s["decode_batch32_tok_s"], True, 3000.0),
    ("1,000-token prefill, tok/s", lambda s: s["prefill_tok_s"], True, 25000.0),
    ("1 GiB trace, prefix-cache's normalized latency / infercept's", lambda s: _latency_ratio(s, "1 GiB"), True, 3.0),
    ("gpu tests failed or in error", lambda s: s["pytest"] and s["pytest"]["failed"] + s["pytest"]["errors"],
     False, 0),
)


def _latency_ratio(s: dict, pool: str) -> float | None:
    row = (s["engine_trace_normalized_latency"] or {}).get(pool) or {}
    if not row.get("prefix-cache") or not row.get("infercept"):
        return None
    return row["prefix-cache"] / row["infercept"]


def targets(s: dict) -> list[dict]:
    """Each target with its measured value and "met", "missed" or "not measured" (a step skipped or failed)."""
    rows = []
    for what, value_of, at_least, bound in TARGETS:
        value = value_of(s)
        verdict = ("not measured" if value is None
                   else "met" if (value >= bound if at_least else value <= bound) else "missed")
        rows.append({"target": what, "bound": f"{'>=' if at_least else '<='} {_num(bound)}", "value": value,
                     "verdict": verdict})
    return rows


def _num(x) -> str:
    return "–" if x is None else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _f(x, fmt="{:.1f}"):
    return "–" if x is None else fmt.format(x)


def _probe_lines(s: dict) -> list[str]:
    """The machine's speed before and after the steps (probe.py), to tell a slow host from a slow engine."""
    probe = s.get("probe") or {}
    labels = [label for label in ("start", "end") if probe.get(label)]
    if not labels:
        return []
    lines = ["", "**The machine** (`probe.py`, before and after the steps):", "",
             "| reading | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for key, label, _ in PROBE_READINGS:
        lines.append(f"| {label} | " + " | ".join(_f(probe[x].get(key), "{:.3g}") for x in labels) + " |")
    cards = [probe[x].get("card") or {} for x in labels]
    if any(cards):
        lines.append("| SM clock / max, MHz | " + " | ".join(
            f"{_f(c.get('sm_clock_mhz'), '{:.0f}')} / {_f(c.get('max_sm_clock_mhz'), '{:.0f}')}" for c in cards) + " |")
        lines.append("| temperature C, power W | " + " | ".join(
            f"{_f(c.get('temperature_c'), '{:.0f}')}, {_f(c.get('power_w'), '{:.0f}')}" for c in cards) + " |")
        lines.append("| clock event reasons | " + " | ".join(str(c.get("clock_event_reasons")) for c in cards) + " |")
    if s.get("machine_slowed"):
        lines += ["", f"**The machine slowed during the check** (under {SLOWED:.0%} of its start's speed: "
                  f"{', '.join(s['machine_slowed'])}): its later steps' numbers are not the engine's alone."]
    return lines


def markdown(s: dict) -> str:
    head = (f"# GPU check, {s['date']}{' (dry run)' if s['dry_run'] else ''}\n\n{s['card']}, driver {s['driver']}, "
            f"torch {s['torch']} (CUDA {s['cuda']}), transformers {s['transformers']}, Python {s['python']}; "
            f"{_f(s['seconds'], '{:.0f}')} s in all.\n")
    caveat = ("; a dry run's tiny sizes say nothing of them" if s["dry_run"]
              else "" if "H100" in (s["card"] or "") else
              f"; set for an H100, not for this {s['card']}: the speed targets do not carry over")
    lines = [head, "**Targets** (the 8B shape on an H100" + caveat + "):", "",
             "| target | bound | measured | verdict |", "|---|---|---:|---|"]
    lines += [f"| {t['target']} | {t['bound']} | {_num(t['value'])} | {t['verdict']} |" for t in s["targets"]]
    lines += _probe_lines(s)
    lines += ["", "| step | exit status | seconds |", "|---|---:|---:|"]
    lines += [f"| {st['step']} | {'skipped: no time left' if st['rc'] is None else st['rc']}"
              f"{' (timed out)' if st['rc'] in (124, 137) else ''} | {st['seconds']} |" for st in s["steps"]]
    p = s["pytest"]
    lines += ["", "**`pytest -m gpu`**: " + ("no result (see pytest.txt)" if p is None else
              f"{p['passed']} passed, {p['failed']} failed, {p['errors']} errors, {p['skipped']} skipped"
              + (f"; failed: {', '.join(p['failed_tests'])}" if p["failed_tests"] else ""))]
    shape = f"{s['shape']} shape, {_f(s['parameters'] and s['parameters'] / 1e9, '{:.2f}')} B parameters"
    lines += ["", f"**Profile** ({shape}), measured vs hand-written `h100_llama3_8b()`:", "",
              "| tokens | measured T_fwd ms | hand-written ms |", "|---:|---:|---:|"]
    for n, ms in (s["t_fwd_ms"] or {}).items():
        lines.append(f"| {n} | {ms:.2f} | {s['t_fwd_hand_written_ms'][n]:.2f} |")
    if s["saturation_point"]:
        sp, d2h, h2d = s["saturation_point"], s["d2h_gb_s"], s["h2d_gb_s"]
        lines += ["", f"Saturation point {sp['measured']} vs {sp['hand_written']} tokens; copies device->host "
                  f"{d2h['measured']:.1f} GB/s, host->device {h2d['measured']:.1f} GB/s vs {d2h['hand_written']:.1f}"
                  + (f"; {100 * s['copy_overlap']['measured']:.0f}% of a swap's copy time hidden behind a forward "
                     "pass" if (s["copy_overlap"] or {}).get("measured") is not None else "") + "."]
    if s["attention_read_ns_per_token"]:
        read, pair = s["attention_read_ns_per_token"], s["attention_pair_ps"]
        lines += ["", f"Attention over the context: a decode {read['measured']:.1f} ns per context token, a prefill "
                  f"chunk {pair['measured']:.3f} ps per (query, context token) pair; hand-written "
                  f"`h100_llama3_8b(attention=True)` {read['hand_written']:.1f} / {pair['hand_written']:.3f}."]
    lines += ["", f"**Engine vs transformers** ({shape}; engine kernels {s['engine_kernels']}):", "",
              "| workload | infercept tok/s | transformers tok/s |", "|---|---:|---:|"]
    for b, tok_s in (s["decode_tok_s"] or {}).items():
        lines.append(f"| decode, batch {b} | {tok_s:.1f} | {s['transformers_decode_tok_s'][b]:.1f} |")
    if s["prefill_tok_s"] is not None:
        lines.append(f"| prefill | {s['prefill_tok_s']:.1f} | {s['transformers_prefill_tok_s']:.1f} |")
    if s["weight_stream_bound_batch1_tok_s"]:
        lines += ["", f"Batch-1 weight-stream bound: {s['weight_bytes'] / 1e9:.2f} GB at "
                  f"{s['hbm_bytes_per_s'] / 1e12:.2f} TB/s = {s['weight_stream_bound_batch1_ms']:.2f} ms a token, "
                  f"{s['weight_stream_bound_batch1_tok_s']:.0f} tok/s; the engine reaches "
                  f"{_f(s['decode_batch1_share_of_bound'] and 100 * s['decode_batch1_share_of_bound'], '{:.0f}')}%."]
    if s["decode_step_batch1_ms"] is not None:
        lines += ["", "**Steps** (`engine.step()` median ms; eager: `--enforce-eager`, the same kernels without "
                  "graphs; planned after the samples: `--no-async-scheduling`, and output stage after the pass: "
                  "`--no-async-output` too, both with graphs):", "",
                  "| step | CUDA graphs | eager | planned after the samples | output stage after the pass |",
                  "|---|---:|---:|---:|---:|"]
        for batch in (b for b in (1, 32) if s[f"decode_step_batch{b}_ms"] is not None):
            lines.append(f"| decode, batch {batch} | {_f(s[f'decode_step_batch{batch}_ms'], '{:.2f}')} | "
                         f"{_f(s[f'eager_decode_step_batch{batch}_ms'], '{:.2f}')} | "
                         f"{_f(s.get(f'sync_scheduling_decode_step_batch{batch}_ms'), '{:.2f}')} | "
                         f"{_f(s.get(f'sync_output_decode_step_batch{batch}_ms'), '{:.2f}')} |")
        if s["mixed_step"]:
            lines.append(f"| mixed: {s['mixed_step']} | {_f(s['mixed_step_ms'], '{:.2f}')} | "
                         f"{_f(s['eager_mixed_step_ms'], '{:.2f}')} | – | – |")
        if s.get("grammar_step"):
            lines.append(f"| {s['grammar_step']} | {_f(s['grammar_step_ms'], '{:.2f}')} | – | "
                         f"{_f(s['sync_scheduling_grammar_step_ms'], '{:.2f}')} | "
                         f"{_f(s['sync_output_grammar_step_ms'], '{:.2f}')} |")
        launch = s.get("decode_graph_launch_batch1_ms")
        if isinstance(launch, float):  # results of 2026-11-28: the replay alone only
            lines += ["", f"The batch-1 decode graph's launch, host time: {launch:.3f} ms replayed alone."]
        elif launch is not None:
            lines += ["", f"The batch-1 decode graph's launch, host time: {launch['alone']:.3f} ms replayed alone, "
                      f"{launch['in_step']:.3f} ms in a step, {launch['after_sync']:.3f} ms in a step with the stream "
                      f"synchronized first (those steps {launch['step_ms_after_sync']:.2f} ms)."]
        if s.get("swap_step"):
            lines += ["", f"Swap copies, {s['swap_step']}: a step {_f(s['swap_step_ms'], '{:.2f}')} ms against "
                      f"{_f(s['swap_step_without_copies_ms'], '{:.2f}')} without them; queueing them "
                      f"{_f(s['swap_copies_host_ms'], '{:.3f}')} ms of host time before the pass, "
                      f"{_f(s['swap_copies_overlapped_host_ms'], '{:.3f}')} while it ran."]
    if s.get("prefill_kernel"):
        lines += ["", "**Prefill kernel** (one layer, us; `prefill_tiles.md`: every tiling):", "",
                  "| case | engine's tiling | fastest tiling | fastest | SDPA |", "|---|---:|---|---:|---:|"]
        for case, k in s["prefill_kernel"].items():
            t = k["fastest_tiling"]
            lines.append(f"| {case} | {_f(k['engine_us'])} | "
                         f"{'–' if t is None else ', '.join(f'{n} {v}' for n, v in t.items())} | "
                         f"{_f(k['fastest_us'])} | {_f(k['sdpa_us'])} |")
    host_ms = next((t["host_ms"] for t in (s["engine_trace"] or {}).values() if t.get("host_ms")), None)
    lines += ["", "**Engine trace** (normalized latency, s/token; finished/requests; \"simulated\": the same trace in "
              "`SimulatedEngine` on this run's profile, virtual clock, the scheduler's ms on the host's CPU; "
              "\"with the host's time\": the clock also charges each step the host's time beyond the device's "
              "fitted to this run's step logs, `benchmarks/gpu/host_cost.py`"
              + ("" if host_ms is None else f", here {host_ms[0]:.3f} ms + {host_ms[1]:.3f} a sequence + "
                 f"{host_ms[2]:.3f} in a step with copies") + "):", "",
              "| device pool | policy | normalized latency | finished | steps | step ms (device's, scheduler's, copy waits) |",
              "|---|---|---:|---:|---:|---:|"]
    for pool, t in (s["engine_trace"] or {}).items():
        # The rerun of a failed trace (run.sh) is marked; a CPU's dry run is synchronous by default, unmarked.
        forced_sync = "--no-async-scheduling" in (t["command"] or "")
        engine_rows = [dict(r, policy=f"{r['policy']}, synchronous scheduling") if forced_sync else r for r in t["rows"]]
        for r in (engine_rows + [dict(r, policy=f"{r['policy']}, simulated") for r in t.get("simulated_rows", [])]
                  + [dict(r, policy=f"{r['policy']}, simulated with the host's time")
                     for r in t.get("simulated_host_rows", [])]):
            lines.append(f"| {pool} | {r['policy']} | {_f(r['normalized_latency'], '{:.4g}')} | "
                         f"{r['finished']}/{r['requests']} | {r['steps']} | {_f(r['step_ms'], '{:.2f}')} "
                         f"({_f(r.get('device_ms'), '{:.2f}')}, {_f(r['schedule_ms'], '{:.2f}')}, "
                         f"{_f(r.get('copy_wait_ms'), '{:.2f}')}) |")
    if s.get("engine_trace_host_ms"):
        lines += ["", "**A trace step beyond the device's pass** (mean ms: the step's less the device's; of it "
                  "the scheduler's planning, the staging of the pass's inputs, the queueing of swap copies before "
                  "the pass, the pass's waits for copies, the applying of the samples (the output stage) and the "
                  "rest, the host's other work; beside it, the host's work while the pass ran, hidden there "
                  "unless it outlasts the pass: queueing the copies it queued then, and the step before's "
                  "output stage where it runs then), by whether the step ran prefill tokens and queued swap "
                  "copies:",
                  "",
                  "| device pool | policy | steps | blocks in / out a step | beyond the pass, ms | planning | "
                  "inputs | copies | copy waits | samples applied | rest | copies during the pass | "
                  "output stage during the pass |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for pool, policies in s["engine_trace_host_ms"].items():
            for policy, kinds in policies.items():
                for kind, k in kinds.items():
                    if k["steps"]:
                        lines.append(f"| {pool} | {policy} | {k['steps']} {kind} | "
                                     f"{_f(k['swap_in_blocks'])} / {_f(k['swap_out_blocks'])} | "
                                     f"{_f(k['host_ms'], '{:.2f}')} | {_f(k['schedule_ms'], '{:.2f}')} | "
                                     f"{_f(k['inputs_ms'], '{:.2f}')} | {_f(k['copies_ms'], '{:.2f}')} | "
                                     f"{_f(k['copy_wait_ms'], '{:.2f}')} | {_f(k['update_ms'], '{:.2f}')} | "
                                     f"{_f(k['rest_ms'], '{:.2f}')} | {_f(k['copies_during_pass_ms'], '{:.2f}')} | "
                                     f"{_f(k['output_stage_during_pass_ms'], '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--seconds", type=float, default=None, help="the whole check's wall time")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    res = Path(args.results)
    s = summarize(res, args.seconds, args.dry)
    (res / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    text = markdown(s)
    (res / "summary.md").write_text(text)
    print(text)
    print(f"written: {res / 'summary.json'}, {res / 'summary.md'}")


if __name__ == "__main__":
    main()
