"""A walk through InferCept's native sessions API with plain HTTP (httpx): create a session with a tool,
post a question, answer the tool call it pauses at, look at where the paused generation's KV lives,
and delete the session.

    python examples/session_walkthrough.py [--base-url http://127.0.0.1:8000]
"""
from __future__ import annotations

import argparse
import json

import httpx

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def check(response: httpx.Response) -> dict:
    if response.is_error:
        raise SystemExit(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")
    return response.json()


def report(step: str, turn: dict) -> None:
    usage = turn["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    message = turn["message"]
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls", [])]
    print(f"{step}: {usage['prompt_tokens']} prompt tokens, {cached} reused "
          f"({100 * cached / usage['prompt_tokens']:.0f}%), {usage['completion_tokens']} generated, "
          f"session {turn['state']} -> " + (f"calls {', '.join(calls)}" if calls else repr(message["content"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-rounds", type=int, default=2, help="tool-result rounds at most")
    args = parser.parse_args()

    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=args.base_url.rstrip("/") + "/v1", headers=headers, timeout=120) as http:
        session = check(http.post("/sessions", json={"system": "You are a concise assistant.", "tools": TOOLS,
                                                     "temperature": 0, "max_tokens": args.max_tokens}))
        sid = session["id"]
        print(f"created {sid} ({session['state']})")
        turn = check(http.post(f"/sessions/{sid}/messages", json={"content": "What is the weather in Paris?"}))
        report("question", turn)
        for _ in range(args.max_rounds):
            if turn["state"] != "paused":
                break
            state = check(http.get(f"/sessions/{sid}"))
            kv = state["kv"]
            print(f"paused at {[c['name'] for c in state['pending_calls']]}; its KV: {kv['device']} tokens on "
                  f"the device, {kv['host']} on the host, {kv['discarded']} discarded")
            results = [{"tool_call_id": c["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})}
                       for c in state["pending_calls"]]
            turn = check(http.post(f"/sessions/{sid}/messages", json={"tool_results": results}))
            report("tool results", turn)
        print(f"history: {len(check(http.get(f'/sessions/{sid}'))['messages'])} messages")
        check(http.delete(f"/sessions/{sid}"))
        print(f"deleted {sid}")


if __name__ == "__main__":
    main()
