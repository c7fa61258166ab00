"""Wire shapes: pydantic models of the OpenAI Chat Completions and Completions APIs, and errors.

Requests are validated strictly where OpenAI is strict (`extra="forbid"`: an unknown top-level field is
a 400, as OpenAI answers "Unrecognized request argument supplied"), with vLLM's extras (the sampling
ones in `SamplingKnobs`, which Responses requests take too: `ignore_eos`, `min_tokens`, `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output`, `cache_salt`, `priority`,
`thinking_token_budget`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`; then `return_token_ids`,
`prompt_logprobs`, `return_tokens_as_token_ids`, `truncate_prompt_tokens` and `truncation_side`, `request_id`,
`structured_outputs` regex / choice and their older spellings `guided_regex` / `guided_choice`, and on chat
completions `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`) and ours
(`session_id`, `intercept`). Messages are lenient (`extra="ignore"`) because SDKs echo response messages
back with fields such as `refusal` and `annotations`. Responses keep OpenAI's keys, nulls included; a
stream delta is a plain dict because OpenAI sends only the keys that changed.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)

# -- errors -----------------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- shared request pieces --------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's; there is nothing to obfuscate here
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, usage comes in the last chunk only


class InterceptOptions(Strict):
    """Our extension: this request's stops (chat: its tool calls) are interceptions that take about
    `expected_s` seconds; the generation pauses instead of finishing and a later request resumes it."""

    kind: Literal["tool", "human", "model"] = "tool"
    expected_s: float | None = Field(default=None, ge=0)


def _check_stop(v: str | list[str] | None) -> str | list[str] | None:
    items = [v] if isinstance(v, str) else (v or [])
    if len(items) > 16:
        raise ValueError("at most 16 stop sequences")
    if any(not s for s in items):
        raise ValueError("stop sequences must be non-empty")
    return v


Stop = Annotated[str | list[str] | None, AfterValidator(_check_stop)]  # OpenAI's `stop`: up to 16 strings
# vLLM's `cache_salt`, the prefix cache's namespace: a request shares cached blocks only with requests of
# the same salt (and, unless --shared-prefix-cache, of the same tenant)
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)] | None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`, the kinds that are not JSON: the whole output fullmatches `regex`, or
    is exactly one of `choice` (grammar-constrained, server/structured.py). vLLM's other kinds (json,
    grammar, structural_tag, ...) are refused as unknown fields; JSON is `response_format`'s."""

    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.regex is None) == (self.choice is None):
            raise ValueError("give exactly one of regex and choice")
        return self


class OptionalSampling(Strict):
    """The sampling fields, as OpenAI and vLLM name and bound them, that a request leaves unset with None
    (the server's or the model's default applies): every front end's, and a native session's defaults."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: Stop = None
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    stop_token_ids: list[int] | None = None  # ids that end the output as EOS does (the model's own ids)
    cache_salt: CacheSalt = None


class SamplingKnobs(OptionalSampling):
    """How a request samples: the fields Chat Completions, Completions and Responses share
    (turn_types.Sampling.of reads them; server/structured.py the output constraint)."""

    # vLLM extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False  # the text keeps the stop string or stop token that ended it
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0  # the request's place in the engine's queues: lower first (vLLM's)
    # vLLM's: a thinking model (--reasoning-parser) thinks at most this many tokens, then </think> is
    # forced; -1 or null: no budget
    thinking_token_budget: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)  # sample only among these
    bad_words: list[str] | None = None  # words the output never contains (as vLLM tokenizes them)
    skip_special_tokens: bool = True  # false: the text keeps the special tokens the model writes


class SamplingFields(SamplingKnobs):
    """Fields common to both endpoints."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=128)
    user: str | None = None
    # vLLM extras
    return_token_ids: bool = False
    # Each prompt token's logprob, rank and top k (not streamed, as in vLLM)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # logprobs name each token "token_id:<id>"
    # The response's id is "chatcmpl-<request_id>" ("cmpl-" on completions); an X-Request-Id header names it
    # first. Not unique: several requests may share one (their engine requests' ids still differ)
    # (visible ASCII: it goes out in a response header too)
    request_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    # Serve only the rendered prompt's last this many tokens (truncation_side right: its first); -1: as
    # many as leave the context room for one output token
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None  # None: left, as vLLM truncates a prompt to generate
    guided_regex: str | None = None  # vLLM's older spellings of structured_outputs regex / choice
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    # ours
    session_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    intercept: InterceptOptions | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream=true")
        return self


# -- chat completions request -----------------------------------------------------------------------

class ContentPart(Lenient):
    type: str
    text: str | None = None


class FunctionCallParam(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(Lenient):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _parts_not_empty(cls, content):
        if isinstance(content, list) and not content:  # as OpenAI: an empty string is fine, no parts is not
            raise ValueError("an empty array of content parts; give at least one part, or a string")
        return content


class FunctionDefinition(Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(Strict):
    """What an answer without tool calls must be: free text, any JSON object, or JSON that follows
    `json_schema.schema` (grammar-constrained, server/serving_chat.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema an answer must follow; None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return {"type": "object"}
        return self.json_schema.schema_


def check_opening(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message continues the final message instead of opening a new one: "
                         "send it with add_generation_prompt false")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: extra keyword arguments of the tokenizer's `apply_chat_template` (variables of the template,
    # such as Qwen3's `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: how the prompt ends. add_generation_prompt false alone: the conversation as history; with
    # continue_final_message, inside its final assistant message, whose text the answer continues
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: false leaves a thinking model's thinking out of the answer (its paused generation keeps it)
    include_reasoning: bool = True
    # ours: tools the server runs itself (by name, see server/tool_loop.py); their calls never leave it
    server_tools: list[str] | None = Field(default=None, min_length=1)
    # Behind the launcher's router, the key's replica serves the request (server/replica_forwarding.py);
    # one server has one cache for every key.
    prompt_cache_key: str | None = None
    # Accepted for compatibility and otherwise ignored (they change nothing a local server does).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _one_opening(self):
        check_opening(self.add_generation_prompt, self.continue_final_message)
        return self


# -- completions request ----------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, the prompt alone (scored, with logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


# -- responses --------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # a thinking turn's (--reasoning-parser)

    @model_serializer(mode="wrap")
    def _without_unset_details(self, handler):
        data = handler(self)  # (completion_tokens_details only where a turn thinks: the wire stays as it was)
        if isinstance(data, dict) and data.get("completion_tokens_details", 0) is None:
            del data["completion_tokens_details"]
        return data


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # vLLM's: the thinking (--reasoning-parser); left out when None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it
    token_ids: list[int] | None = None  # return_token_ids (vLLM)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM)
    session_id: str | None = None  # ours: set when the request named a session


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: on the chunk that ends the choice
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM)
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """OpenAI's model object (vLLM's `root` and `max_model_len` with it), and the fields Anthropic's
    model object adds (`type`, `display_name`), so that either SDK reads it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "infercept"
    root: str | None = None
    max_model_len: int | None = None
    type: Literal["model"] = "model"
    display_name: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
