"""Attention over the paged KV cache.

KV cache layout, one tensor for the whole pool (see `kv_cache.py`):

    kv[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]

A layer sees its K and V as flat slot arrays `[num_blocks * block_size, num_kv_heads, head_dim]`;
slot `b * block_size + i` holds token `i` of block `b`. The runner turns block tables into slot
indices once per step (`AttentionMetadata`), so every layer only does index_copy_ / index gathers.

Prefill chunks run one SDPA call each (a chunk starting at position 0 attends to its own K/V with a
causal mask, a later chunk gathers its context from the cache). All single-token queries (decodes,
and one-token resumes) are batched into one padded SDPA call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence whose query spans several tokens in this step."""

    token_start: int  # first row of this sequence in the flattened batch
    token_end: int  # one past its last row
    num_cached: int  # tokens of context already in the cache before this chunk
    # [num_cached + chunk] slots of the whole context, or None when num_cached == 0
    key_slots: torch.Tensor | None
    # [chunk, num_cached + chunk] bool, True = may attend; None when num_cached == 0 (plain causal)
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor | None  # [Bd] rows of single-token queries in the flattened batch
    decode_key_slots: torch.Tensor | None  # [Bd, Lmax] context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool, False on padding


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D]. Returns [T, H, D]."""
    # Write first, so every query can read its own token from the cache.
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_end)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        if span.key_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_cache[span.key_slots], v_cache[span.key_slots]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None,
                                           scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, H, 1, D]
        kd = k_cache[meta.decode_key_slots].transpose(1, 2)  # [Bd, Hkv, Lmax, D]
        vd = v_cache[meta.decode_key_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=True)
        out[meta.decode_rows] = o.squeeze(2)
    return out
