"""How fast the GPU check's machine is right now, before its steps and again after them: a lent GPU host
can run the same code at a fraction of another's speed (one H100 host took 1.3-3x longer over the same
kernels than another the same morning, 2026-11-28, and built the 8B model in 27 s against 17), and a
reader of the results must be able to tell such a machine from a slower engine.

Four readings, each the best of five rounds, a few seconds in all:
- `matmul_tflops`: a square bf16 matrix product on the device (8192: the compute a prefill is bound by);
- `device_copy_tb_s`: a device-to-device copy of 1 GiB, bytes read and written (the bandwidth a decode
  step streams its weights at);
- `launch_us`: host time to queue one tiny kernel, over 1,000 (the host and driver speed a step's
  launches and the engine's Python run at);
- `python_loop_ns`: one iteration of a plain Python loop (the scheduler's and the output stage's speed);
and the card's state from nvidia-smi (SM clock and its maximum, temperature, power, the active clock
event reasons: thermal or power capping shows there). On a CPU (the dry run) the device readings run in
float32 on small sizes and nvidia-smi's are null.

    python3 benchmarks/gpu/probe.py --label start --out RESULTS_DIR   # adds RESULTS_DIR/probe.json["start"]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw", "utilization.gpu")
# Renamed from clocks_throttle_reasons in newer drivers; the first one the driver knows is read.
SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _smi(fields: str) -> list[str] | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None  # "[N/A]" and the like


def card_state() -> dict | None:
    """The card's clocks, temperature, power and clock event reasons (a hex mask, 0x0: none), or None
    without nvidia-smi."""
    values = _smi(",".join(SMI_FIELDS))
    if values is None:
        return None
    state = {"sm_clock_mhz": _number(values[0]), "max_sm_clock_mhz": _number(values[1]),
             "temperature_c": _number(values[2]), "power_w": _number(values[3]),
             "utilization_pct": _number(values[4]), "clock_event_reasons": None}
    for field in SMI_REASONS:
        reasons = _smi(field)
        if reasons is not None:
            state["clock_event_reasons"] = reasons[0]
            break
    return state


ROUNDS = 5  # each reading is the best of this many rounds: the machine's speed, not a moment's hiccup
LOOP_STEPS = 100_000  # a round of the Python loop reading


def _timed(fn, repeats: int, sync=lambda: None) -> float:
    """Seconds per call of `fn` in the fastest of `ROUNDS` rounds of `repeats` calls, after a warm-up
    call, `sync` (the device's) before and after each round."""
    fn()
    best = float("inf")
    for _ in range(ROUNDS):
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def _timed_on(fn, shapes, dtype, device, repeats: int, sync) -> float:
    """`_timed` of `fn` over fresh tensors of `shapes` (freed on return)."""
    import torch

    # Random values: a product of constants runs faster on some cards (less switching power).
    make = torch.randn if dtype.is_floating_point else torch.ones
    tensors = [make(shape, dtype=dtype, device=device) for shape in shapes]
    return _timed(lambda: fn(*tensors), repeats, sync)


def readings(device_name: str = "auto") -> dict:
    import torch

    device = torch.device("cuda" if device_name == "auto" and torch.cuda.is_available() else
                          "cpu" if device_name == "auto" else device_name)
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    n, dtype = (8192, torch.bfloat16) if gpu else (512, torch.float32)
    matmul_s = _timed_on(lambda a, b: a @ b, [(n, n), (n, n)], dtype, device, 10, sync)
    copy_bytes = (1 << 30) if gpu else (64 << 20)
    copy_s = _timed_on(lambda dst, src: dst.copy_(src), [(copy_bytes,), (copy_bytes,)], torch.uint8, device, 5, sync)
    tiny = torch.zeros(1, device=device)
    # Queueing alone: no sync inside a round, the kernels run behind (a tiny kernel runs in less time
    # than it takes to queue, so the launch queue, about a thousand deep, does not fill).
    launch_s = _timed(lambda: tiny.add_(1), 1000)
    sync()

    def loop():
        total = 0
        for i in range(LOOP_STEPS):
            total += i
    loop_s = _timed(loop, 1) / LOOP_STEPS
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "matmul_n": n,
            "matmul_tflops": 2 * n ** 3 / matmul_s / 1e12, "device_copy_tb_s": 2 * copy_bytes / copy_s / 1e12,
            "launch_us": launch_s * 1e6, "python_loop_ns": loop_s * 1e9,
            "card": card_state() if gpu else None, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="the reading's name in probe.json, e.g. start or end")
    ap.add_argument("--out", type=Path, required=True, help="the results folder; probe.json is kept there")
    ap.add_argument("--device", default="auto", help="auto (CUDA where available), cuda or cpu")
    args = ap.parse_args(argv)
    path = args.out / "probe.json"
    try:
        probes = json.loads(path.read_text())
    except (OSError, ValueError):
        probes = {}
    probes[args.label] = reading = readings(args.device)
    path.write_text(json.dumps(probes, indent=1) + "\n")
    card = reading["card"] or {}
    print(f"{args.label}: {reading['dtype']} matmul {reading['matmul_tflops']:.3g} TFLOP/s, device copy "
          f"{reading['device_copy_tb_s']:.3g} TB/s, a kernel queued in {reading['launch_us']:.1f} us, a Python "
          f"loop step {reading['python_loop_ns']:.0f} ns; SM clock {card.get('sm_clock_mhz')} of "
          f"{card.get('max_sm_clock_mhz')} MHz, {card.get('temperature_c')} C, {card.get('power_w')} W, "
          f"clock event reasons {card.get('clock_event_reasons')}")


if __name__ == "__main__":
    main()
