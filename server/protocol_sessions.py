"""Wire shapes of the native sessions API (`/v1/sessions`), our own: a stateful conversation whose
generation stays paused in the engine while its tool calls run."""
from __future__ import annotations

from pydantic import Field

from .protocol import InterceptOptions, OptionalSampling, Strict, ToolParam


class SamplingDefaults(OptionalSampling):
    """Named and checked as in a completion request (vLLM's extras included), so a turn passes them on as
    they are; None here is unset (a message's field overrides its session's only where it is set)."""

    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    include_stop_str_in_output: bool | None = None

    def sampling(self) -> dict:
        """These fields alone (a message's other fields are not sampling defaults)."""
        return self.model_dump(include=set(SamplingDefaults.model_fields))


class SessionCreateRequest(SamplingDefaults):
    """The sampling fields are the session's defaults for every turn."""

    model: str | None = None  # None = the served model
    system: str | None = None
    tools: list[ToolParam] | None = None  # the client runs these: their calls pause the session
    server_tools: list[str] | None = None  # the server runs these itself (infercept.tools names)


class ToolResult(Strict):
    tool_call_id: str = Field(min_length=1)
    content: str


class SessionMessageRequest(SamplingDefaults):
    """Exactly one of `content` (a user message), `tool_results` (for a paused session) or `token_ids`
    (a token-level session: tokens appended to its context, see server/serving_session_tokens.py); the sampling
    fields override the session's defaults for this turn."""

    content: str | None = None
    tool_results: list[ToolResult] | None = Field(default=None, min_length=1)
    token_ids: list[int] | None = Field(default=None, min_length=1)
    ignore_eos: bool = False  # token-level only: generate exactly max_tokens
    stream: bool = False
    # Chat: what the tool calls this turn may end in are (a hint). Token-level: the turn's stop is an
    # interception (the generation pauses; the next token_ids message resumes it).
    intercept: InterceptOptions | None = None
