"""`ScriptedBackend`: an `EngineBackend` that answers from a script instead of a model, so server tests
run the real HTTP stack over the boundary alone (tests/test_backend_boundary.py says what it proves)."""
from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from infercept.engine.backend import EngineBackend, EngineInfo, EngineSnapshot, KVLocation, RequestOutput, ToolCall

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ScriptedBackend(EngineBackend):
    """Answers by what the prompt asks: "weather" -> a tool call that pauses; "bad" -> ValueError;
    "crash" -> one token, then the engine fails; anything else -> "Hello there." Resumes answer
    "It is sunny." and report the paused context as cached."""

    def __init__(self, model_dir: str):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.info = EngineInfo(model=model_dir, model_type="llama", max_model_len=2048,
                               vocab_size=len(self.tokenizer), eos_token_ids=frozenset({eos}),
                               chat_template=self.tokenizer.chat_template, dtype="bfloat16", device="fake",
                               kv_capacity_tokens=100_000)
        self.running = False
        self.dead = False
        self.paused: dict[str, int] = {}  # request id -> context tokens
        self.calls: list[tuple] = []
        self.params: list = []  # the SamplingParams of each generate, in order
        self.scrapes = 0

    @property
    def is_running(self) -> bool:
        return self.running and not self.dead

    @property
    def failed(self) -> bool:
        return self.dead

    def start(self) -> None:
        self.running = True

    def shutdown(self) -> None:
        self.running = False

    def _out(self, request_id, prompt, text, *, finished=False, paused=False, cached=0, tool_calls=(), content=None):
        return RequestOutput(request_id, list(prompt), self.tokenizer.encode(text, add_special_tokens=False), text,
                             finished, "stop" if finished else None, num_cached_tokens=cached, paused=paused,
                             tool_calls=list(tool_calls), content=content)

    async def generate(self, prompt, params, request_id, intercept=None):
        self.calls.append(("generate", request_id))
        self.params.append(params)
        asked = self.tokenizer.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        if "bad" in asked:
            raise ValueError("the scripted engine refuses this prompt")
        if "crash" in asked:
            yield self._out(request_id, prompt, "Hel")
            raise RuntimeError("the scripted engine failed mid-step")
        if "weather" in asked and intercept is not None:
            out = self._out(request_id, prompt, CALL, paused=True, content="",
                            tool_calls=[ToolCall("get_weather", '{"city": "Rome"}', CALL)])
            self.paused[request_id] = len(prompt) + len(out.token_ids)
            yield out
            return
        yield self._out(request_id, prompt, "Hello", cached=0)
        yield self._out(request_id, prompt, "Hello there.", finished=True)

    async def resume(self, request_id, appended, params=None, intercept=None):
        self.calls.append(("resume", request_id))
        if request_id not in self.paused:
            raise KeyError(request_id)
        context = self.paused.pop(request_id)
        yield self._out(request_id, [0] * (context + len(appended)), "It is sunny.", finished=True, cached=context)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        self.paused.pop(request_id, None)

    def cancel_in_flight(self, reason):
        self.calls.append(("cancel_in_flight", reason))

    async def kv_location(self, request_id):
        if request_id not in self.paused:
            raise KeyError(request_id)
        return KVLocation(device=self.paused[request_id])

    async def snapshot(self):
        """One scrape late: the numbers of the previous scrape."""
        await asyncio.sleep(0)
        self.scrapes += 1
        return EngineSnapshot(num_steps=self.scrapes - 1, paused_by_state={"device": len(self.paused)})

    def paused_kv_tokens(self, request_id):
        return self.paused.get(request_id, 0)
