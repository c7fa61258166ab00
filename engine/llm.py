"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from tqdm import tqdm

from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = Engine(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; returns one finished output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if not isinstance(params, list):
            params = [params] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return self.generate([list(ids)], params)[0]
