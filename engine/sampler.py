"""Turn logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs, and
grammar masks (engine/guided_decoding.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .outputs import SampledToken
from .sampling_params import SamplingParams


@dataclass
class AllowedTokens:
    """The tokens a grammar allows next, for some rows of the logits."""

    rows: list[int]  # rows of the logits that are constrained
    mask: torch.Tensor  # [len(rows), V] bool on the CPU; True = allowed


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; top_k: [B] long (0 = off); top_p: [B] float. Masks dropped tokens with -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays, also when top_p
    # underflows to 0 in fp32 (a top_p of 1e-300 is valid input).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]], allowed: AllowedTokens | None = None) -> list[SampledToken]:
    """logits: [B, V] fp32, one row per request to sample; banned: token ids forbidden per row;
    allowed: grammar masks. Both act before everything else, so top-k/top-p, the random draw and
    the logprobs all see only the tokens that may follow."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")
    if allowed is not None:
        rows = torch.tensor(allowed.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed.mask.to(logits.device), float("-inf"))
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        scaled = logits[rows] / temps[:, None]
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in random_rows):  # asked of the host: no sync
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    out = [SampledToken(int(t)) for t in tokens.tolist()]
    if want_logprobs:
        logprobs = logits[want_logprobs].log_softmax(dim=-1)
        for j, i in enumerate(want_logprobs):
            out[i].logprob = float(logprobs[j, out[i].token_id])
            k = params[i].logprobs
            if k:
                values, ids = logprobs[j].topk(k)
                out[i].top_logprobs = dict(zip(ids.tolist(), values.tolist()))
    return out
