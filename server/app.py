"""The FastAPI app: `build_app(backend, settings)`, over an `EngineBackend` (infercept.engine.backend).

Wires the serving objects (chat with and without server tools, completions, Responses, Anthropic's
Messages, native sessions), the conversation store and metrics into `app.state`; adds authentication,
a body-size limit and an access log with request ids (one small ASGI middleware); turns every error
into OpenAI's error JSON, or Anthropic's on /v1/messages (validation errors are 400, never 422 or 5xx);
runs the engine and the store's reaper for the app's lifetime.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from infercept.engine.backend import EngineBackend, parser_for_model, tool_format_for
from infercept.engine.backend import get_reasoning_parser
from infercept.tools import get_tool

from .chat import ChatRenderer
from .conversations import ConversationStore, Kind, engine_release
from .metrics import ServerMetrics
from .protocol import APIError
from .protocol_messages import error_body as anthropic_error_body
from .routes import router
from .engine_turn import Admission, EngineTurns
from .generation_defaults import sampling_defaults
from .serving_base import SHUTDOWN_GRACE_S
from .serving_chat import ChatServing
from .serving_completions import CompletionServing
from .serving_conversations import ConversationsServing
from .serving_messages import MessagesServing
from .responses_background import BackgroundResponses
from .responses_mcp import ResponsesMcp
from .serving_responses import ResponsesServing
from .serving_server_tools import ChatServerTools
from .serving_sessions import SessionServing
from .serving_tokenize import TokenizeServing
from .settings import ServerSettings
from .tenants import STATE_KEY as TENANT
from .tenants import Authenticator
from .turns import Turns

logger = logging.getLogger("infercept.server")


def served_model_name(backend: EngineBackend, settings: ServerSettings) -> str:
    return settings.served_model_name or backend.info.model_name


def build_app(backend: EngineBackend, settings: ServerSettings | None = None,
              tool_lookup: Callable[[str], Any] = get_tool,
              on_engine_failure: Callable[[], None] | None = None,
              shutting_down: Callable[[], bool] | None = None) -> FastAPI:
    """`tool_lookup(name)` gives the server tool a request may enable by name (KeyError if unknown);
    names starting with `mcp:` are the tools of the MCP servers in `settings.mcp` (server/mcp_tools.py).
    `on_engine_failure` runs once if the engine fails for good (`infercept serve` stops the process with
    a non-zero exit, so a supervisor restarts it); /health answers 503 from then on either way.
    `shutting_down()` turns true once the HTTP server stops accepting (SIGTERM): turns in flight then
    have `SHUTDOWN_GRACE_S` to finish before they end with a 503 in their own stream or response."""
    settings = settings or ServerSettings()
    info = backend.info
    model_name = served_model_name(backend, settings)
    chat_template = settings.chat_template or info.chat_template
    tool_parser = settings.tool_parser or parser_for_model(info.model_type, chat_template)
    # An unknown name fails at start-up. Not one of ours: vLLM's parser of that name, on the vLLM backend.
    tool_format_for(tool_parser, None, info.vllm_tool_parsers, info.vllm_forcing_refusals)
    reasoning = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    # Paused generations are limited by memory: by default as many context tokens as the engine's KV
    # pools hold; releases go to the one keeping the least KV (backend.paused_kv_tokens).
    policy = settings.conversations
    if policy.max_paused_tokens is None:
        policy = replace(policy, max_paused_tokens=info.kv_capacity_tokens)
    metrics = ServerMetrics(model_name)
    conversations = ConversationStore(policy, engine_release(backend, metrics), kept_tokens=backend.paused_kv_tokens,
                                      tenants=settings.all_tenants)
    admission = Admission(backend, settings.max_concurrent_requests)
    mcp_tools = None
    if settings.mcp.servers:
        from .mcp_tools import McpTools  # the MCP SDK takes most of a second to import: only when configured

        mcp_tools = McpTools(settings.mcp)
        tool_lookup = mcp_tools.before(tool_lookup)
    # The event loop tokenizes and renders while the engine thread detokenizes: separate instances, so
    # the two threads never share a tokenizer's mutable state.
    tokenizer = AutoTokenizer.from_pretrained(info.model)
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template
    # Its call form and marker tokens.
    tool_format = tool_format_for(tool_parser, tokenizer, info.vllm_tool_parsers, info.vllm_forcing_refusals)
    renderer = ChatRenderer(tokenizer, info.eos_token_ids, tool_format) if tokenizer.chat_template else None
    defaults = sampling_defaults(info.model, settings.generation_config, settings.override_generation_config)
    turns = Turns(EngineTurns(backend, metrics), conversations, metrics, admission, renderer,
                  info.max_model_len, info.vocab_size, info.guided_decoding, reasoning, defaults,
                  tenant_cache_salt=not settings.shared_prefix_cache)
    common = dict(turns=turns, model_name=model_name,
                  model_aliases={model_name, info.model, info.model_name, *settings.more_model_names},
                  tokenizer=tokenizer, eos_token_ids=info.eos_token_ids)
    completions = CompletionServing(**common)
    conversations_api = ConversationsServing(conversations)
    chat = chat_server_tools = responses = messages = sessions = None
    if renderer is not None:
        chat = ChatServing(**common)
        chat_server_tools = ChatServerTools(chat, tool_lookup)
        responses = ResponsesServing(**common)
        responses.mcp = ResponsesMcp(settings.mcp, mcp_tools)
        responses.background = BackgroundResponses(policy.max_stored_responses)
        responses.conversations_api = conversations_api
        messages = MessagesServing(**common)
        sessions = SessionServing(tool_lookup=tool_lookup, backend=backend, **common)
    tokenize = TokenizeServing(chat=chat, **common)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        backend.start()
        if mcp_tools is not None:
            await mcp_tools.start()  # each server at most --mcp-timeout; one that fails is logged, not fatal
        tasks = [asyncio.create_task(conversations.reap()), asyncio.create_task(_watch(backend, app, on_engine_failure))]
        if shutting_down is not None:
            tasks.append(asyncio.create_task(_end_turns_after_grace(backend, shutting_down)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if responses is not None:
                await responses.background.stop()  # (each one's turn closed before the paused are released)
            conversations.release_all("shutdown", "server shutdown")
            if responses is not None:
                await responses.mcp.stop()  # the request-named MCP servers' connections
            if mcp_tools is not None:
                await mcp_tools.stop()
            await asyncio.to_thread(backend.shutdown)

    def holds(kind: Kind, id: str) -> bool:
        """Whether any tenant's conversation (kind, id) is here, a background response kept here included
        (what other replicas ask: server/replica_forwarding.py)."""
        return conversations.holds(kind, id) or (kind is Kind.RESPONSE and responses is not None
                                                 and responses.background.holds(id))

    app = FastAPI(title="InferCept", version="0.1.0", lifespan=lifespan)
    app.state.backend = backend
    app.state.engine_failed = False
    app.state.settings = settings
    app.state.mcp_tools = mcp_tools
    app.state.model_name = model_name
    app.state.model_names = (model_name, *settings.more_model_names)  # /v1/models lists each
    app.state.conversations = conversations
    app.state.holds = holds
    app.state.turns = turns
    app.state.metrics = metrics
    app.state.chat = chat or _NoChat()
    app.state.chat_server_tools = chat_server_tools or _NoChat()
    app.state.completions = completions
    app.state.responses = responses or _NoChat()
    app.state.conversations_api = conversations_api
    app.state.messages = messages or _NoChat()
    app.state.sessions = sessions or _NoChat()
    app.state.tokenize = tokenize
    app.include_router(router)
    _add_error_handlers(app)
    app.add_middleware(_Gate, settings=settings)
    return app


async def _watch(backend: EngineBackend, app: FastAPI, on_failure: Callable[[], None] | None) -> None:
    """Notice, within a second, an engine that failed for good."""
    while not backend.failed:
        await asyncio.sleep(1.0)
    logger.critical("the engine failed; the server can serve nothing more")
    app.state.engine_failed = True
    if on_failure is not None:
        on_failure()


async def _end_turns_after_grace(backend: EngineBackend, shutting_down: Callable[[], bool]) -> None:
    """Past the grace period after the server stopped accepting, end the turns still generating: each
    ends through its front end's error path (an error event and [DONE], or a 503), never as a cut
    connection; paused generations are released by the lifespan's shutdown after that."""
    while not shutting_down():
        await asyncio.sleep(0.25)
    await asyncio.sleep(SHUTDOWN_GRACE_S)
    logger.info("shutdown grace period over: ending the turns still generating")
    backend.cancel_in_flight("the server is shutting down")


