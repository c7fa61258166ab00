"""InferCept engine: a paged-KV, continuously batched Llama-family engine."""
from .engine import Engine
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["Engine", "LLM", "RequestOutput", "SamplingParams"]
