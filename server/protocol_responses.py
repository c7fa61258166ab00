"""Wire shapes of the OpenAI Responses API (`POST /v1/responses`) and of its stream events.

The request is strict at the top level like OpenAI's (an unknown field is a 400) and accepts, without
acting on them, the fields that change nothing a local server does. Input items are recognized by
their `type`; a message may omit it (`{"role": "user", "content": "..."}`), as the SDK allows.
Output models keep OpenAI's keys, nulls included, so the official SDK parses them into its types.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from .mcp_config import SERVER_NAME
from .protocol import Lenient, SamplingKnobs, Strict, TokenLogprob

# -- request ----------------------------------------------------------------------------------------

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # an `include` that asks for the output text's logprobs


class TextPart(Lenient):
    # input_text in user/system turns; output_text when a client echoes an earlier assistant message
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None


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
    id: str | None = None


class McpApprovalResponseItem(Lenient):
    """The user's answer to an `mcp_approval_request` of the previous response (or of the input)."""

    type: Literal["mcp_approval_response"]
    approval_request_id: str = Field(min_length=1)
    approve: bool
    reason: str | None = None
    id: str | None = None


class McpApprovalRequestItem(Lenient):
    """An `mcp_approval_request` output item sent back as input (a client keeping its own history)."""

    type: Literal["mcp_approval_request"]
    id: str = Field(min_length=1)
    server_label: str
    name: str
    arguments: str


class McpCallItem(Lenient):
    """An `mcp_call` output item sent back as input."""

    type: Literal["mcp_call"]
    id: str = Field(min_length=1)
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: Any = None
    approval_request_id: str | None = None


class McpListToolsItem(Lenient):
    """An `mcp_list_tools` output item sent back as input (nothing to render: tools come from `tools`)."""

    type: Literal["mcp_list_tools"]
    server_label: str
    tools: list[dict] = Field(default_factory=list)
    id: str | None = None
    error: str | None = None


McpInputItem = McpApprovalResponseItem | McpApprovalRequestItem | McpCallItem | McpListToolsItem


