"""Typed messages between the layers of a step: scheduler -> runner -> update -> caller."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] == the request's num_computed_tokens
    block_table: list[int]  # device blocks holding positions [0, start_pos + len(token_ids))
    sample: bool  # the chunk reaches the request's last token, so a next token is sampled
    sampling_params: SamplingParams
    num_output_tokens: int  # for min_tokens
    # The request's tokens so far (its prompt, then its `num_output_tokens` outputs), for a request with
    # penalties whose chunk samples (sampler.TokenHistory) and for a turn's first sample under a thinking
    # budget (thinking_budget.py); None for every other chunk.
    context_token_ids: list[int] | None = None
    # For a request that asked for prompt logprobs: the prompt tokens that follow the chunk's first
    # positions, one each (the prompt's last position is followed by the sample, so has none); the runner
    # reports their logprobs (`RunnerOutput.prompt_logprobs`).
    prompt_logprob_targets: list[int] | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    # Requests that ended or lost their KV since the last step; the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Block copies to run before the forward pass, in this order (a block freed by a swap-out may be
    # the destination of a swap-in or of new KV in the same step).
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Accounting for this iteration.
    num_recomputed_tokens: int = 0  # scheduled tokens whose KV had been computed before
    num_paused_device_tokens: int = 0  # KV tokens paused requests hold on the device (idle memory)
    num_discarded_tokens: int = 0  # KV tokens of paused requests dropped this iteration
    num_preempted: int = 0  # running requests taken off the device for room
    num_preempted_by_swap: int = 0  # of those, the ones whose KV went to the host (not recomputed)
    # Of `swap_out`, blocks copied to make room under pressure (preemption, eviction of paused KV): whole
    # contexts at once, outside the plan's swap budget (`Policy.reclaim`: a synchronous copy chosen
    # because it wastes less than recomputing).
    num_reclaim_swap_out_blocks: int = 0
    num_fresh_pauses_planned: int = 0  # paused since the last step: the policy decided their KV now
    # KV computed or copied again (admission's thrash signal): the recomputed tokens, plus the KV of
    # running requests preempted by swap and of swap-ins evicted half-way (they come back by copy again).
    num_thrashed_tokens: int = 0
    admission_cap: int | None = None  # the cap on active programs (Policy.admission); None: uncapped
    num_held_back: int = 0  # new programs waiting because the cap held them back this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    rank: int | None = None  # a prompt token's rank among the tokens its position could have had (1: the likeliest)


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken]  # request id -> its next token (only chunks with sample=True)
    # request id -> the logprobs of its chunk's `prompt_logprob_targets`, in order
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What a caller sees of a request after a step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far (text that may still become a stop string is held back)
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[SampledToken] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[SampledToken | None] | None = None
    num_cached_tokens: int = 0
    paused: bool = False  # the turn ended in an interception; the request waits for `resume`
    # At the end of a turn with tool calls (tool_format.CallJudge): the calls that count (tool_parsers.
    # ToolCall; they paused the request unless some other call did not count) and the text outside them.
    tool_calls: list = field(default_factory=list)
    content: str | None = None
    # While a turn that vLLM's tool parser reads runs (the vLLM backend): the content that parser, reading
    # the turn as it is written, has streamed so far, as a stream may show it (TurnOutput.streamed_content);
    # None where no vLLM parser reads the turn.
    streamed_content: str | None = None

    @property
    def turn_done(self) -> bool:
        return self.finished or self.paused
