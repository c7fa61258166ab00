"""Server settings: one frozen dataclass, built by the CLI (flags and INFERCEPT_* variables) or by tests."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Model name clients pass as `model`; None = the model folder's name. The folder path is accepted too.
    served_model_name: str | None = None
    # Bearer token every /v1 request must carry; None = no authentication.
    api_key: str | None = None
    # Paused generations (a tool call in flight) wait for their tool results up to session_ttl seconds.
    # They are limited by memory: past max_paused_tokens context tokens in all (None: as many as the
    # engine's device and host KV pools hold) or, if set, past max_paused of them, the one whose release
    # wastes least (the least KV kept; oldest among equals) is aborted. Aborting frees its blocks; a
    # late tool result is then served fresh.
    session_ttl: float = 600.0
    max_paused: int | None = None
    max_paused_tokens: int | None = None
    # Assistant tool-call turns remembered token-exactly, so later turns of the same conversation render
    # them as the model generated them (implicit resume needs this prefix to match token for token).
    max_remembered_turns: int = 4096
    # Responses stored for previous_response_id and GET /v1/responses/{id}: at most this many (the
    # oldest is forgotten first), each for response_ttl seconds after its creation.
    response_ttl: float = 3600.0
    max_stored_responses: int = 1024
    # Requests generating at once; beyond this the server answers 429 with Retry-After.
    max_concurrent_requests: int = 512
    # Request bodies larger than this are refused with 413.
    max_body_bytes: int = 16 * 1024 * 1024
    # Tool-call format; None = the model's chat family (engine.tool_parsers.parser_for_model).
    tool_parser: str | None = None

    def __post_init__(self):
        if self.session_ttl <= 0:
            raise ValueError("--session-ttl must be positive")
        if (self.max_paused or 0) < 0 or (self.max_paused_tokens or 0) < 0:
            raise ValueError("--max-paused and --max-paused-tokens must be >= 0")
        if self.response_ttl <= 0 or self.max_stored_responses < 0:
            raise ValueError("--response-ttl must be positive and --max-stored-responses >= 0")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
