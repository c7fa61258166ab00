"""The host's time in an engine step that the device's work does not hide, fitted to a trace's step logs
(`engine_trace.py --step-log`), for the simulation to charge (`HostCost`, `engine_trace.py --simulate
... --host-ms`): the simulations otherwise count the device's time alone.

A step's unhidden host time is its time less the device's pass and the pass's waits for copies (the
simulation models those itself). Over the steps that queued no swap copies it is fitted as a line in the
number of scheduled sequences (fixed + per sequence; the mean and none per sequence where they all ran
one batch size); a step that queued copies costs the mean of its
residual over that line more. `--without-copies` leaves out the host's queueing of copies before the
pass (`copies_s`): the cost once the copies are queued while the pass runs. With the engine's asynchronous
scheduling a step's log line pairs its time with the pass before's (`device_s`), so the fit is what the
overlap leaves unhidden, and the simulation charges it as is (no `--host-overlapped`).

    python3 benchmarks/gpu/host_cost.py RESULTS/steps_kv1gib   # prints the fit and the --host-ms flag
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def step_logs_of(step_logs: Path) -> dict[str, list[dict]]:
    """Each policy's steps, from the folder's `POLICY.jsonl` or `POLICY.jsonl.gz`, by policy."""
    logs = {}
    for path in sorted(step_logs.glob("*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            logs[path.name.split(".jsonl")[0]] = [json.loads(line) for line in f if line.strip()]
    return logs


def read_steps(step_logs: Path) -> list[dict]:
    """Every step of every policy's log in the folder that ran a pass or queued copies."""
    return [r for rows in step_logs_of(step_logs).values() for r in rows if r["seqs"] or r["swap_in"] or r["swap_out"]]


def fit(rows: list[dict], without_copies: bool = False) -> dict:
    """{"fixed_ms", "per_sequence_ms", "swap_step_ms"} and the steps each part was fitted on."""
    def host_ms(r: dict) -> float:
        hidden = r["device_s"] + r["copy_wait_s"] + (r.get("copies_s", 0.0) if without_copies else 0.0)
        return 1e3 * (r["s"] - hidden)

    plain = [r for r in rows if not r["swap_in"] and not r["swap_out"]]
    swaps = [r for r in rows if r["swap_in"] or r["swap_out"]]
    if not plain:
        raise ValueError("the logs have no step without copies")
    if len({r["seqs"] for r in plain}) > 1:
        per_sequence, fixed = statistics.linear_regression([r["seqs"] for r in plain], [host_ms(r) for r in plain])
    else:  # one batch size: no slope to fit
        per_sequence, fixed = 0.0, statistics.fmean(host_ms(r) for r in plain)
    swap_step = statistics.fmean(host_ms(r) - fixed - per_sequence * r["seqs"] for r in swaps) if swaps else 0.0
    return {"fixed_ms": fixed, "per_sequence_ms": per_sequence, "swap_step_ms": swap_step,
            "steps_without_copies": len(plain), "steps_with_copies": len(swaps)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step_logs", type=Path, help="a folder of step logs (engine_trace.py --step-log)")
    parser.add_argument("--without-copies", action="store_true",
                        help="leave out the host's queueing of copies before the pass")
    args = parser.parse_args(argv)
    f = fit(read_steps(args.step_logs), args.without_copies)
    print(f"fixed {f['fixed_ms']:.3f} ms + {f['per_sequence_ms']:.3f} ms a sequence ({f['steps_without_copies']} "
          f"steps without copies), {f['swap_step_ms']:.3f} ms more in a step with copies ({f['steps_with_copies']})")
    print(f"--host-ms {f['fixed_ms']:.3f} {f['per_sequence_ms']:.3f} {f['swap_step_ms']:.3f}")


if __name__ == "__main__":
    main()
