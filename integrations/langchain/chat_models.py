"""`ChatInferCept`: langchain-openai's Chat Completions model pointed at an InferCept server.

Tool calling (`bind_tools`, `tool_choice`), streaming with tool-call chunks, usage metadata (the
server's `prompt_tokens_details.cached_tokens` arrives as `input_token_details["cache_read"]`,
langchain-openai maps it) and structured output come from `BaseChatOpenAI` unchanged. What is added:
defaults that reach the local server, streamed usage on by default (the server sends it), structured
output by the server's `response_format` json_schema by default (as `ChatOpenAI` does; the server
enforces the schema with a grammar), the session hint: inside LangGraph, the run's
`configurable.thread_id` is sent as `session_id`, so each thread's paused generation is continued by
name, and a thinking model's `reasoning_content` (server flag --reasoning-parser) in the message's
`additional_kwargs`, streamed or not. It is not sent back: the server's paused generation keeps the
thinking as its tokens.

With `use_responses_api=True` the model speaks the server's Responses API instead, where OpenAI's remote
MCP tool (`{"type": "mcp", ...}`, bound as a provider tool) is run by the server itself
(examples/langchain_mcp_agent.py); a chain there continues by `use_previous_response_id`, not by session.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import ensure_config
from langchain_core.utils import from_env, secret_from_env
from langchain_openai.chat_models.base import BaseChatOpenAI
from pydantic import Field, SecretStr

from infercept.integrations.openai.clients import DEFAULT_BASE_URL, DEFAULT_MODEL, NO_API_KEY

# What the server accepts as a session id.
SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def session_id_for_thread(thread_id: str) -> str:
    """The thread_id itself when the server accepts it as a session id; otherwise a stable digest of it
    (LangGraph allows any string, e.g. "user 42 / chat 7")."""
    if SESSION_ID.fullmatch(thread_id):
        return thread_id
    return "thread-" + hashlib.sha256(thread_id.encode()).hexdigest()[:32]


class ChatInferCept(BaseChatOpenAI):
    model_name: str = Field(default_factory=from_env("INFERCEPT_MODEL", default=DEFAULT_MODEL), alias="model")
    openai_api_base: str | None = Field(default_factory=from_env("INFERCEPT_BASE_URL", default=DEFAULT_BASE_URL),
                                        alias="base_url")
    openai_api_key: SecretStr | None = Field(
        default_factory=secret_from_env("INFERCEPT_API_KEY", default=NO_API_KEY), alias="api_key")
    # The server reports usage in the last chunk of a stream (stream_options.include_usage).
    stream_usage: bool | None = True
    # Send the LangGraph thread_id as the server's session_id.
    use_thread_sessions: bool = True

    @property
    def _llm_type(self) -> str:
        return "infercept-chat"

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"openai_api_key": "INFERCEPT_API_KEY"}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "infercept"
        return params

    def with_structured_output(self, schema=None, *,
                               method: Literal["function_calling", "json_mode", "json_schema"] = "json_schema",
                               **kwargs: Any) -> Runnable:
        """`BaseChatOpenAI.with_structured_output`, by default with the server's native JSON schema
        output rather than a forced tool call: no tool prompt in the way, and the same guarantee."""
        return super().with_structured_output(schema, method=method, **kwargs)

    def _create_chat_result(self, response, generation_info: dict | None = None):
        result = super()._create_chat_result(response, generation_info)
        body = response.model_dump() if hasattr(response, "model_dump") else response
        for generation, choice in zip(result.generations, (body or {}).get("choices") or []):
            reasoning = (choice.get("message") or {}).get("reasoning_content")
            if reasoning is not None:
                generation.message.additional_kwargs["reasoning_content"] = reasoning
        return result

    def _convert_chunk_to_generation_chunk(self, chunk: dict, default_chunk_class: type,
                                           base_generation_info: dict | None):
        generation = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        choices = chunk.get("choices") or []
        reasoning = (choices[0].get("delta") or {}).get("reasoning_content") if choices else None
        if generation is not None and reasoning:  # (chunks add up: their additional_kwargs strings concatenate)
            generation.message.additional_kwargs["reasoning_content"] = reasoning
        return generation

    def _get_request_payload(self, input_: LanguageModelInput, *, stop: list[str] | None = None,
                             **kwargs: Any) -> dict:
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        if "messages" not in payload:
            return payload  # the Responses API (use_responses_api): a chain continues by previous_response_id
        session_id = self._thread_session_id()
        if session_id is not None and "session_id" not in payload.get("extra_body", {}):
            payload["extra_body"] = {**payload.get("extra_body", {}), "session_id": session_id}
        return payload

    def _thread_session_id(self) -> str | None:
        """The thread_id of the LangGraph run this call belongs to, if any.

        LangGraph sets the running node's config as the context's runnable config, and the payload is
        built inside that context (sync, async, and thread pools copy it), so it is read from there
        rather than threaded through every LangChain entry point."""
        if not self.use_thread_sessions:
            return None
        thread_id = ensure_config().get("configurable", {}).get("thread_id")
        return None if thread_id is None else session_id_for_thread(str(thread_id))
