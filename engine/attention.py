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

On CUDA with Triton, single-token queries instead go through our paged decode kernel
(`triton_decode.py`), and the queries of a step with prefill chunks all go through one paged attention
kernel (`triton_prefill.py`, `PagedQueries`); both read each context through its block table, with no
gathered copy and no shape that depends on the contexts' lengths, so the same calls run inside CUDA
graphs (`cuda_graphs.py`). The torch path stays for the CPU and as the reference.
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
class PagedQueries:
    """Every query of a step through one paged attention kernel (`triton_prefill.paged_prefill_attention`'s
    arguments; see there): sequence s owns rows [query_start[s], query_start[s + 1]) and a context of
    seq_lens[s] tokens read through block_tables[s]; map_seq / map_row split the work over programs."""

    block_tables: torch.Tensor  # [S, max_blocks]
    query_start: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    map_seq: torch.Tensor  # [P]
    map_row: torch.Tensor  # [P]
    kernel: Callable  # paged_prefill_attention, or paged_prefill_reference (CPU tests)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor | None  # [Bd] rows of single-token queries in the flattened batch
    decode_key_blocks: torch.Tensor | None  # [Bd * max_blocks] block tables, flattened, padded with the scratch block
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool, False past each context
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each single-token query
    block_size: int = 16
    paged: PagedQueries | None = None  # set instead of the above when one kernel takes every query
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
    if meta.paged is not None:
        p = meta.paged
        return p.kernel(q, k_cache, v_cache, p.block_tables, p.query_start, p.seq_lens, p.map_seq, p.map_row,
                        scale, meta.block_size)
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


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                            map_seq: torch.Tensor, map_row: torch.Tensor, scale: float,
                            block_size: int) -> torch.Tensor:
    """`triton_prefill.paged_prefill_attention`'s contract in torch, one SDPA call per sequence (reads the
    lengths on the host: for the CPU tests of the static-shape path, not for graphs). Rows no sequence
    owns are zero."""
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for s, length in enumerate(lens):
        rows = slice(starts[s], starts[s + 1])
        n = rows.stop - rows.start
        if n == 0:
            continue
        blocks = block_tables[s, :-(-length // block_size)]
        ks = _gather(k_cache, blocks, block_size)[:length].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vs = _gather(v_cache, blocks, block_size)[:length].transpose(0, 1).unsqueeze(0)
        visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), ks, vs,
                                           attn_mask=visible.to(q.device), scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out
