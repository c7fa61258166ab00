"""The engine against Hugging Face transformers `generate` on one device, side by side in one process:
decode throughput at several batch sizes (32-token prompts, 64 new tokens, EOS ignored, decode steps
only) and one 1,000-token prefill. The timing code is benchmarks/throughput.py's; this runs it on the
GPU with a model folder given, and records the weight bytes that bound batch-1 decode (`card.py`).

    python3 benchmarks/gpu/decode_vs_hf.py --model /tmp/llama3-8b --out RESULTS_DIR --batches 1 8 32

Writes `decode_vs_hf.json` / `.md` into RESULTS_DIR.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import engine_decode, engine_prefill, hf_decode, hf_prefill  # noqa: E402


def markdown(r: dict) -> str:
    lines = [f"{r['device']}, {r['dtype']}, torch {r['torch']}, engine kernels {r['kernels']}; "
             f"{r['parameters'] / 1e9:.2f} B parameters, {r['weight_bytes'] / 1e9:.2f} GB of weights", "",
             "| workload | infercept tok/s | transformers tok/s | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {row['workload']} | {row['infercept_tok_s']:.1f} | {row['transformers_tok_s']:.1f} | "
              f"{row['infercept_tok_s'] / row['transformers_tok_s']:.2f}x |" for row in r["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1000)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--enforce-eager", action="store_true", help="the engine without CUDA graphs")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from infercept.engine import LLM
    from infercept.engine.profiler import device_name, dtype_name

    start = time.perf_counter()
    # No prefix caching: the warm-up runs share prompts with the measured runs, which must compute everything.
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_gb=args.kv_cache_gb,
              max_num_batched_tokens=max(1024, args.prefill_len), enable_prefix_caching=False, progress=False,
              enforce_eager=args.enforce_eager)
    engine = llm.engine
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.config.dtype).to(engine.config.device).eval()
    params = list(engine.model.parameters())
    result = {"device": device_name(engine.config.device), "dtype": dtype_name(engine.config.dtype),
              "torch": torch.__version__, "kernels": engine.runner.kernels,
              "parameters": sum(p.numel() for p in params),
              "weight_bytes": sum(p.numel() * p.element_size() for p in params), "rows": []}
    for batch in args.batches:
        ours = engine_decode(llm, batch, args.prompt_len, args.decode_tokens)
        theirs = hf_decode(hf, batch, args.prompt_len, args.decode_tokens)
        result["rows"].append({"workload": f"decode, batch {batch}", "batch": batch,
                               "infercept_tok_s": ours, "transformers_tok_s": theirs})
        print(result["rows"][-1], flush=True)
    result["rows"].append({"workload": f"prefill, {args.prefill_len}-token prompt", "prefill_tokens": args.prefill_len,
                           "infercept_tok_s": engine_prefill(llm, args.prefill_len),
                           "transformers_tok_s": hf_prefill(hf, args.prefill_len)})
    result["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_vs_hf.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (out / "decode_vs_hf.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
