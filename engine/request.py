"""A request as it travels through schedule -> run -> update."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams
from .tool_spec import ToolSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, preempted, or resumed after its KV was discarded
    RUNNING = "running"
    INTERCEPTED = "intercepted"  # paused at a tool call; its KV is preserved, swapped or discarded
    SWAPPED = "swapped"  # resumed, waiting for its KV to come back from the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class InterceptParams:
    """When a request pauses instead of finishing."""

    tool_parser: str | None = None  # pause when the model completes a tool call in this format
    # The calls that count (tool_format.CallJudge): None, any well-formed call; else a call must name
    # one of these tools with arguments valid under its schema. Without parallel_calls only the first
    # counts. A turn whose calls do not all count finishes instead of pausing (nobody could answer them).
    tools: tuple[ToolSpec, ...] | None = None
    parallel_calls: bool = True
    # Text the tool parser reads before the generated text: the opening of a forced call, which the
    # caller put at the end of the prompt (so a forced call pauses like any other, by its parse).
    text_prefix: str = ""
    # The turn must call: "required", or the name of the tool it must call (None: it may). Where vLLM's
    # parser reads the calls, the vLLM backend writes them under a grammar of the model's own format.
    forced_call: str | None = None
    # Calls are read only after the model's thinking, as this reasoning parser splits it (qwen3,
    # deepseek_r1: engine/reasoning_parsers.py); None: the whole text.
    reasoning_parser: str | None = None
    pause_on_stop: bool = False  # any stop (EOS, stop string or token, length) pauses instead of finishing
    expected_s: float | None = None  # client hint: how long the interception will take
    kind: str = "tool"  # tool / human / model, for the duration estimate's history


# A token sampled on the device and not yet read on the host: with asynchronous scheduling the next step
# is planned while the last one computes, each request that samples in it holding this as its newest
# token until the sample arrives (`Scheduler.advance`, `Scheduler.apply_samples`); the runner feeds the
# real token to the next pass from the device.
PLACEHOLDER = -1


@dataclass(eq=False)  # identity: queues do `in` / `remove`, and two requests are never "equal"
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # All tokens so far (prompt, then outputs); KV exists for the first num_computed_tokens.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    output_logprobs: list = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: the first turn's prompt tokens' logprobs so far (sampler.
    # SampledToken), from the first (None: nothing precedes it); complete once the prompt is computed.
    prompt_logprobs: list = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or token that ended it
    intercept: InterceptParams | None = None
    turn_start: int = 0  # index in token_ids where the current turn's generated tokens begin
    # Highest num_computed_tokens ever reached: computing below it again is recomputation.
    num_computed_high: int = 0
    recompute_all: bool = False  # recompute a discarded context in one iteration (discard baseline)
    pending_stop: RequestStatus | None = None  # a stop the engine may turn into a pause
    paused_at: float | None = None
    tool_calls: list = field(default_factory=list)  # the calls that paused it (tool_parsers.ToolCall)
    num_turns: int = 1
    # Content hashes of the context's full blocks, computed once (a context only grows at its end),
    # in the namespace of its first turn's `cache_salt` (its KV's, whatever later turns' parameters say).
    block_hashes: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    num_cached_tokens: int = 0  # this turn's context tokens whose KV was reused: never computed this turn
    # Program-level priority (Policy.priority): tokens computed for this request (its program) so far,
    # recomputed ones included; its first arrival, kept whatever arrival_time becomes; and the key the
    # scheduler's queues are sorted by (lower first; the request's own `priority` first), set whenever
    # it is queued.
    num_service_tokens: int = 0
    program_arrival: float | None = None
    priority: tuple = ()

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.turn_start = self.turn_start or len(self.prompt_token_ids)
        if self.program_arrival is None:
            self.program_arrival = self.arrival_time
        self.priority = self.priority or (self.sampling_params.priority, self.arrival_time)
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are still to compute."""
        return 0 < len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated in the current turn (since the prompt, or since the last resume)."""
        return self.token_ids[self.turn_start:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.turn_start

    @property
    def awaiting_sample(self) -> bool:
        """Its newest token is still a `PLACEHOLDER`."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def tool_name(self) -> str | None:
        return self.tool_calls[0].name if self.tool_calls else None

    @property
    def duration_key(self) -> str | None:
        """Whose duration history the interception's estimate reads and its duration joins: the tool
        called, else the interception's kind (a stop marked as an interception, a simulated tool)."""
        return self.tool_name or (self.intercept.kind if self.intercept else None)

    @property
    def duration_hint(self) -> float | None:
        """The client's expected total duration of the interception (`InterceptParams.expected_s`), if any."""
        return self.intercept.expected_s if self.intercept else None

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
