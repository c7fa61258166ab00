"""A thin shim over the official OpenAI SDK for InferCept: clients pointed at the server, and a
`Session` that carries an explicit server session across a tool loop.

    from infercept.integrations.openai import Session, client
    session = Session(client(), tools=[...])
    answer = session.run("What is 24*9/5+32?", {"calculator": calculator})
    for step in session.steps:
        print(step.cached_tokens, "of", step.prompt_tokens, "prompt tokens reused")
"""
from infercept.integrations.openai.clients import (DEFAULT_BASE_URL, DEFAULT_MODEL, async_client, client,
                                                   default_base_url, default_model)
from infercept.integrations.openai.session import Session, StepUsage

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_MODEL", "Session", "StepUsage", "async_client", "client", "default_base_url",
           "default_model"]
