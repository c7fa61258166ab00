"""The one boundary between the server and an engine: `EngineBackend`.

The server (`infercept.server`) imports nothing of the engine but this module: the backend interface,
the typed values that cross it, and the request-level types a caller builds (`SamplingParams`,
`InterceptParams`, the tool-call formats: `ToolFormat`, `ToolSpec`). Two backends implement it:
`NativeBackend` (native_backend.py: InferCept's own engine on its engine thread) and `VllmBackend`
(vllm_backend/: vLLM in a worker process). The interface is shaped for a backend whose engine runs in
another process: everything that reads engine state is async, and a snapshot may lag the engine by a step.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .outputs import RequestOutput
from .paused_kv import PAUSED_KV_STATES
from .reasoning_parsers import REASONING_PARSERS, THINK_END, ReasoningParser, get_reasoning_parser
from .request import InterceptParams
from .sampling_params import GRAMMAR_ENDS_THE_OUTPUT, GuidedDecodingParams, SamplingParams
from .stats import RESUME_KV_PLACES  # the keys of EngineSnapshot.resumes_by_kv
from .tool_format import ToolFormat, ToolSpec, VllmToolFormat, tool_format_for
from .tool_parsers import ToolCall, parser_for_model

__all__ = ["EngineBackend", "EngineInfo", "EngineSnapshot", "GRAMMAR_ENDS_THE_OUTPUT", "GuidedDecodingParams",
           "InterceptParams",
           "KVLocation", "PAUSED_KV_STATES", "REASONING_PARSERS", "RESUME_KV_PLACES", "ReasoningParser",
           "RequestOutput",
           "SamplingParams", "THINK_END", "ToolCall", "ToolFormat", "ToolSpec", "VllmToolFormat", "get_reasoning_parser",
           "parser_for_model", "tool_format_for"]


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the model and the engine, fixed for the backend's life."""

    model: str  # the model folder the engine loaded (a Hub repo id's: its snapshot in the Hugging Face cache)
    model_type: str  # config.json's model_type: picks the tool-call format
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    chat_template: str | None
    dtype: str
    device: str
    kv_capacity_tokens: int  # KV the device and host pools hold together (the paused-token default)
    # Grammar-constrained decoding (forced tool calls, response_format); without it the server asks for
    # a grammar only where the request needs one (and the backend refuses it: 400).
    guided_decoding: bool = True
    # vLLM's own tool parsers the backend runs (the vLLM backend: every one its vLLM has), for
    # `--tool-parser` names that are not ours (tool_format.tool_format_for).
    vllm_tool_parsers: tuple[str, ...] = ()
    # Why each of those that cannot force a call in its model's format (tool_choice required / named) cannot.
    vllm_forcing_refusals: dict[str, str] = field(default_factory=dict)
    # The KV policy as it runs (`Policy.label`: its name and the parts that differ from its class's); ""
    # where the backend does not say.
    policy: str = ""
    # What the backend says of the policy's parts at start-up (the vLLM backend: which of them run there).
    policy_note: str = ""

    @property
    def model_name(self) -> str:
        """The default served name: the model folder's name, or a Hub snapshot's repo id (the Hugging Face
        cache keeps a repo's files in `models--org--name/snapshots/<revision>/`)."""
        folder = os.path.normpath(self.model)
        snapshots = os.path.dirname(folder)
        repo = os.path.basename(os.path.dirname(snapshots))
        if os.path.basename(snapshots) == "snapshots" and repo.startswith("models--"):
            return repo[len("models--"):].replace("--", "/")
        return os.path.basename(folder)


@dataclass(frozen=True)
class KVLocation:
    """Where a request's context has KV: tokens on the device, on the host, or not computed
    (`discarded`; `cached` of those are still in the prefix cache and reused unless evicted first)."""

    device: int = 0
    host: int = 0
    discarded: int = 0
    cached: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "discarded": self.discarded, "cached": self.cached}


@dataclass
class EngineSnapshot:
    """Engine counters and gauges for /metrics (cumulative since start; may lag a step)."""

    num_steps: int = 0
    forward_seconds: float = 0.0
    num_computed_tokens: int = 0
    num_recomputed_tokens: int = 0
    recompute_seconds: float = 0.0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_discarded_tokens: int = 0
    num_preemptions: int = 0
    num_preemptions_by_swap: int = 0
    memory_waste_byte_seconds: float = 0.0
    device_blocks_total: int = 0
    device_blocks_used: int = 0
    host_blocks_total: int = 0
    host_blocks_used: int = 0
    prefix_queried_blocks: int = 0
    prefix_hit_blocks: int = 0
    prefix_evicted_blocks: int = 0
    prefix_cached_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_active_programs: int = 0  # requests scheduled once and not finished (running, paused, resuming)
    admission_cap: int | None = None  # Policy.admission's cap on active programs; None: uncapped
    num_held_back: int = 0  # new programs waiting because of that cap
    num_thrashed_tokens: int = 0
    resumes_by_kv: dict[str, int] = field(default_factory=dict)  # RESUME_KV_PLACES -> resumes (cumulative)
    paused_by_state: dict[str, int] = field(default_factory=dict)  # PAUSED_KV_STATES -> generations
    paused_tokens_by_location: dict[str, int] = field(default_factory=dict)  # device / host / discarded


class EngineBackend(ABC):
    """An engine as the server uses it. Streams end with the turn (`RequestOutput.turn_done`: finished,
    or paused at an interception); leaving a stream early aborts its request."""

    info: EngineInfo

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """The engine stopped on an error and will serve nothing more (the server then exits non-zero
        so a supervisor restarts it). A shutdown is not a failure."""
        return False

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Abort everything in flight and stop (blocking; the server calls it off the event loop)."""

    @abstractmethod
    def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                 intercept: InterceptParams | None = None) -> AsyncIterator[RequestOutput]:
        """Start a request; its first output arrives once it has its first token. ValueError (bad
        input) and RuntimeError (engine not running) surface from the first `anext`."""

    @abstractmethod
    def resume(self, request_id: str, appended: list[int], params: SamplingParams | None = None,
               intercept: InterceptParams | None = None) -> AsyncIterator[RequestOutput]:
        """Continue a paused request with `appended` tokens (its interception's result); KeyError /
        ValueError from the first `anext` if it is not paused."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request in any state, paused included, and free its KV. Unknown ids are ignored."""

    @abstractmethod
    def cancel_in_flight(self, reason: str) -> None:
        """End every turn being generated: each stream raises RuntimeError(reason) to its caller (the
        server's shutdown, past its grace period). Paused generations are left alone."""

    @abstractmethod
    async def kv_location(self, request_id: str) -> KVLocation:
        """Where the request's KV is now; KeyError if the engine does not know it."""

    @abstractmethod
    async def snapshot(self) -> EngineSnapshot: ...

    @abstractmethod
    def paused_kv_tokens(self, request_id: str) -> int:
        """KV tokens (device + host) a paused request still keeps; 0 if it is not paused. Synchronous
        and cheap: the server calls it to choose which paused generation to release (may lag)."""
