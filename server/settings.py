"""Server settings: frozen dataclasses, built by the CLI (flags and INFERCEPT_* variables) or by tests."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .generation_defaults import check_overrides, check_source
from .mcp_config import McpServerConfig


@dataclass(frozen=True)
class ConversationPolicy:
    """How long the server keeps conversations between requests, and how many (applied by
    server/conversations.py). Two clocks, not one: stored responses are documented to last an hour
    from their creation, everything else ten minutes unused."""

    # Seconds a paused generation (a tool call in flight), a chat `session_id` conversation or a
    # /v1/sessions session may stay unused (--idle-ttl; --session-ttl is its old name). Past it the
    # paused generation is aborted, freeing its blocks (a late tool result is then served fresh), and
    # the session is forgotten.
    idle_ttl: float = 600.0
    # Paused generations are limited by memory: past max_paused_tokens context tokens in all (None: as
    # many as the engine's device and host KV pools hold) or, if set, past max_paused of them, the one
    # whose release wastes least (the least KV kept; oldest among equals) is aborted.
    max_paused_tokens: int | None = None
    max_paused: int | None = None
    # Chat `session_id` conversations and /v1/sessions sessions kept at most (their messages are held in
    # memory); creating one more closes the least recently used one that is not generating (its paused
    # generation is aborted), or is refused with 429 if every one is generating.
    max_named_sessions: int = 16_384
    # Responses stored for previous_response_id and GET /v1/responses/{id}: at most this many (the
    # oldest is forgotten first, its paused generation aborted), each for response_ttl seconds after
    # its creation.
    response_ttl: float = 3600.0
    max_stored_responses: int = 1024
    # Responses-API conversations (/v1/conversations) kept at most, each for response_ttl seconds after
    # its last use; creating one more closes the least recently used one that is not generating.
    max_conversations: int = 1024
    # A chat request without tools that continues a paused generation (its calls' results, as AutoGen's
    # reflection step sends them) is served with the tools the paused prompt rendered and tool_choice
    # "none", so that it resumes instead of being recomputed under another prompt (--resume-without-tools).
    # Off by default: the model then sees tool definitions the request did not send (it cannot call them).
    resume_without_tools: bool = False
    # Assistant tool-call turns remembered token-exactly, so later turns of the same conversation render
    # them as the model generated them (implicit resume needs this prefix to match token for token).
    max_remembered_turns: int = 4096

    def __post_init__(self):
        if self.idle_ttl <= 0 or self.response_ttl <= 0:
            raise ValueError("--idle-ttl and --response-ttl must be positive")
        if (self.max_paused or 0) < 0 or (self.max_paused_tokens or 0) < 0 or self.max_stored_responses < 0:
            raise ValueError("--max-paused, --max-paused-tokens and --max-stored-responses must be >= 0")
        if self.max_named_sessions < 1 or self.max_conversations < 1:
            raise ValueError("--max-named-sessions and --max-conversations must be >= 1")


@dataclass(frozen=True)
class Tenant:
    """An API key and what its holder may keep: every conversation and paused generation belongs to the
    tenant whose key created it. Quotas (None: only the server's limits) bound its paused generations;
    over one, that tenant's oldest paused generation is released first, never another tenant's."""

    name: str
    key: str = field(repr=False)
    max_paused: int | None = None
    max_paused_tokens: int | None = None

    def __post_init__(self):
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError(f"tenant {self.name!r}: an API key is one word, not empty")
        if (self.max_paused or 0) < 0 or (self.max_paused_tokens or 0) < 0:
            raise ValueError(f"tenant {self.name!r}: quotas must be >= 0")


@dataclass(frozen=True)
class McpSettings:
    """The operator's MCP servers, whose tools the server runs itself (server/mcp_tools.py)."""

    servers: tuple[McpServerConfig, ...] = ()  # --mcp-config
    # Seconds one tool call may take (then the model reads a timeout error as its result); also the
    # bound on connecting to a server and listing its tools.
    call_timeout_s: float = 30.0
    # Seconds a server's tool list is kept before it is listed again (and a server that could not be
    # reached is tried again).
    tools_ttl_s: float = 300.0
    # URLs a Responses request may name as its own MCP server (`{"type": "mcp", "server_url": ...}`):
    # fnmatch-style globs over the whole URL (--mcp-allow-url, repeatable). None by default, so a client
    # cannot make the server reach a host the operator did not choose.
    allow_urls: tuple[str, ...] = ()

    def __post_init__(self):
        if self.call_timeout_s <= 0 or self.tools_ttl_s <= 0:
            raise ValueError("--mcp-timeout and --mcp-tools-ttl must be positive")
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError("MCP server names must be unique")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Model name clients pass as `model`; None = the model folder's name. The folder path is accepted too,
    # and `more_model_names` (an operator's aliases: e.g. the Claude model names an agent asks for).
    served_model_name: str | None = None
    more_model_names: tuple[str, ...] = ()
    # A Jinja chat template used instead of the model's own (its text; None = the tokenizer's).
    chat_template: str | None = None
    # Bearer token every /v1 request must carry; None = no authentication. `tenants` adds more keys, each
    # its own tenant (server/tenants.py); `api_key` alone is the tenant "default".
    api_key: str | None = None
    tenants: tuple[Tenant, ...] = ()
    # Tenants share one prefix cache: a common system prompt's KV is computed once for all of them, but a
    # tenant's cached_tokens (and its latency) then tell whether another tenant sent the same prompt.
    # False (the default): each tenant's prompts are cached apart from every other's.
    shared_prefix_cache: bool = False
    conversations: ConversationPolicy = field(default_factory=ConversationPolicy)
    # Requests generating at once; beyond this the server answers 429 with Retry-After.
    max_concurrent_requests: int = 512
    # Request bodies larger than this are refused with 413.
    max_body_bytes: int = 16 * 1024 * 1024
    # Seconds an idle keep-alive connection stays open. Longer than a client pool keeps one (httpx and the
    # openai SDK: 5 s; proxies often 60 s): a server that closes first races the client's next request on
    # that connection, which then fails with a connection reset instead of an answer.
    keep_alive_s: float = 75.0
    # Tool-call format; None = the model's chat family (engine.tool_parsers.parser_for_model).
    tool_parser: str | None = None
    # Thinking format (engine/reasoning_parsers.py: qwen3, deepseek_r1); None = turns are not split.
    reasoning_parser: str | None = None
    mcp: McpSettings = field(default_factory=McpSettings)
    # Sampling for the fields a request leaves out (server/generation_defaults.py): "auto" = the model's
    # generation_config.json, "none" = neutral, or a folder holding one; the overrides go over either.
    generation_config: str = "auto"
    override_generation_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def all_tenants(self) -> tuple[Tenant, ...]:
        return ((Tenant("default", self.api_key),) if self.api_key else ()) + self.tenants

    def __post_init__(self):
        names = [t.name for t in self.all_tenants]
        keys = [t.key for t in self.all_tenants]
        if len(set(names)) != len(names) or len(set(keys)) != len(keys):
            raise ValueError("tenant names and API keys must be unique")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        check_source(self.generation_config)
        check_overrides(self.override_generation_config)
