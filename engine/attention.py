"""Attention over the paged KV cache.

KV cache layout, one tensor for the whole pool (see `kv_cache.py`):

    kv[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]

A layer writes new K/V into flat slot arrays `[num_blocks * block_size, num_kv_heads, head_dim]`
(slot `b * block_size + i` holds token `i` of block `b`) and reads a context back by whole blocks
(`index_select` of `[block_size, num_kv_heads, head_dim]` rows: measured here 2-3x faster than a
per-token gather). The runner turns block tables into slots and block lists once per step
(`AttentionMetadata`), shared by all layers.

Prefill chunks run one SDPA call each (a chunk starting at position 0 attends to its own K/V with a
causal mask, a later chunk gathers its context from the cache). All single-token queries (decodes,
and one-token resumes) are batched into one padded SDPA call.

On CUDA with flash-attn installed (fp16/bf16), every sequence instead goes through one varlen kernel
call: each sequence's context is gathered from the cache into a packed `[total_k, Hkv, D]` tensor and
`flash_attn_varlen_func` runs with bottom-right-aligned causal masking, so prefill chunks, resumes and
decodes share one launch. (Its native paged mode wants blocks of 256 tokens; ours are smaller.)

On CUDA with Triton, single-token queries instead go through our paged decode kernel
(`triton_decode.py`), which reads each context through its block table: no gathered copy of padded
contexts, and no shape that depends on the contexts' lengths, so the same call runs inside a CUDA graph
(`decode_graphs.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence whose query spans several tokens in this step."""

    token_start: int  # first row of this sequence in the flattened batch
    token_end: int  # one past its last row
    num_cached: int  # tokens of context already in the cache before this chunk
    # [ceil((num_cached + chunk) / block_size)] blocks of the whole context, or None when num_cached == 0
    key_blocks: torch.Tensor | None
    # [chunk, num_cached + chunk] bool, True = may attend; None when num_cached == 0 (plain causal)
    mask: torch.Tensor | None


@dataclass
class VarlenMetadata:
    """Packed layout for flash-attn's varlen kernel (CUDA only)."""

    key_slots: torch.Tensor  # [total_k] cache slots of every sequence's whole context, concatenated
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 query offsets
    cu_seqlens_k: torch.Tensor  # [B + 1] int32 key offsets
    max_seqlen_q: int
    max_seqlen_k: int


def flash_attn_varlen():
    """flash-attn's varlen function when it can be used here, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor | None  # [Bd] rows of single-token queries in the flattened batch
    decode_key_blocks: torch.Tensor | None  # [Bd * max_blocks] block tables, flattened, padded with block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool, False past each context
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each single-token query
    block_size: int = 16
    varlen: VarlenMetadata | None = None  # set instead of the above when flash-attn runs the step
    # The kernel single-token queries go through (`triton_decode.paged_decode_attention` on CUDA, same
    # contract as the CPU one), reading decode_key_blocks and decode_lens; None: gather + SDPA with decode_mask.
    decode_kernel: Callable | None = None


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole blocks of a flat slot cache: [len(blocks) * block_size, Hkv, D]."""
    by_block = cache.view(-1, block_size, *cache.shape[1:])
    return by_block.index_select(0, blocks).flatten(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, kernels=None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D]. Returns [T, H, D].

    kernels: the model's fused kernels (`cpu_kernels`, `triton_fused`): the caller has already written k
    and v to the cache with their `rope_and_cache`, and single-token queries go through their
    `paged_decode_attention` instead of gather + SDPA."""
    if kernels is None:  # write first, so every query can read its own token from the cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.varlen is not None:
        vl = meta.varlen
        return flash_attn_varlen()(q, k_cache[vl.key_slots], v_cache[vl.key_slots], vl.cu_seqlens_q,
                                   vl.cu_seqlens_k, vl.max_seqlen_q, vl.max_seqlen_k, softmax_scale=scale,
                                   causal=True)
    block_size = meta.block_size
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_end)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        if span.key_blocks is None:
            ks, vs = k[rows], v[rows]
        else:
            length = span.mask.shape[1]
            ks = _gather(k_cache, span.key_blocks, block_size)[:length]
            vs = _gather(v_cache, span.key_blocks, block_size)[:length]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None,
                                           scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        bd = meta.decode_rows.shape[0]
        qd = q if not meta.prefills else q[meta.decode_rows]  # [Bd, H, D]
        if kernels is not None:
            o = kernels.paged_decode_attention(qd, k_cache, v_cache, meta.decode_key_blocks.view(bd, -1),
                                               meta.decode_lens, scale, block_size)
        elif meta.decode_kernel is not None:
            o = meta.decode_kernel(qd, k_cache, v_cache, meta.decode_key_blocks.view(bd, -1), meta.decode_lens,
                                   scale, block_size)
        else:
            kd = _gather(k_cache, meta.decode_key_blocks, block_size).view(bd, -1, *k_cache.shape[1:])
            vd = _gather(v_cache, meta.decode_key_blocks, block_size).view(bd, -1, *v_cache.shape[1:])
            o = F.scaled_dot_product_attention(qd.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                                               attn_mask=meta.decode_mask, scale=scale, enable_gqa=True).squeeze(2)
        if not meta.prefills:
            return o  # a decode-only step: the rows are already in order
        out[meta.decode_rows] = o
    return out
