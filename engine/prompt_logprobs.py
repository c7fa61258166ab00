"""Prompt logprobs (SamplingParams.prompt_logprobs): how likely the model found each prompt token given the
tokens before it, its rank there and the top k, as vLLM reports them: of the raw logits, before any mask,
bias or penalty (those act on sampling only).

A chunk's hidden states are scored in pieces of `ROWS` positions, so a long prompt never holds a logits
tensor of every position at once (2,048 positions of a 128k vocabulary in fp32 would be 1 GiB).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .copy_stream import to_device
from .outputs import SampledToken

ROWS = 256


@dataclass
class PromptSpan:
    """A chunk's positions to score: hidden-state rows `first` onwards, each followed by its target token."""

    request_id: str
    first: int
    targets: list[int]
    top_k: int


def score(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
          spans: list[PromptSpan]) -> dict[str, list[SampledToken]]:
    """Each span's targets' logprobs, ranks and top k, read on the host (this waits for the pass that
    computed `hidden`: a step scoring a prompt gives up overlapping the host with its pass)."""
    queued = []
    for span in spans:
        targets = to_device(span.targets, hidden.device)
        pieces = []
        for at in range(0, len(span.targets), ROWS):
            rows = min(ROWS, len(span.targets) - at)
            logprobs = compute_logits(hidden[span.first + at:span.first + at + rows]).log_softmax(dim=-1)
            wanted = targets[at:at + rows, None]
            chosen = logprobs.gather(1, wanted)
            rank = (logprobs > chosen).sum(dim=-1) + 1
            top = logprobs.topk(span.top_k, dim=-1) if span.top_k else None
            pieces.append((chosen[:, 0], rank, top))
        queued.append(pieces)
    out = {}
    for span, pieces in zip(spans, queued):
        scored = out[span.request_id] = []
        for chosen, rank, top in pieces:
            values, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else (None, None)
            for j, (lp, r) in enumerate(zip(chosen.tolist(), rank.tolist())):
                scored.append(SampledToken(span.targets[len(scored)], lp,
                                           dict(zip(ids[j], values[j])) if ids is not None else None, r))
    return out
