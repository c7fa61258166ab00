"""LlamaIndex's FunctionAgent on its OpenAILike model against the server at argv[1] (its /v1 URL) serving
model argv[2]; run in .venv-frameworks by tests/test_llamaindex.py, which reads the JSON it prints."""
import asyncio
import json
import sys

import httpx
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.llms.openai_like import OpenAILike

url, model = sys.argv[1], sys.argv[2]
usages, cities = [], []


async def keep_usage(response: httpx.Response) -> None:
    if response.url.path.endswith("/chat/completions"):
        await response.aread()
        usages.append(response.json()["usage"])


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    cities.append(city)
    return '{"temperature": 21, "sky": "clear"}'


async def main() -> dict:
    llm = OpenAILike(model=model, api_base=url, api_key="unused", is_chat_model=True, is_function_calling_model=True,
                     context_window=2048, temperature=0, max_tokens=40, max_retries=0,
                     async_http_client=httpx.AsyncClient(event_hooks={"response": [keep_usage]}))
    agent = FunctionAgent(tools=[get_weather], llm=llm, system_prompt="You are a helpful assistant.",
                          streaming=False)
    handler = agent.run("What is the weather in Paris?", max_iterations=2, early_stopping_method="generate")
    results = [e.tool_name async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
    answer = await handler
    return {"answer": str(answer), "tool_results": results, "cities": cities, "usages": usages}


print(json.dumps(asyncio.run(main())))
