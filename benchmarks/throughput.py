"""Engine vs Hugging Face transformers `generate`, side by side in one run.

Same model and thread count for both. The engine runs in `--dtype`; transformers runs in each of
`--transformers-dtypes` (by default the engine's dtype and float32: CPUs without native bf16 emulate it
at a fraction of their fp32 speed, so either can be transformers' faster one), and each row's ratio is
against the faster. Decode throughput at several batch sizes (every sequence starts from a short prompt
and decodes a fixed number of tokens with EOS ignored), and prefill throughput of one long prompt.
Prints a markdown table with tokens/s and the ratio, and writes it with the machine and date to
`<out>/throughput.md` and `.json` (`benchmarks/claims.py` reads the JSON).

    python benchmarks/throughput.py                      # embedded model, bf16 (transformers bf16 and fp32), batches 1 8 32
    python benchmarks/throughput.py --batches 1 8 --decode-tokens 64 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, today  # noqa: E402


def engine_decode(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from infercept.engine import SamplingParams

    prompts = [[100 + (i * 7 + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    # Time decode only: prefill everything first, then count steps until all finish.
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    while any(engine.scheduler.requests[i].num_computed_tokens < prompt_len for i in ids):
        engine.step()
    produced = sum(engine.scheduler.requests[i].num_output_tokens for i in ids)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    return (batch * new_tokens - produced) / elapsed


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a timer read next covers it (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    prompts = torch.tensor([[100 + (i * 7 + j) % 1000 for j in range(prompt_len)] for i in range(batch)],
                           device=model.device)
    mask = torch.ones_like(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.inference_mode():
        model.generate(prompts[:1], max_new_tokens=4, min_new_tokens=4, **{**kwargs, "attention_mask": mask[:1]})
        # Subtract the prefill + first token, measured separately, to time decode only.
        _sync(model.device)
        start = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kwargs)
        _sync(model.device)
        t_first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        _sync(model.device)
        elapsed = time.perf_counter() - start - t_first
    return batch * (new_tokens - 1) / elapsed


def engine_prefill(llm, prompt_len: int, repeats: int = 3) -> float:
    """Median of `repeats` prefills after one at the same length (on a GPU the first pass of a new shape
    picks and loads its kernels). Run with prefix caching off: the repeats share their prompt."""
    from infercept.engine import SamplingParams

    prompt = [100 + j % 1000 for j in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], params)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return prompt_len / sorted(times)[len(times) // 2]


def hf_prefill(model, prompt_len: int, repeats: int = 3) -> float:
    """As `engine_prefill`: the median of `repeats` forward passes after one of the same length."""
    prompt = torch.tensor([[100 + j % 1000 for j in range(prompt_len)]], device=model.device)
    times = []
    with torch.inference_mode():
        model(prompt)
        for _ in range(repeats):
            _sync(model.device)
            start = time.perf_counter()
            model(prompt)
            _sync(model.device)
            times.append(time.perf_counter() - start)
    return prompt_len / sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype")
    ap.add_argument("--transformers-dtypes", nargs="+", default=None,
                    help="transformers' dtypes, each run; the faster is the baseline (default: --dtype and float32)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "throughput"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from infercept.engine import LLM
    from infercept.engine.config import resolve_dtype
    from infercept.engine.download import ensure_default_model

    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_default_model()
    dtype = resolve_dtype(args.dtype, None)
    # No prefix caching: the warm-up runs share prompts with the measured runs, which must compute everything.
    llm = LLM(model_dir, dtype=dtype, kv_cache_gb=1.0, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)
    hf_dtypes = list(dict.fromkeys(args.transformers_dtypes or [args.dtype, "float32"]))
    hf = {name: AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(name, None)).eval()
          for name in hf_dtypes}

    rows = []  # (workload, engine tok/s, {transformers dtype: tok/s})
    for batch in args.batches:
        ours = engine_decode(llm, batch, args.prompt_len, args.decode_tokens)
        theirs = {name: hf_decode(model, batch, args.prompt_len, args.decode_tokens) for name, model in hf.items()}
        rows.append((f"decode, batch {batch}", ours, theirs))
    ours = engine_prefill(llm, args.prefill_len)
    rows.append((f"prefill, {args.prefill_len}-token prompt", ours,
                 {name: hf_prefill(model, args.prefill_len) for name, model in hf.items()}))

    lines = ["# Engine vs transformers, side by side\n", f"{cpu_name()}, {today()}; model {Path(model_dir).name}, "
             f"engine {args.dtype}, transformers {' and '.join(hf_dtypes)}, {args.threads} threads, torch "
             f"{torch.__version__}; each ratio against transformers' faster dtype. Command: `python "
             f"benchmarks/throughput.py {' '.join(sys.argv[1:])}`\n",
             "| workload | infercept tok/s | " + " | ".join(f"transformers {n} tok/s" for n in hf_dtypes)
             + " | ratio (vs the faster) |", "|---|---:|" + "---:|" * len(hf_dtypes) + "---:|"]
    lines += [f"| {name} | {ours:.1f} | " + " | ".join(f"{theirs[n]:.1f}" for n in hf_dtypes)
              + f" | {ours / max(theirs.values()):.2f}x |" for name, ours, theirs in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.md").write_text(text)
    (out / "throughput.json").write_text(json.dumps(
        {"cpu": cpu_name(), "date": today(), "dtype": args.dtype, "threads": args.threads,
         "rows": [{"workload": n, "infercept_tok_s": a, "transformers_tok_s": max(b.values()),
                   "transformers_dtype": max(b, key=b.get), "transformers_tok_s_by_dtype": b} for n, a, b in rows]},
        indent=1))


if __name__ == "__main__":
    main()
