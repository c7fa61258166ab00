"""Paged attention in Triton for every query of a step: prefill chunks, resumes and decodes together.

Layout as in `triton_decode.py`: a layer's K and V caches are flat slot arrays `[num_slots, Hkv, D]`,
slot `b * block_size + i` holding token `i` of block `b`. A step's queries are flattened `[T, H, D]`,
sequence after sequence; sequence `s` owns rows `[query_start[s], query_start[s + 1])`, its context is
`seq_lens[s]` tokens long (the tokens cached before this step, then the new ones, whose K/V the layer has
already written), and its query row `i` sits at position `seq_lens[s] - q_len + i`, attending to every
position up to its own (causal, aligned bottom-right).

Why a kernel: the torch path runs one SDPA call per prefill chunk, gathering each chunk's whole context
out of the cache first, with shapes set by the chunks' lengths. On a GPU its host cost set the step
time: a 32- to 512-token pass of the Llama-3-8B shape took 20-23 ms on an H100 whose GPU work for it is
a third of that (2026-11-27, `benchmarks/gpu/step_profile.py`). This kernel reads every context through
its block table in one launch whose grid depends only on the padded token and sequence counts, so a
mixed step is captured in a CUDA graph like a decode step (`cuda_graphs.py`).

Work split: a program takes `queries_per_program` consecutive query tokens of one sequence and the G
query heads sharing one kv head (GQA), `Tiling.rows` rows of (token, head) in all (`tiling_for`: 64, the
smallest efficient `tl.dot` shape, or 128 for 16-bit caches), and walks the context `Tiling.tile`
positions at a time up to its last query's position, with an online softmax in fp32 (log2 domain), as
the decode kernel does; tiles every row of the program sees whole go without the causal mask, only those
along the diagonal take it. Which sequence and which rows a
program takes comes from two small arrays the host writes once per step (`program_map`): programs past
the step's work find a row offset past their sequence's chunk and do nothing, so a graph captured for
the padded sizes serves every smaller step.

Checked on CPU through Triton's interpreter (`tests/test_triton_prefill.py`) against a reference that
attends each sequence's context slot by slot.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without Triton; available() in triton_decode says so
    triton = None

class Tiling(NamedTuple):
    """How the kernel splits its work: `rows` (query token, query head) rows a program computes (the M of
    its `tl.dot` products), `tile` context positions it reads per round, and Triton's launch options."""
    rows: int = 64
    tile: int = 64
    num_warps: int = 4
    num_stages: int = 3  # Triton's default on CUDA


# Measured on one H100 (2026-11-27, bf16, the Llama-3-8B attention shape, `benchmarks/gpu/prefill_tiles.py`):
# 128 rows a program, 128 positions a round and 8 warps took a layer's 1,000-token prefill from 65.9 to
# 55.0 us, a 512-token chunk of a 4,096-token context from 105.2 to 100.7 us and a mixed step (a 128-token
# prompt beside 8 decodes) from 66.9 to 65.8 us against 64 rows, 64 positions and 4 warps. 32-bit caches
# keep the smaller tiling: its tiles of twice the bytes were not measured at the larger size.
TILING = Tiling()  # 64 rows, the smallest efficient tl.dot shape
TILING_16BIT = Tiling(rows=128, tile=128, num_warps=8, num_stages=3)
NO_ROWS = 1 << 30  # a program-map row offset past every chunk: the program does nothing


def tiling_for(dtype: torch.dtype) -> Tiling:
    """The tiling the engine launches for caches of `dtype`: the map of programs (`program_map`) and the
    kernel must agree on it."""
    return TILING_16BIT if dtype in (torch.bfloat16, torch.float16) else TILING


