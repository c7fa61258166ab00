"""The paged prefill kernel (`engine/triton_prefill.py`) under each of a set of tilings, beside torch's SDPA,
on the Llama-3-8B attention shape (32 query heads, 8 kv heads, head size 128, 16-token blocks): which
tiling the engine should launch, measured rather than guessed.

Cases: `prefill_1000` (one 1,000-token prompt, nothing cached: the check's prefill), `chunk_512_after_3584`
(a 512-token chunk of a 4,096-token context: a long prompt or a resume recomputed in chunks) and
`mixed_128_8x1000` (a 128-token prompt beside 8 decodes of 1,000-token contexts: a mixed step). Each
tiling's time is the median over rounds of 20 back-to-back launches between CUDA events (the launch cost
hidden as in a graph), in microseconds for one layer; its output is compared with SDPA's on the same
context (math in fp32 on the gathered keys, bottom-right causal). SDPA is timed as the engine's torch path
calls it (`enable_gqa`, one call per sequence), its context gathered before the timing.

    python3 benchmarks/gpu/prefill_tiles.py --out RESULTS_DIR
    TRITON_INTERPRET=1 python3 benchmarks/gpu/prefill_tiles.py --dry --out DIR   # CPU: tiny, correctness only

Writes `prefill_tiles.json` and `prefill_tiles.md` into RESULTS_DIR.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from infercept.engine.triton_prefill import (Tiling, max_programs, paged_prefill_attention, program_map,
                                             queries_per_program, tiling_for)

BLOCK = 16


def tilings(engine: Tiling, dry: bool) -> list[Tiling]:
    """The engine's tiling first, then the others of the grid."""
    grid = [Tiling(rows=128, tile=32)] if dry else [Tiling(*g) for g in itertools.product((64, 128), (32, 64, 128),
                                                                                            (4, 8), (2, 3))]
    return [engine] + [t for t in grid if t != engine]


def make_case(seqs: list[tuple[int, int]], H: int, Hkv: int, D: int, dtype, device, gen) -> dict:
    """seqs: (cached tokens, new tokens) per sequence. Blocks are laid out in a shuffled order, so the
    kernel's reads go through the block table as in a long-running engine."""
    lens = [c + n for c, n in seqs]
    blocks = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, at = [], 0
    width = max(blocks)
    for b in blocks:
        tables.append(order[at:at + b] + [0] * (width - b))
        at += b
    slots = sum(blocks) * BLOCK
    k_cache = torch.randn(slots, Hkv, D, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(slots, Hkv, D, generator=gen).to(dtype).to(device)
    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), H, D, generator=gen).to(dtype).to(device)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(seqs=seqs, q=q, k_cache=k_cache, v_cache=v_cache, tables=torch.tensor(tables, **i32),
                query_start=torch.tensor(starts, **i32), seq_lens=torch.tensor(lens, **i32), scale=D ** -0.5)


def run_kernel(case: dict, tiling: Tiling):
    H, Hkv = case["q"].shape[1], case["k_cache"].shape[1]
    per_program = queries_per_program(H, Hkv, tiling.rows)
    q_lens = [n for _, n in case["seqs"]]
    need = max_programs(sum(q_lens), len(q_lens), per_program)
    map_seq, map_row = (torch.tensor(x, dtype=torch.int32, device=case["q"].device)
                        for x in program_map(q_lens, per_program, need))

    def launch():
        return paged_prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["tables"],
                                       case["query_start"], case["seq_lens"], map_seq, map_row, case["scale"],
                                       BLOCK, tiling)
    return launch


def sdpa(case: dict, math_fp32: bool = False):
    """Per sequence: its context gathered from the cache, SDPA with the queries aligned bottom-right."""
    q, k_cache, v_cache, tables = case["q"], case["k_cache"], case["v_cache"], case["tables"]
    gathered = []
    for s, (cached, n) in enumerate(case["seqs"]):
        pos = torch.arange(cached + n, device=q.device)
        slots = tables[s].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        row = case["query_start"][s].item()
        mask = pos[None, :] <= (cached + torch.arange(n, device=q.device))[:, None]
        gathered.append((row, n, k_cache[slots], v_cache[slots], mask, cached == 0))

    def launch():
        out = torch.empty_like(q)
        for row, n, k, v, mask, plain in gathered:
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[row:row + n], k, v))
            if math_fp32:
                qs, ks, vs = qs.float(), ks.float(), vs.float()
            if plain:  # causal from the top left is bottom-right too: the fused backends take it
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=case["scale"])
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True, scale=case["scale"])
            out[row:row + n] = o.squeeze(0).transpose(0, 1).to(q.dtype)
        return out
    return launch


