"""Our `SamplingParams` as vLLM's `SamplingParams` keyword arguments (plain data for the worker).

What vLLM cannot do the way our engine does is refused here with a ValueError (the server answers 400),
never approximated.
"""
from __future__ import annotations

from ..sampling_params import SamplingParams


def vllm_sampling_fields(params: SamplingParams, resumable: bool) -> dict:
    """`resumable`: the request may pause (a vLLM streaming-input session), which vLLM 0.32 allows only
    without stop strings: a turn there ends on EOS, a stop token or max_tokens."""
    if resumable and params.stop:
        raise ValueError("stop strings are not supported on the vLLM backend in a generation that may pause "
                         "(tools, or an intercepted turn): vLLM ends such turns only on EOS, stop tokens or max_tokens")
    return {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 = off in both
        "seed": params.seed,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        # Stop strings end a request that cannot pause in vLLM as they do here (the backend still finds
        # them itself, so the text is cut the same way); vLLM needs to detokenize only for them.
        "stop": list(params.stop),
        "detokenize": bool(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        # Grammars (forced tool calls, response_format) as vLLM's structured outputs, compiled by the
        # same library as ours (llguidance: the worker runs vLLM with its `guidance` backend), which
        # takes our Lark dialect as a `grammar`.
        "structured_outputs": None if params.guided is None else
        {"grammar": params.guided.lark} if params.guided.lark is not None else {"json": params.guided.json_schema},
    }
