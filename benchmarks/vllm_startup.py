"""The vLLM backend's start-up on a CPU under vLLM's two executors, side by side: the default ("mp": vLLM's
engine core starts one more Python process that runs the model) and the one-process executor the tests
use ("uni" with VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs it; tests/vllm_env.py). Each round
starts the worker in one mode, then the other, and records the seconds until it serves and the resident
memory of the worker's process tree; the embedded model in float32 without torch.compile, as the tests
start it.

    python benchmarks/vllm_startup.py [--rounds 2] [--out benchmarks/results/vllm_startup_DATE/vllm_startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, today  # noqa: E402

from infercept.engine import VllmBackend, default_vllm_python, ensure_default_model  # noqa: E402

MODES = {"mp": ({}, {}),
         "uni": ({"distributed_executor_backend": "uni"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root`'s descendants (not `root` itself), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            status = (stat.parent / "status").read_text()
        except OSError:
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total / 1024


def start_once(model: str, mode: str) -> dict:
    engine_args, env = MODES[mode]
    threads = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))}
    began = time.perf_counter()
    backend = VllmBackend.create(model, python=default_vllm_python(), policy="preserve", dtype="float32",
                                 max_model_len=2048, kv_cache_gb=0.25, host_kv_gb=0,
                                 engine_args={"enforce_eager": True, **engine_args}, env={**threads, **env})
    backend.start()
    seconds = time.perf_counter() - began
    rss = tree_rss_mb(os.getpid())
    backend.shutdown()
    return {"mode": mode, "start_s": round(seconds, 2), "tree_rss_mb": round(rss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=f"benchmarks/results/vllm_startup_{today()}/vllm_startup.json")
    args = ap.parse_args()
    model = ensure_default_model()
    runs = []
    for r in range(args.rounds):
        for mode in MODES:
            runs.append(start_once(model, mode))
            print(f"round {r + 1}: {runs[-1]}", flush=True)
    summary = {mode: {"start_s": statistics.median(x["start_s"] for x in runs if x["mode"] == mode),
                      "tree_rss_mb": statistics.median(x["tree_rss_mb"] for x in runs if x["mode"] == mode)}
               for mode in MODES}
    result = {"machine": cpu_name(), "date": today(), "model": model, "runs": runs, "median": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{cpu_name()}, {today()}, the embedded model (float32, eager), median of {args.rounds}:\n")
    print("| executor | start-up, s | worker's process tree, MB |\n|---|---:|---:|")
    for mode, m in summary.items():
        print(f"| {mode} | {m['start_s']:.1f} | {m['tree_rss_mb']:.0f} |")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
