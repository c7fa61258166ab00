"""An explicit server session across a tool loop.

Implicit resume already continues a paused generation when the whole conversation is sent back. A
named session (`session_id` in the body) lets the client send only what is new: after a turn that
ended in tool calls, just the tool results; the server prepends the conversation it holds. Every
step's usage is kept, including how many prompt tokens the server reused (`cached_tokens`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from infercept.integrations.openai.clients import default_model


@dataclass(frozen=True)
class StepUsage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV the server reused instead of computing
    completion_tokens: int
    finish_reason: str

    @property
    def reused_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Session:
    def __init__(self, client: openai.OpenAI, *, model: str | None = None, tools: Sequence[dict] | None = None,
                 session_id: str | None = None, **create_kwargs: Any):
        """`tools`: Chat Completions tool definitions; `create_kwargs` go to every
        `chat.completions.create` call (temperature, max_tokens, ...)."""
        self.client = client
        self.model = model or default_model()
        self.tools = list(tools) if tools else None
        self.id = session_id or f"session-{uuid.uuid4().hex}"
        self.create_kwargs = create_kwargs
        self.messages: list[dict] = []  # the whole conversation, as the server holds it
        self.steps: list[StepUsage] = []
        self._paused = False  # the last turn ended in tool calls, so the server holds the conversation

    def create(self, new_messages: Sequence[dict], **kwargs: Any):
        """One chat completion that continues the session with `new_messages`; returns the SDK's response.

        While the session is paused at tool calls and `new_messages` are the tool results, only they
        are sent; otherwise the whole conversation is."""
        new_messages = list(new_messages)
        tool_results_only = self._paused and bool(new_messages) and all(m["role"] == "tool" for m in new_messages)
        sent = new_messages if tool_results_only else self.messages + new_messages
        if self.tools is not None:
            kwargs.setdefault("tools", self.tools)
        extra_body = {**kwargs.pop("extra_body", {}), "session_id": self.id}
        response = self.client.chat.completions.create(model=self.model, messages=sent, extra_body=extra_body,
                                                       **self.create_kwargs, **kwargs)
        choice = response.choices[0]
        self.messages += new_messages + [choice.message.model_dump(exclude_none=True)]
        self._paused = choice.finish_reason == "tool_calls"
        usage = response.usage
        details = usage.prompt_tokens_details
        self.steps.append(StepUsage(usage.prompt_tokens, details.cached_tokens if details else 0,
                                    usage.completion_tokens, choice.finish_reason))
        return response

    def run(self, prompt: str | Sequence[dict], functions: dict[str, Callable[..., Any]], max_steps: int = 8) -> str:
        """A tool loop: call the model; while it calls tools, run them (`functions[name](**arguments)`,
        a result that is not a string is sent as JSON) and send the results back. Returns the final
        text. A call of an unknown function or with bad arguments is reported to the model as an
        error result, as agent frameworks do, so it can correct itself."""
        new = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        for _ in range(max_steps):
            message = self.create(new).choices[0].message
            if not message.tool_calls:
                return message.content or ""
            new = [{"role": "tool", "tool_call_id": call.id, "content": _call(functions, call.function)}
                   for call in message.tool_calls]
        raise RuntimeError(f"no final answer after {max_steps} steps")


def _call(functions: dict[str, Callable[..., Any]], function) -> str:
    if function.name not in functions:
        return f"Error: unknown tool {function.name!r}; available: {', '.join(functions)}"
    try:
        result = functions[function.name](**json.loads(function.arguments or "{}"))
    except (TypeError, ValueError) as e:  # arguments that are not JSON or do not fit the function
        return f"Error: {e}"
    return result if isinstance(result, str) else json.dumps(result)
