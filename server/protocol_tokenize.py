"""Wire shapes of vLLM's `POST /tokenize` and `POST /detokenize`, as vLLM 0.32 names their fields.

vLLM has two tokenize bodies, a text prompt or chat messages; here they are one object that takes
exactly one of the two, so a body with neither (or both) gets one plain 400 instead of an error per
shape. `add_special_tokens` keeps vLLM's defaults: on for a text prompt (as /v1/completions encodes it),
off for messages (the chat template writes the model's special tokens itself).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from .protocol import ChatMessageParam, Strict, ToolParam, check_opening


class TokenizeRequest(Strict):
    model: str | None = None  # vLLM's: optional, the served model when left out
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[ToolParam] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a chat conversation)")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise ValueError("tools and chat_template_kwargs render chat messages: send messages, not prompt")
        check_opening(self.add_generation_prompt, self.continue_final_message)
        return self


class TokenizeResponse(Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(Strict):
    prompt: str
