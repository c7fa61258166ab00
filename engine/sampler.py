"""Turn logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs,
grammar masks (engine/guided_decoding.py), logit biases and penalties.

In vLLM's order (vllm/v1/sample/sampler.py): masks (banned tokens: min_tokens' and bad words'; allowed
token ids; grammars), logit bias, penalties (repetition, frequency, presence); then greedy rows take the
argmax, random rows are divided by their temperature and go through min-p, then top-k/top-p, then the
draw. Logprobs are those of the masked
logits, before bias and penalties (vLLM's default reports logits before everything). Each step is
skipped unless some row asks for it, decided from the parameters on the host: a batch that asks for
none of them costs nothing more and never waits on the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .copy_stream import to_device
from .outputs import SampledToken
from .sampling_params import SamplingParams


@dataclass
class AllowedTokens:
    """The tokens a grammar allows next, for some rows of the logits."""

    rows: list[int]  # rows of the logits that are constrained
    mask: torch.Tensor  # [len(rows), V] bool on the CPU; True = allowed


@dataclass
class TokenHistory:
    """A request's tokens as it samples its next one, for its penalties: the prompt, then `num_output`
    tokens it generated (in this turn: a resumed turn's earlier context is its prompt, as in vLLM)."""

    token_ids: Sequence[int]
    num_output: int


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Adds each row's `logit_bias` to its logits, in place (ids past the logits' width are left out:
    the server refuses them before they get here)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if rows:
        index = to_device([rows, cols], logits.device)
        logits.index_put_((index[0], index[1]), to_device(values, logits.device, logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, histories: Sequence[TokenHistory],
                    params: Sequence[SamplingParams]) -> torch.Tensor:
    """vLLM's penalties (vllm/model_executor/layers/utils.py `apply_penalties`) on logits [R, V], one row
    per history: repetition (a token seen in the prompt or the output: logit / penalty if > 0, else
    logit * penalty), then frequency (minus penalty x its count in the output), then presence (minus
    penalty if the output has it). The counts are built on the device from one upload of the rows'
    token ids (a scatter-add into [R, V]); nothing is read back."""
    num_rows, vocab = logits.shape
    device = logits.device
    lengths = torch.tensor([len(h.token_ids) for h in histories])
    num_outputs = torch.tensor([h.num_output for h in histories])
    ids = torch.cat([torch.as_tensor(h.token_ids, dtype=torch.long) for h in histories])
    # Each token's row, and whether it is an output token (the last `num_output` of its row).
    row = torch.repeat_interleave(torch.arange(num_rows), lengths)
    position = torch.arange(len(ids)) - (lengths.cumsum(0) - lengths)[row]
    is_output = position >= (lengths - num_outputs)[row]
    keep = ids < vocab  # (token ids come from this model; a wider tokenizer could not have written others)
    key = row * vocab + ids
    output_key = to_device(key[is_output & keep], device)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)  # (exact counts up to 2^24)
    counts.index_add_(0, output_key, torch.ones(len(output_key), dtype=torch.float32, device=device))
    counts = counts.view(num_rows, vocab)
    seen = counts > 0
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1 for r in repetition):
        in_prompt = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        in_prompt.index_fill_(0, to_device(key[~is_output & keep], device), True)
        penalty = torch.where(in_prompt.view(num_rows, vocab) | seen,
                              to_device(repetition, device, logits.dtype)[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = [p.frequency_penalty for p in params]
    if any(frequency):
        logits = logits - to_device(frequency, device, logits.dtype)[:, None] * counts
    presence = [p.presence_penalty for p in params]
    if any(presence):
        logits = logits - to_device(presence, device, logits.dtype)[:, None] * seen
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] (temperature applied); min_p: [B]. Masks with -inf the tokens whose probability is
    below min_p x the row's highest (vLLM's `MinPLogitsProcessor`; min_p 0 changes nothing)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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


