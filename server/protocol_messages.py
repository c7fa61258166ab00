"""Wire shapes of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
request, its content blocks, and the error body Anthropic's clients read.

Requests are lenient at the top level (`extra="ignore"`): Anthropic's clients send fields this server
has no use for (`metadata`, `service_tier`, beta fields such as `context_management`), and agents such
as Claude Code send them on every request. `output_config.format` (a JSON schema) constrains the answer
as Chat Completions' `response_format` does. `thinking` "disabled" turns a thinking model's thinking
off where its chat template can (Qwen3's `enable_thinking`); "enabled" with `budget_tokens` bounds it
(vLLM's `thinking_token_budget`, on a server with --reasoning-parser). vLLM's extras
`chat_template_kwargs` and `cache_salt` are read as on Chat Completions. What is read is checked as
Anthropic checks it: `max_tokens` is required, `temperature` lies in [0, 1], a `tool` choice names its
tool. Content blocks the server cannot take (images, documents, the hosted tools' blocks) are refused by their type, where
they are turned into chat messages (messages_input.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import APIError, CacheSalt

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(e: APIError) -> dict:
    """`e` as Anthropic's error JSON: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(Lenient):
    """A content block of any type; the fields of the types the server reads (text, tool_use,
    tool_result, thinking), checked where the block is read."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class MessageParam(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class Tool(Lenient):
    """A client tool (`type` absent or "custom"); Anthropic's hosted tools (web search, code execution,
    ...) carry a versioned type and run on Anthropic's side: refused."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when tool_choice.type is 'tool'")
        return self


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)  # "enabled": the most tokens the thinking may take


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    """Of `output_config`, `format` is read (structured outputs: the answer follows the schema); `effort`
    has no counterpart here and is ignored, as a budget is."""

    format: OutputFormat | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as on Chat Completions


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    cache_salt: CacheSalt = None  # vLLM's extra, as on Chat Completions
