"""Wire shapes of the OpenAI Responses API (`POST /v1/responses`) and of its stream events.

The request is strict at the top level like OpenAI's (an unknown field is a 400) and accepts, without
acting on them, the fields that change nothing a local server does. Input items are recognized by
their `type`; a message may omit it (`{"role": "user", "content": "..."}`), as the SDK allows.
Output models keep OpenAI's keys, nulls included, so the official SDK parses them into its types.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from .protocol import Lenient, Strict

# -- request ----------------------------------------------------------------------------------------


class TextPart(Lenient):
    # input_text in user/system turns; output_text when a client echoes an earlier assistant message
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class ReasoningItem(Lenient):
    """A reasoning item a client sends back (its earlier output): the conversation leaves it out, as chat
    templates leave earlier thinking out; a paused generation keeps the thinking as its tokens."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


class FunctionTool(Strict):
    """A Responses-style function tool: the definition is flat, not nested under `function`."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text"]


class TextConfig(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str | None = None  # None = the served model
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    # Accepted for compatibility and otherwise ignored.
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    reasoning: dict | None = None  # effort / summary: a local thinking model thinks as it was trained to


# -- response ---------------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's thinking (--reasoning-parser), before the message or calls it led to."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)  # a local model's thinking is given whole, not summarized
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # input tokens whose KV was reused (a resumed generation's context)
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict | None = None
    store: bool = True
    temperature: float | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
