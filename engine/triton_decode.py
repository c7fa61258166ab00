"""Paged decode attention in Triton: single-token queries read their context through the block table.

Layout (see `attention.py` and `kv_cache.py`): a layer's K and V caches are flat slot arrays
`[num_slots, Hkv, D]`, where slot `b * block_size + i` holds token `i` of block `b`; a sequence's
block table lists its blocks in order, so its position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`.

Why a kernel: decode steps run from CUDA graphs (`decode_graphs.py`), which replay fixed shapes and
cannot sync with the host. The torch path gathers every sequence's whole padded context
(`[B, max_blocks * block_size, Hkv, D]`) and masks it, a copy whose size is set by the longest context
the graph was captured for. This kernel instead walks each sequence's own blocks through the table,
with the number of blocks read from `context_lens` on the device: the grid depends only on the batch
size and head counts, nothing is copied, and nothing is read past a context's length.

One program per (sequence, kv head). It handles the G = H // Hkv query heads that share that kv head
together (GQA; G padded to a power of two with masks), so each K/V block is loaded once per group.
Per block: scores `[G, block_size]` by broadcast multiply-and-sum (no `tl.dot`, which needs 16 rows),
an online softmax in fp32 (running max and sum in the log2 domain), and the weighted V summed into an
fp32 accumulator `[G, D]`; the output is cast to q's dtype at the end.

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
        G: tl.constexpr, G_PAD: tl.constexpr,  # query heads per kv head, padded to a power of two
        D: tl.constexpr, D_PAD: tl.constexpr,  # head dim, padded to a power of two
        BLOCK: tl.constexpr,  # block_size (tokens per KV block), a power of two
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        offs_g = tl.arange(0, G_PAD)  # [G_PAD] query head within the group
        offs_d = tl.arange(0, D_PAD)  # [D_PAD]
        offs_t = tl.arange(0, BLOCK)  # [BLOCK] token within a block
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = kv_head * G + offs_g  # [G_PAD] query heads of this group

        # q: [G_PAD, D_PAD], fp32, pre-scaled; padded heads / dims load as 0
        q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * qk_scale

        context_len = tl.load(lens_ptr + seq)  # on the device: no host sync, graph-safe
        num_blocks = (context_len + BLOCK - 1) // BLOCK  # blocks holding positions [0, context_len)

        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)  # [G_PAD] running max (log2 domain)
        l = tl.zeros([G_PAD], dtype=tl.float32)  # [G_PAD] running sum of exp2(score - m)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)  # [G_PAD, D_PAD] running sum of p * V

        for j in range(0, num_blocks):
            block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)  # int64: big pools overflow int32
            slots = block * BLOCK + offs_t  # [BLOCK]
            t_mask = j * BLOCK + offs_t < context_len  # [BLOCK] positions inside the context
            kv_mask = t_mask[:, None] & d_mask[None, :]  # [BLOCK, D_PAD]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK, D_PAD]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK]
            s = tl.where(t_mask[None, :], s, float("-inf"))

            # Online softmax. Every block the loop visits has position j * BLOCK < context_len, so
            # m_new is finite and alpha = exp2(-inf) = 0 on the first block.
            m_new = tl.maximum(m, tl.max(s, axis=1))  # [G_PAD]
            alpha = tl.exp2(m - m_new)  # [G_PAD] rescales what was summed so far
            p = tl.exp2(s - m_new[:, None])  # [G_PAD, BLOCK], 0 past the context
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK, D_PAD]
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G_PAD, D_PAD]
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
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} is not a power of two"
    assert block_tables.stride(1) == 1 and context_lens.dim() == 1
    G = H // Hkv
    G_PAD, D_PAD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    # The [G_PAD, block_size, D_PAD] products live in registers: 8 warps for tiles past 8192 elements
    # (compiled for sm_90 here, ptxas -v at block 16: no spills up to G 16 x D 128, 4 bytes at G 8 x D 256;
    # 16 warps cap registers at 128 a thread and spill more).
    num_warps = 4 if G_PAD * block_size * D_PAD <= 8192 else 8
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
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BLOCK=block_size, num_warps=num_warps,
    )
    return out
