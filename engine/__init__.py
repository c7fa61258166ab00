"""InferCept engine: a paged-KV, continuously batched Llama-family engine."""
from .async_engine import AsyncEngine
from .engine import Engine
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "LLM", "RequestOutput", "SamplingParams"]