class ReasoningItem(Lenient):
    """A reasoning item a client sends back (its earlier output): the conversation leaves it out, as chat
    templates leave earlier thinking out; a paused generation keeps the thinking as its tokens."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = Field(default_factory=list)  # (kept as sent, where a conversation keeps the item)
    content: list[dict] | None = None


class ItemReference(Lenient):
    """An item of a stored response (or conversation) named by its id instead of sent again, as clients
    that keep the history send earlier output items (the AI SDK's OpenAI provider, with `store`): the
    server puts the item it names in its place (ResponsesServing.dereferenced)."""

    type: Literal["item_reference"] = "item_reference"
    id: str = Field(min_length=1)


def input_item_type(value: Any) -> str:
    """The type of a Responses input item (a parsed one, or its JSON object)."""
    if isinstance(value, dict):
        kind = value.get("type")
        if kind is None and "role" not in value and "id" in value:  # (OpenAI's reference may leave its type out)
            return "item_reference"
    else:
        kind = getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[McpApprovalResponseItem, Tag("mcp_approval_response")],
                            Annotated[McpApprovalRequestItem, Tag("mcp_approval_request")],
                            Annotated[McpCallItem, Tag("mcp_call")],
                            Annotated[McpListToolsItem, Tag("mcp_list_tools")],
                            Annotated[ReasoningItem, Tag("reasoning")],
                            Annotated[ItemReference, Tag("item_reference")]],
                      Discriminator(input_item_type)]


class FunctionTool(Strict):
    """A Responses-style function tool: the definition is flat, not nested under `function`."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class McpToolFilter(Strict):
    tool_names: list[str] | None = None
    read_only: bool | None = None  # matches tools whose server annotates them readOnlyHint


class McpApprovalFilter(Strict):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpToolParam(Strict):
    """OpenAI's remote MCP tool (server/responses_mcp.py): the tools of the server `server_label` names, an
    operator-configured one (--mcp-config) or the request's own `server_url` (if --mcp-allow-url allows it)."""

    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    server_description: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None  # None: always, as OpenAI
    headers: dict[str, str] | None = None
    authorization: str | None = None  # an OAuth access token: sent as `Authorization: Bearer ...`
    connector_id: str | None = None  # OpenAI's hosted connectors: refused (responses_mcp.py)
    tunnel_id: str | None = None  # likewise
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None

    @field_validator("server_label")
    @classmethod
    def _label(cls, v: str) -> str:
        # the label prefixes the function names the model sees (`<label>__<tool>`), like a config server name
        if not SERVER_NAME.match(v) or len(v) > 32:
            raise ValueError("server_label must be up to 32 letters, digits and '-', with single '_' inside")
        return v


ResponsesTool = Annotated[Union[FunctionTool, McpToolParam], Field(discriminator="type")]


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class McpToolChoice(Strict):
    """Force a call of `name` of the MCP server `server_label` (any of its tools without `name`)."""

    type: Literal["mcp"]
    server_label: str
    name: str | None = None


class PlainTextFormat(Lenient):
    type: Literal["text"]


class JSONObjectFormat(Lenient):
    type: Literal["json_object"]


class JSONSchemaTextFormat(Lenient):
    """Chat Completions' `response_format.json_schema`, flat under `text.format` as the Responses API has it."""

    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema here, strict or not


TextFormat = Annotated[Union[PlainTextFormat, JSONObjectFormat, JSONSchemaTextFormat], Field(discriminator="type")]


class TextConfig(Lenient):
    """What the response's text must be: free text, any JSON object, or JSON that follows a schema
    (grammar-constrained by the same path as Chat Completions' response_format)."""

    format: TextFormat | None = None

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow; None for free text."""
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return None
        return {"type": "object"} if fmt.type == "json_object" else fmt.schema_

    def echoed(self) -> dict:
        """The `text` field of the response object: the format as asked (OpenAI's keys), text by default."""
        fmt = self.format.model_dump(by_alias=True, exclude_none=True) if self.format else {"type": "text"}
        return {"format": fmt}


class ConversationRef(Strict):
    id: str = Field(min_length=1)


class ResponsesRequest(SamplingKnobs):
    """OpenAI's fields, and vLLM's extras: its sampling fields (SamplingKnobs, as on Chat Completions) and
    `chat_template_kwargs`."""

    model: str | None = None  # None = the served model
    input: str | list[InputItem] = Field(default_factory=list)  # (may be empty after a conversation's items)
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | McpToolChoice | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)  # MCP calls the server runs in this response
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    # The conversation (/v1/conversations) the response belongs to: its items come before `input`, and the
    # input and output items are added to it when the response ends (its id, or {"id": ...})
    conversation: str | ConversationRef | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # alternatives per token, with OUTPUT_LOGPROBS
    # What the response includes beyond its default: OUTPUT_LOGPROBS is read; the others name what this
    # server never has (file search results, encrypted reasoning, ...) and are accepted and ignored
    include: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as on Chat Completions
    include_reasoning: bool = True  # vLLM's: false, no reasoning item (the paused generation keeps the thinking)
    # Behind the launcher's router, the key's replica serves the request (server/replica_forwarding.py);
    # one server has one cache for every key.
    prompt_cache_key: str | None = None
    background: bool | None = None  # run without the client: server/responses_background.py
    # auto: a conversation longer than the context keeps its last tokens; disabled (the default): a 400
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted for compatibility and otherwise ignored.
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    reasoning: dict | None = None  # effort / summary: a local thinking model thinks as it was trained to

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def logprobs(self) -> int | None:
        """Top logprobs per output token the response shows (0: the sampled token's alone); None: none."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or ()) else None


# -- response ---------------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


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


class OutputMcpListTools(BaseModel):
    id: str
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    server_label: str
    tools: list[dict]  # name, input_schema, description, annotations: as the MCP server lists them
    error: str | None = None


class OutputMcpCall(BaseModel):
    id: str
    type: Literal["mcp_call"] = "mcp_call"
    server_label: str
    name: str  # the tool's name on its server
    arguments: str
    output: str | None = None
    error: dict | None = None  # mcp_protocol_error (code, message) or mcp_tool_execution_error (content)
    approval_request_id: str | None = None
    status: Literal["completed", "failed"] = "completed"


class OutputMcpApprovalRequest(BaseModel):
    id: str
    type: Literal["mcp_approval_request"] = "mcp_approval_request"
    server_label: str
    name: str
    arguments: str



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


OutputItem = (OutputReasoning | OutputMessage | OutputFunctionCall | OutputMcpListTools | OutputMcpCall
              | OutputMcpApprovalRequest)


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
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool = False
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: dict | None = None  # {"id": ...} of the conversation its items were added to
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