@dataclass
class DeviceSamples:
    """A step's sampled tokens (and the logprobs asked for) as the device computed them, on their way to
    the host: `to_host` queues the copies behind the sampling, `result` waits for them only. Reading the
    tokens with `.tolist()` instead would wait for everything queued on the stream by then, the next
    step's forward pass too when the next step was launched first (asynchronous scheduling)."""

    tokens: torch.Tensor  # [B] on the device (the next step's inputs read them there: asynchronous scheduling)
    logprob_rows: list[int]  # rows that asked for logprobs, and how many top ones each
    top_k: list[int]
    chosen: torch.Tensor | None = None  # [len(logprob_rows)] the sampled tokens' logprobs
    top_values: torch.Tensor | None = None  # [len(logprob_rows), max(top_k)]
    top_ids: torch.Tensor | None = None
    _host: tuple | None = None  # the four, on the host
    _copied: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Queue the copies to the host (on CUDA, into pinned memory, without waiting)."""
        on_device = (self.tokens, self.chosen, self.top_values, self.top_ids)
        if self.tokens.device.type != "cuda":
            self._host = on_device
            return
        self._host = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in on_device)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> list[SampledToken]:
        if self._host is None:
            self.to_host()
        if self._copied is not None:
            self._copied.synchronize()
        tokens, chosen, values, ids = (None if t is None else t.tolist() for t in self._host)
        out = [SampledToken(t) for t in tokens]
        for j, (i, k) in enumerate(zip(self.logprob_rows, self.top_k)):
            out[i].logprob = chosen[j]
            if k:
                out[i].top_logprobs = dict(zip(ids[j][:k], values[j][:k]))
        return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]], allowed: AllowedTokens | None = None,
           histories: Sequence[TokenHistory | None] | None = None) -> list[SampledToken]:
    """`sample_on_device`, read on the host at once."""
    return sample_on_device(logits, params, generators, banned, allowed, histories).result()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                     banned: list[list[int]], allowed: AllowedTokens | None = None,
                     histories: Sequence[TokenHistory | None] | None = None,
                     permitted: Sequence[torch.Tensor | None] | None = None) -> DeviceSamples:
    """logits: [B, V] fp32, one row per request to sample; banned: token ids forbidden per row;
    permitted: per row, None or a [V] bool mask on the device of the only tokens it may sample
    (`allowed_token_ids`); allowed: grammar masks. They act before everything else, so top-k/top-p, the
    random draw and the logprobs all see only the tokens that may follow. histories: each row's tokens,
    needed (only) for the rows whose parameters set a penalty. Nothing here waits for the device."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, to_device(ids, logits.device)] = float("-inf")
    for row, mask in enumerate(permitted or ()):
        if mask is not None:
            logits[row].masked_fill_(~mask, float("-inf"))
    if allowed is not None:
        rows = to_device(allowed.rows, logits.device)
        logits[rows] = logits[rows].masked_fill(~to_device(allowed.mask, logits.device), float("-inf"))
    # Logprobs are the model's (after the masks), before the bias and the penalties, as vLLM reports them.
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprob_rows = to_device(want_logprobs, logits.device) if want_logprobs else None
    logprobs = logits[logprob_rows].log_softmax(dim=-1) if want_logprobs else None
    if any(p.logit_bias for p in params):
        apply_logit_bias(logits, params)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        if histories is None or any(histories[i] is None for i in penalized):
            raise ValueError("a request with penalties samples without its token history")
        rows = to_device(penalized, logits.device)
        logits[rows] = apply_penalties(logits[rows], [histories[i] for i in penalized], [params[i] for i in penalized])
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = to_device(random_rows, logits.device)
        temps = to_device([params[i].temperature for i in random_rows], logits.device, torch.float32)
        scaled = logits[rows] / temps[:, None]
        top_k = to_device([params[i].top_k for i in random_rows], logits.device)
        top_p = to_device([params[i].top_p for i in random_rows], logits.device, torch.float32)
        if any(params[i].min_p > 0 for i in random_rows):
            scaled = apply_min_p(scaled, to_device([params[i].min_p for i in random_rows], logits.device))
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in random_rows):  # asked of the host: no sync
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    samples = DeviceSamples(tokens, want_logprobs, [params[i].logprobs for i in want_logprobs])
    if logprobs is not None:
        samples.chosen = logprobs.gather(1, tokens[logprob_rows][:, None])[:, 0]
        k = max(samples.top_k)
        if k:
            samples.top_values, samples.top_ids = logprobs.topk(k, dim=-1)
    return samples
