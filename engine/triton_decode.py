"""Paged decode attention in Triton: single-token queries read their context through the block table.

Layout (see `attention.py` and `kv_cache.py`): a layer's K and V caches are flat slot arrays
`[num_slots, Hkv, D]`, where slot `b * block_size + i` holds token `i` of block `b`; a sequence's
block table lists its blocks in order, so its position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`.

Why a kernel: decode steps run from CUDA graphs (`cuda_graphs.py`), which replay fixed shapes and
cannot sync with the host. The torch path gathers every sequence's whole padded context
(`[B, max_blocks * block_size, Hkv, D]`) and masks it, a copy whose size is set by the longest context
the graph was captured for. This kernel instead walks each sequence's own blocks through the table,
with the number of blocks read from `context_lens` on the device: the grid depends only on the batch
size and head counts, nothing is copied, and nothing is read past a context's length.

One program per (sequence, kv head). It handles the G = H // Hkv query heads that share that kv head
together (GQA), so each K/V tile is loaded once per group. It walks the context a tile of TILE
positions (several blocks) at a time: the tile's block ids are loaded as one vector and its K and V
rows gathered through them, so a context of n tokens is n / TILE rounds of dependent loads, not one
round per block (one block a round measured 20 us a layer for ~100-token contexts of the Llama-3-8B
shape on an H100, 9% of a batch-1 step, 2026-11-27). Scores `[G_PAD, TILE]` and the weighted V come
from `tl.dot` (the query heads padded to 16 rows, its smallest shape): on tensor cores in the cache's
16-bit dtype with fp32 accumulation, and in exact fp32 (`ieee`) for fp32 caches; the probabilities
are cast to V's dtype for the second product, as flash attention does. An online softmax in fp32
(running max and sum in the log2 domain) merges the tiles; the output is cast to q's dtype at the end.

Not written yet: a split-K (flash-decoding) variant, which splits a long context over several programs
and merges their partial softmaxes. It would help long contexts at small batch, where B * Hkv programs
leave most of the GPU idle.

Checked on CPU through Triton's interpreter (`TRITON_INTERPRET=1`) against a torch reference
(`tests/test_triton_decode.py`).
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without Triton; available() says so
    triton = None


def available() -> bool:
    """Triton can run the kernel here: importable, and a CUDA device present or TRITON_INTERPRET=1 set."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


# Context positions a program reads per round (several blocks): fewer rounds of dependent loads, K and V
# tiles of [64, head_dim] that the tensor cores multiply at once.
TILE_TOKENS = 64

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_qd,  # q [B, H, D]
        stride_ks, stride_kh, stride_kd,  # k_cache [num_slots, Hkv, D]
        stride_vs, stride_vh, stride_vd,  # v_cache [num_slots, Hkv, D]
        stride_tb,  # block_tables [B, max_blocks], entries contiguous
        stride_ob, stride_oh,  # out [B, H, D], D contiguous
        qk_scale,  # softmax scale * log2(e): scores in the log2 domain, so exp2 below
        G: tl.constexpr, G_PAD: tl.constexpr,  # query heads per kv head; padded to a power of two >= 16
        D: tl.constexpr, D_PAD: tl.constexpr,  # head dim, padded to a power of two
        BLOCK: tl.constexpr,  # block_size (tokens per KV block), any size
        TILE: tl.constexpr,  # context positions per round (TILE_TOKENS)
        FP32_PRODUCTS: tl.constexpr,  # both products in exact fp32 (fp32 caches; see paged_decode_attention)
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        offs_g = tl.arange(0, G_PAD)  # [G_PAD] query head within the group
        offs_d = tl.arange(0, D_PAD)  # [D_PAD]
        offs_n = tl.arange(0, TILE)  # [TILE] position within a tile
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = kv_head * G + offs_g  # [G_PAD] query heads of this group

        q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(k_ptr.dtype.element_ty)

        context_len = tl.load(lens_ptr + seq)  # on the device: no host sync, graph-safe

        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)  # [G_PAD] running max (log2 domain)
        l = tl.zeros([G_PAD], dtype=tl.float32)  # [G_PAD] running sum of exp2(score - m)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)  # [G_PAD, D_PAD] running sum of p * V

        for start in range(0, context_len, TILE):
            pos = start + offs_n  # [TILE]
            t_mask = pos < context_len  # [TILE] positions inside the context (the table is read only there)
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK, mask=t_mask, other=0)
            slots = block.to(tl.int64) * BLOCK + pos % BLOCK  # int64: big pools overflow int32
            kv_mask = t_mask[:, None] & d_mask[None, :]  # [TILE, D_PAD]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)  # [TILE, D_PAD]
            if FP32_PRODUCTS:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale  # [G_PAD, TILE] fp32
            s = tl.where(t_mask[None, :], s, float("-inf"))

            m_new = tl.maximum(m, tl.max(s, axis=1))  # [G_PAD]; finite: a tile holds one position at least
            alpha = tl.exp2(m - m_new)  # [G_PAD] rescales what was summed so far
            p = tl.exp2(s - m_new[:, None])  # [G_PAD, TILE], 0 past the context
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)  # [TILE, D_PAD]
            if FP32_PRODUCTS:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv  # [G_PAD, D_PAD]
            m = m_new

        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l >= 1 whenever context_len >= 1
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, heads contiguous); k_cache, v_cache [num_slots, Hkv, D] where slot
    b * block_size + i holds token i of block b; block_tables [B, max_blocks] int32 or int64 (entries past a
    sequence's last block are arbitrary valid block ids); context_lens [B] int32/int64, each >= 1 (the query
    attends to positions [0, context_len) of its own sequence). Returns [B, H, D] in q's dtype.

    No host syncs and no shapes from tensor values: safe to capture in a CUDA graph."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton, which is not installed")
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} kv heads"
    assert block_tables.stride(1) == 1 and context_lens.dim() == 1
    G = H // Hkv
    # tl.dot's smallest shape is 16 on each side: the query heads of a group padded to 16 rows at least.
    G_PAD, D_PAD = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    # fp32 caches multiply in exact fp32 (tl.dot would use tf32). So do bf16 caches under Triton's
    # interpreter, which has no bf16 products (numpy has no bfloat16; Triton 3.9's interpreted tl.dot on
    # bf16 operands returns garbage): there the tests check the kernel's indexing, masks and softmax, and
    # the fp16 cases its 16-bit products.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    fp32_products = k_cache.dtype == torch.float32 or (interpreted and k_cache.dtype == torch.bfloat16)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
    if B == 0:
        return out
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BLOCK=block_size, TILE=TILE_TOKENS,
        FP32_PRODUCTS=fp32_products, num_warps=4,
    )
    return out
