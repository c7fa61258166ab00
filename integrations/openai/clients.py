"""OpenAI SDK clients pointed at an InferCept server; the defaults come from the environment.

INFERCEPT_BASE_URL (default http://127.0.0.1:8000/v1, where `make serve` listens), INFERCEPT_API_KEY
(the server's --api-key; the SDK insists on some key, so "unused" when the server has none) and
INFERCEPT_MODEL (default: the name `make serve` gives the embedded model).
"""
from __future__ import annotations

import os

import openai

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_MODEL = "SmolLM2-135M-Instruct-bf16"
NO_API_KEY = "unused"


def default_base_url() -> str:
    return os.environ.get("INFERCEPT_BASE_URL", DEFAULT_BASE_URL)


def default_api_key() -> str:
    return os.environ.get("INFERCEPT_API_KEY", NO_API_KEY)


def default_model() -> str:
    return os.environ.get("INFERCEPT_MODEL", DEFAULT_MODEL)


def client(base_url: str | None = None, api_key: str | None = None, **kwargs) -> openai.OpenAI:
    """`openai.OpenAI` for the server; other keyword arguments go to the SDK unchanged."""
    return openai.OpenAI(base_url=base_url or default_base_url(), api_key=api_key or default_api_key(), **kwargs)


def async_client(base_url: str | None = None, api_key: str | None = None, **kwargs) -> openai.AsyncOpenAI:
    """`openai.AsyncOpenAI` for the server; other keyword arguments go to the SDK unchanged."""
    return openai.AsyncOpenAI(base_url=base_url or default_base_url(), api_key=api_key or default_api_key(),
                              **kwargs)