class _NoChat:
    """Stands in for every chat-based serving object (chat, Responses, Messages, sessions) of a model
    without a chat template: each of their endpoints answers 400."""

    def __getattr__(self, _name: str):
        async def refuse(*_):
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        return refuse


# -- errors -----------------------------------------------------------------------------------------

def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: " + str(first.get("ctx", {}).get("error", "")), None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {loc[-1] if loc else '?'}", param
    if first.get("type") == "missing" and not loc:
        return "the request body is missing or is not a JSON object", None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param


ANTHROPIC_PREFIX = "/v1/messages"  # the paths of Anthropic's API: its clients read its error JSON


def error_body(path: str, error: APIError) -> dict:
    """The error JSON the client of `path` reads: Anthropic's on its API's paths, OpenAI's elsewhere."""
    return anthropic_error_body(error) if path.startswith(ANTHROPIC_PREFIX) else error.body()


def _add_error_handlers(app: FastAPI) -> None:
    def answer(request, error: APIError, headers=None) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return answer(request, exc, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return answer(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return answer(request, APIError(exc.status_code, str(exc.detail)), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        logger.exception("unhandled error")
        return answer(request, APIError(500, f"internal error: {type(exc).__name__}"))


# -- middleware -------------------------------------------------------------------------------------

# Root paths that take the API key as /v1 does. vLLM leaves its tokenizer routes open; here they render
# conversations with the paused turns of the key's tenant, so they are the tenant's like the rest.
KEYED_ROOT_PATHS = ("/tokenize", "/detokenize")


class _Gate:
    """Pure ASGI (it must not buffer SSE streams or hide client disconnects): authentication on /v1 and
    the tokenizer routes (a bearer key, or Anthropic's `x-api-key` header), the body-size limit (413), and
    one access-log line per request with its request id."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.settings = settings
        self.auth = Authenticator(settings.all_tenants)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path = scope.get("path", "")
        request_id = headers.get("x-request-id", "-")
        status = 500

        async def send_logged(message):
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                ids = [v.decode("latin-1") for k, v in message.get("headers", ()) if k.lower() == b"x-request-id"]
                if ids:
                    request_id = ids[0]
                else:  # errors and plain routes get one too, so a client can quote it
                    request_id = request_id if request_id != "-" else f"req-{uuid.uuid4().hex[:16]}"
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            error = self._check(scope, path, headers)
            if error is not None:
                return await _send_error(send_logged, error, error_body(path, error))
            await self.app(scope, receive, send_logged)
        finally:
            logger.info("%s %s %d %.0fms request_id=%s", scope.get("method"), path, status,
                        (time.monotonic() - started) * 1000, request_id)

    def _check(self, scope, path: str, headers: dict[str, str]) -> APIError | None:
        if self.auth.enabled and (path.startswith("/v1") or path in KEYED_ROOT_PATHS):
            auth = headers.get("authorization", "")
            tenant = self.auth.tenant_for(auth, headers.get("x-api-key"))
            if tenant is None:
                given = auth or "x-api-key" in headers
                return APIError(401, "Incorrect API key provided." if given else "Missing bearer authentication "
                                "in header: you need to provide an API key (Authorization: Bearer KEY, or "
                                "x-api-key: KEY).", code="invalid_api_key")
            scope.setdefault("state", {})[TENANT] = tenant.name  # the request's owner (tenants.owner_of)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "invalid Content-Length header")
            if int(length) > self.settings.max_body_bytes:
                return APIError(413, f"the request body exceeds {self.settings.max_body_bytes} bytes",
                                code="request_too_large")
        return None


async def _send_error(send, error: APIError, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
