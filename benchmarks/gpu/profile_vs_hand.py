"""The engine's profile measured on this card (`infercept profile`'s code: forward-pass time by step size,
saturation point, copy bandwidth) beside the hand-written `h100_llama3_8b()` that the H100 simulations
rest on, so a run on a GPU says how far the roofline is from the engine as it runs.

    python3 benchmarks/gpu/profile_vs_hand.py --model /tmp/llama3-8b --out RESULTS_DIR

Writes `profile.json` (the profile, loadable with `Profile.load` and `--profile` of policy_sim.py and
parts_sim.py) and `profile_vs_hand.json` / `.md` (the comparison) into RESULTS_DIR.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TOKENS = (1, 32, 128, 256, 512, 1024)


def compare(measured, hand, hand_attention, tokens=TOKENS) -> dict:
    """The comparison as a JSON-able dict: T_fwd in ms at `tokens`, saturation points, copy bandwidths,
    attention over the context (`hand_attention`: the hand-written profile that models it)."""
    return {
        "t_fwd_ms": [{"tokens": n, "measured": 1e3 * measured.t_fwd(n), "hand_written": 1e3 * hand.t_fwd(n)}
                     for n in tokens],
        "saturation_point": {"measured": measured.S, "hand_written": hand.S},
        "d2h_gb_s": {"measured": measured.d2h_bytes_per_s / 1e9, "hand_written": hand.d2h_bytes_per_s / 1e9},
        "h2d_gb_s": {"measured": measured.h2d_bytes_per_s / 1e9, "hand_written": hand.h2d_bytes_per_s / 1e9},
        "copy_overlap": {"measured": measured.copy_overlap, "hand_written": hand.copy_overlap},
        # Attention over the context: ns a decode pays per context token, ps a prefill chunk per (query,
        # context token) pair; the hand-written values are `h100_llama3_8b(attention=True)`'s.
        "attention_read_ns_per_token": {"measured": 1e9 * measured.attention_read_s_per_token,
                                        "hand_written": 1e9 * hand_attention.attention_read_s_per_token},
        "attention_pair_ps": {"measured": 1e12 * measured.attention_pair_s,
                              "hand_written": 1e12 * hand_attention.attention_pair_s},
        "bytes_per_token": {"measured": measured.bytes_per_token, "hand_written": hand.bytes_per_token},
        "device": measured.device, "dtype": measured.dtype,
    }


def markdown(c: dict) -> str:
    lines = [f"Measured on {c['device']} ({c['dtype']}) vs the hand-written `h100_llama3_8b()`:", "",
             "| tokens | measured T_fwd ms | hand-written ms | ratio |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['measured']:.2f} | {r['hand_written']:.2f} | "
              f"{r['measured'] / r['hand_written']:.2f}x |" for r in c["t_fwd_ms"]]
    s, d2h, h2d = c["saturation_point"], c["d2h_gb_s"], c["h2d_gb_s"]
    lines += ["", f"Saturation point {s['measured']} tokens measured vs {s['hand_written']} hand-written; copies "
              f"device->host {d2h['measured']:.1f} GB/s, host->device {h2d['measured']:.1f} GB/s vs "
              f"{d2h['hand_written']:.1f} / {h2d['hand_written']:.1f}."]
    read, pair = c["attention_read_ns_per_token"], c["attention_pair_ps"]
    lines += ["", f"Attention over the context: a decode {read['measured']:.1f} ns per context token, a prefill chunk "
              f"{pair['measured']:.3f} ps per (query, context token) pair, vs {read['hand_written']:.1f} / "
              f"{pair['hand_written']:.3f} hand-written (`h100_llama3_8b(attention=True)`)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--host-kv-gb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from infercept.engine import profile_model
    from infercept.engine.policy.profile import h100_llama3_8b

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hand = h100_llama3_8b()
    # profile=: the engine skips its own quick start-up measurement; the full one follows.
    measured, _ = profile_model(args.model, args.repeats, str(out / "profile.json"), dtype=args.dtype,
                                device=args.device, kv_cache_gb=args.kv_cache_gb, host_kv_gb=args.host_kv_gb,
                                profile=hand, progress=False)
    c = compare(measured, hand, h100_llama3_8b(attention=True))
    c["seconds"] = time.perf_counter() - start
    (out / "profile_vs_hand.json").write_text(json.dumps(c, indent=1) + "\n")
    text = markdown(c)
    (out / "profile_vs_hand.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