def time_us(launch, rounds: int, per_round: int = 20) -> float:
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            launch()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / per_round)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no timing")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    if args.dry:
        device, dtype, (H, Hkv, D) = torch.device("cpu"), torch.float32, (4, 2, 16)
        cases = {"prefill_40": [(0, 40)], "chunk_16_after_48": [(48, 16)], "mixed_8_2x30": [(0, 8), (29, 1), (29, 1)]}
    else:
        device, dtype, (H, Hkv, D) = torch.device("cuda"), torch.bfloat16, (32, 8, 128)
        cases = {"prefill_1000": [(0, 1000)], "chunk_512_after_3584": [(3584, 512)],
                 "mixed_128_8x1000": [(0, 128)] + [(999, 1)] * 8}
    rows = []
    for name, seqs in cases.items():
        case = make_case(seqs, H, Hkv, D, dtype, device, gen)
        expected = sdpa(case, math_fp32=True)().float()
        sdpa_us = None if args.dry else time_us(sdpa(case), args.rounds)
        print(f"{name}: SDPA {sdpa_us if sdpa_us is None else round(sdpa_us, 1)} us", flush=True)
        engine = tiling_for(dtype)
        for tiling in tilings(engine, args.dry):
            row = dict(case=name, tiling=tiling._asdict(), engine=tiling == engine, sdpa_us=sdpa_us)
            try:
                launch = run_kernel(case, tiling)
                row["max_abs_diff"] = (launch().float() - expected).abs().max().item()
                row["us"] = None if args.dry else time_us(launch, args.rounds)
            except Exception as e:  # a tiling that does not compile (shared memory, registers) is a result too
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc(limit=1)
            print(f"  {tuple(tiling)}: {row.get('us')} us, max |diff| {row.get('max_abs_diff')}"
                  f"{' ' + row['error'] if 'error' in row else ''}", flush=True)
            rows.append(row)
    (args.out / "prefill_tiles.json").write_text(json.dumps(dict(shape=dict(H=H, Hkv=Hkv, D=D, block=BLOCK),
                                                                 rows=rows), indent=1))
    (args.out / "prefill_tiles.md").write_text(markdown(rows))


def best(rows: list[dict], case: str) -> dict | None:
    timed = [r for r in rows if r["case"] == case and r.get("us") is not None]
    return min(timed, key=lambda r: r["us"]) if timed else None


def markdown(rows: list[dict]) -> str:
    lines = ["# The paged prefill kernel by tiling (`benchmarks/gpu/prefill_tiles.py`)", "",
             "us for one layer of the Llama-3-8B shape; `rows, tile, num_warps, num_stages`; the engine's "
             "tiling marked *.", "",
             "| case | tiling | us | vs SDPA | max abs diff vs fp32 |", "|---|---|---:|---:|---:|"]
    for r in rows:
        t = r["tiling"]
        label = f"{t['rows']}, {t['tile']}, {t['num_warps']}, {t['num_stages']}" + (" *" if r["engine"] else "")
        us = r.get("us")
        ratio = f"{us / r['sdpa_us']:.2f}x" if us and r.get("sdpa_us") else "–"
        lines.append(f"| {r['case']} | {label} | {'–' if us is None else f'{us:.1f}'} | {ratio} | "
                     f"{r.get('max_abs_diff', r.get('error', '–'))} |")
    lines += ["", "SDPA (called as the engine's torch path calls it, per sequence, its context gathered before "
              "the timing): "
              + ", ".join(f"{c} {r['sdpa_us']:.1f} us" for c in dict.fromkeys(x["case"] for x in rows)
                          for r in [next(x for x in rows if x["case"] == c)] if r.get("sdpa_us"))]
    for c in dict.fromkeys(x["case"] for x in rows):
        b = best(rows, c)
        if b:
            lines.append(f"Fastest for {c}: {tuple(b['tiling'].values())} at {b['us']:.1f} us.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
