"""The Triton paged attention of mixed steps (engine/triton_prefill.py) against a torch reference, on the CPU.

As test_triton_decode.py: the kernel runs under Triton's interpreter in a child process (this file run as
a script); the pytest process builds the same seeded inputs, computes the reference and compares."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from triton_interpreter import interpreted_outputs

F32, BF16, F16, I32, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64
# (tokens cached before the step, tokens of the step) per sequence: a fresh prefill, a chunk after a
# cached context that ends inside a block, a decode, a one-token fresh sequence, a chunk spanning several
# programs and several context tiles
SEQS = [(0, 5), (17, 20), (40, 1), (0, 1), (3, 70)]

# name: (sequences, H, Hkv, head_dim, block_size, dtype, index dtype, q a strided view, padding programs, tol)
CASES = {
    "G1-fp32": (SEQS, 2, 2, 64, 16, F32, I64, False, 0, 1e-5),
    "G4-fp32": (SEQS, 8, 2, 64, 16, F32, I64, False, 3, 1e-5),
    "G3-fp32": (SEQS, 3, 1, 64, 16, F32, I32, False, 0, 1e-5),
    "G4-bf16": (SEQS, 8, 2, 64, 16, BF16, I32, False, 2, 2e-2),
    "G3-bf16-strided": (SEQS, 3, 1, 64, 16, BF16, I32, True, 0, 2e-2),
    "G4-fp16-strided": (SEQS, 8, 2, 64, 16, F16, I64, True, 1, 2e-3),
    # a head_dim that is not a power of two, and a block size that is not one either
    "D40-block12-fp32": ([(0, 13), (25, 3), (11, 1)], 4, 2, 40, 12, F32, I64, False, 2, 1e-5),
    # 16-bit caches take a tile of 128 positions: contexts long enough for whole tiles before the diagonal
    "G4-bf16-long": ([(200, 40), (0, 150)], 8, 2, 64, 16, BF16, I32, False, 1, 2e-2),
    # sixteen query heads per kv head: four query tokens a program
    "G16-fp32": ([(0, 9), (30, 6)], 16, 1, 64, 16, F32, I64, False, 0, 1e-5),
}


def make_inputs(name: str):
    """The kernel's arguments for a case, from a fixed seed, plus the live row count.

    Blocks are shuffled; every table is padded with a junk block whose K/V would swamp a result if read;
    one padding sequence (no rows, no context) follows the live ones; the rows past the live tokens are
    padding no sequence owns; `padding programs` extra map entries do nothing."""
    from infercept.engine.triton_prefill import max_programs, program_map, queries_per_program, tiling_for

    seqs, H, Hkv, D, block_size, dtype, index_dtype, strided, pad_programs, _ = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    lens = [c + n for c, n in seqs]
    per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    junk = order.pop()
    tables, start = [], 0
    for n in per_seq:
        tables.append(order[start:start + n] + [junk] * (max_blocks - n))
        start += n
    tables.append([junk] * max_blocks)  # the padding sequence
    k_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen)
    k_cache.view(num_blocks, block_size, Hkv, D)[junk] = 50.0
    v_cache.view(num_blocks, block_size, Hkv, D)[junk] = 1e3
    q_lens = [n for _, n in seqs]
    live = sum(q_lens)
    T = live + 3  # padding rows
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    query_start.append(live)  # the padding sequence has no rows
    per_program = queries_per_program(H, Hkv, tiling_for(dtype).rows)
    needed = max_programs(live, len(seqs), per_program)
    map_seq, map_row = program_map(q_lens, per_program, needed + pad_programs)
    if strided:
        q = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)[:, :H * D].view(T, H, D)
        assert not q.is_contiguous()
    else:
        q = torch.randn(T, H, D, generator=gen).to(dtype)
    index = dict(dtype=index_dtype)
    return (q, k_cache.to(dtype), v_cache.to(dtype), torch.tensor(tables, **index),
            torch.tensor(query_start, **index), torch.tensor(lens + [0], **index),
            torch.tensor(map_seq, dtype=I32), torch.tensor(map_row, dtype=I32), D ** -0.5, block_size), live


def reference(name: str) -> torch.Tensor:
    """Each query row attends the positions up to its own, gathered slot by slot; fp32. [live rows, H, D]."""
    (q, k_cache, v_cache, tables, _, _, _, _, scale, block_size), live = make_inputs(name)
    seqs = CASES[name][0]
    H = q.shape[1]
    G = H // k_cache.shape[1]
    out = torch.empty(live, H, q.shape[2])
    row = 0
    for s, (cached, n) in enumerate(seqs):
        for i in range(n):
            pos = torch.arange(cached + i + 1)
            slots = tables[s].long()[pos // block_size] * block_size + pos % block_size
            k = k_cache[slots].float().repeat_interleave(G, dim=1)
            v = v_cache[slots].float().repeat_interleave(G, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[row].float(), k) * scale, dim=-1)
            out[row] = torch.einsum("hn,nhd->hd", p, v)
            row += 1
    return out


def run_kernel_in_interpreter(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from triton.runtime.interpreter import InterpretedFunction

    from infercept.engine import triton_prefill

    results = {"interpreted": isinstance(triton_prefill._paged_prefill_kernel, InterpretedFunction)}
    for name in CASES:
        inputs, live = make_inputs(name)
        results[name] = triton_prefill.paged_prefill_attention(*inputs)[:live]
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory):
    results = interpreted_outputs(__file__, tmp_path_factory.mktemp("triton_prefill"))
    assert results["interpreted"], "the kernel did not run in Triton's interpreter"
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(kernel_outputs, name):
    out, tol = kernel_outputs[name], CASES[name][-1]
    assert out.dtype == CASES[name][5]
    torch.testing.assert_close(out.float(), reference(name), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernel_on_a_gpu_matches_reference(name):
    """The same cases compiled for the GPU (bf16 and fp16 on tensor cores there)."""
    from infercept.engine.triton_prefill import paged_prefill_attention

    inputs, live = make_inputs(name)
    on_gpu = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
    out = paged_prefill_attention(*on_gpu)[:live].cpu()
    tol = CASES[name][-1]
    torch.testing.assert_close(out.float(), reference(name), atol=tol, rtol=tol)


def test_program_map():
    from infercept.engine.triton_prefill import (NO_ROWS, TILING, TILING_16BIT, max_programs, program_map,
                                                 queries_per_program)

    rows = TILING.rows  # 64
    assert queries_per_program(32, 8, rows) == 16 and queries_per_program(9, 3, rows) == 16
    assert queries_per_program(4, 4, rows) == 64 and queries_per_program(16, 1, rows) == 4
    assert queries_per_program(32, 8, TILING_16BIT.rows) == 32
    # 40 rows of one sequence in pieces of 16, then a decode; padded to the bound for 41 tokens, 2 seqs
    assert max_programs(41, 2, 16) == 4
    seqs, rows = program_map([40, 1], 16, 5)
    assert seqs == [0, 0, 0, 1, 0] and rows == [0, 16, 32, 0, NO_ROWS]
    with pytest.raises(AssertionError):
        program_map([40, 1], 16, 3)


if __name__ == "__main__":
    run_kernel_in_interpreter(sys.argv[1])