def queries_per_program(num_heads: int, num_kv_heads: int, rows: int) -> int:
    """Query tokens a program takes: `rows` over the query heads of a kv head (padded to a power of two)."""
    group = num_heads // num_kv_heads
    return max(1, rows // (1 << (group - 1).bit_length()))


def max_programs(num_tokens: int, num_seqs: int, per_program: int) -> int:
    """Programs (per kv head) a step of up to `num_tokens` tokens over up to `num_seqs` sequences needs
    at most: each sequence's chunk in ceil(len / per_program) pieces."""
    return num_tokens // per_program + num_seqs


def program_map(query_lens: list[int], per_program: int, num_programs: int) -> tuple[list[int], list[int]]:
    """(sequence, first query row) of each program, padded to `num_programs` with programs that do nothing."""
    seqs, rows = [], []
    for s, n in enumerate(query_lens):
        for row in range(0, n, per_program):
            seqs.append(s)
            rows.append(row)
    pad = num_programs - len(seqs)
    assert pad >= 0, f"{len(seqs)} programs needed, {num_programs} available"
    return seqs + [0] * pad, rows + [NO_ROWS] * pad


if triton is not None:

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, table_ptr, start, end, q_pos, m, l, acc, kv_head,
                     stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, qk_scale, offs_d, d_mask,
                     BLOCK: tl.constexpr, TILE: tl.constexpr, FP32_PRODUCTS: tl.constexpr, MASKED: tl.constexpr):
        """One round of the online softmax over context positions [start, start + TILE): returns the rows'
        running maximum, sum and output. MASKED: positions past `end` or past a row's own are left out."""
        pos = start + tl.arange(0, TILE)  # [TILE]
        t_mask = pos < end
        block = tl.load(table_ptr + pos // BLOCK, mask=t_mask, other=0)
        slots = block.to(tl.int64) * BLOCK + pos % BLOCK
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)  # [TILE, D_PAD]
        if FP32_PRODUCTS:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [ROWS, TILE]
        if MASKED:
            visible = t_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        # Finite: the first round covers position 0 (or the first query's own), visible to every row.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        if FP32_PRODUCTS:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l, acc * alpha[:, None] + pv

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, map_seq_ptr, map_row_ptr, out_ptr,
        stride_qt, stride_qh, stride_qd,  # q [T, H, D]
        stride_ks, stride_kh, stride_kd,  # k_cache [num_slots, Hkv, D]
        stride_vs, stride_vh, stride_vd,  # v_cache [num_slots, Hkv, D]
        stride_tb,  # block_tables [S, max_blocks], entries contiguous
        stride_ot, stride_oh,  # out [T, H, D], D contiguous
        qk_scale,  # softmax scale * log2(e)
        G: tl.constexpr, G_PAD: tl.constexpr,  # query heads per kv head; padded to a power of two
        QUERIES: tl.constexpr,  # query tokens per program; QUERIES * G_PAD rows
        D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,  # block_size
        TILE: tl.constexpr,  # context positions per round
        FP32_PRODUCTS: tl.constexpr,  # both products in exact fp32 (fp32 caches, and bf16 when interpreted)
    ):
        program = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(map_seq_ptr + program).to(tl.int64)
        first = tl.load(map_row_ptr + program)  # first query row of the chunk this program takes
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len  # positions in the cache before this chunk

        offs_r = tl.arange(0, QUERIES * G_PAD)
        token = first + offs_r // G_PAD  # [ROWS] query row within the chunk
        g = offs_r % G_PAD
        r_mask = (token < q_len) & (g < G)
        heads = kv_head * G + g
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < D
        rows = (q_start + token).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(k_ptr.dtype.element_ty)
        # Each row's last visible position; rows past the chunk take its last query's (finite softmax).
        q_pos = cached + tl.minimum(token, q_len - 1)  # [ROWS]
        # Keys up to this program's last query; nothing for a program past its chunk (padding).
        end = tl.where(first < q_len, tl.minimum(seq_len, cached + first + QUERIES), 0)

        # Positions every row of the program sees (up to its first query's) need no causal mask: whole
        # tiles of them first, then the tiles along the diagonal, masked.
        unmasked = tl.minimum(cached + first + 1, end) // TILE * TILE
        m = tl.full([QUERIES * G_PAD], float("-inf"), dtype=tl.float32)
        l = tl.zeros([QUERIES * G_PAD], dtype=tl.float32)
        acc = tl.zeros([QUERIES * G_PAD, D_PAD], dtype=tl.float32)
        for start in range(0, unmasked, TILE):
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, tables_ptr + seq * stride_tb, start, end, q_pos, m, l, acc,
                                     kv_head, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
                                     qk_scale, offs_d, d_mask, BLOCK, TILE, FP32_PRODUCTS, False)
        for start in range(unmasked, end, TILE):
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, tables_ptr + seq * stride_tb, start, end, q_pos, m, l, acc,
                                     kv_head, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
                                     qk_scale, offs_d, d_mask, BLOCK, TILE, FP32_PRODUCTS, True)

        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        out_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                            map_seq: torch.Tensor, map_row: torch.Tensor, scale: float,
                            block_size: int, tiling: Tiling | None = None) -> torch.Tensor:
    """q [T, H, D] (rows may be strided, heads contiguous); caches [num_slots, Hkv, D] already holding
    this step's K/V; block_tables [S, max_blocks]; query_start [S + 1] (sequences' first rows, ending with
    the total; sequences past the live ones have no rows); seq_lens [S] (each context including its new
    tokens); map_seq, map_row [P] from `program_map` with
    `queries_per_program(H, Hkv, tiling.rows)`. Rows not covered by a sequence are left unwritten.
    Returns [T, H, D] in q's dtype. No host syncs, no shapes from tensor values: graph-safe."""
    if triton is None:
        raise RuntimeError("paged_prefill_attention needs Triton, which is not installed")
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    assert H % Hkv == 0 and block_tables.stride(1) == 1
    G = H // Hkv
    G_PAD = 1 << (G - 1).bit_length()
    tiling = tiling or tiling_for(k_cache.dtype)
    queries = queries_per_program(H, Hkv, tiling.rows)
    D_PAD = max(16, triton.next_power_of_2(D))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    fp32_products = k_cache.dtype == torch.float32 or (interpreted and k_cache.dtype == torch.bfloat16)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0 or map_seq.shape[0] == 0:
        return out
    _paged_prefill_kernel[(map_seq.shape[0], Hkv)](
        q, k_cache, v_cache, block_tables, query_start, seq_lens, map_seq, map_row, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        G=G, G_PAD=G_PAD, QUERIES=queries, D=D, D_PAD=D_PAD, BLOCK=block_size, TILE=tiling.tile,
        FP32_PRODUCTS=fp32_products, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return out
