"""Our `SamplingParams` as vLLM's `SamplingParams` keyword arguments (plain data for the worker).

What vLLM cannot do the way our engine does is refused here with a ValueError (the server answers 400),
never approximated.
"""
from __future__ import annotations

from ..output_stage import TurnRule
from ..sampling_params import GuidedDecodingParams, SamplingParams

# The key of `TurnRule` in vLLM's `SamplingParams.extra_args`, where our scheduler reads it.
TURN_RULE_KEY = "infercept_turn"


def vllm_sampling_fields(params: SamplingParams, resumable: bool, rule: TurnRule | None = None) -> dict:
    """`resumable`: the request is a vLLM streaming-input session (it may pause). vLLM's own stop strings
    would end the whole session, so a session's turn carries its `rule` (stop strings, and tool calls the
    model has moved past) to our scheduler instead, which ends the turn at that token and keeps the
    session (`InterceptScheduler._update_request_with_output`)."""
    rule = rule if rule is not None and not rule.empty else None
    stop = [] if resumable else list(params.stop)
    return {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 = off in both
        # vLLM's own fields, which engine/sampler.py follows: the same definitions, in the same order.
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": dict(params.logit_bias) if params.logit_bias else None,  # int token ids (pickled, not JSON)
        "seed": params.seed,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "thinking_token_budget": params.thinking_token_budget,
        # Stop strings end a request that cannot pause in vLLM as they do here (the backend still finds
        # them itself, so the text is cut the same way); vLLM needs to detokenize only for them.
        "stop": stop,
        "detokenize": bool(stop),
        "extra_args": {TURN_RULE_KEY: rule.as_dict()} if resumable and rule is not None else None,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        # (vLLM computes such a prompt whole too: its prefix cache is not read for it)
        "prompt_logprobs": params.prompt_logprobs,
        # vLLM's own: the same definitions (engine/bad_words.py tokenizes the words as vLLM does)
        "allowed_token_ids": None if params.allowed_token_ids is None else list(params.allowed_token_ids),
        "bad_words": list(params.bad_words) or None,
        "skip_special_tokens": params.skip_special_tokens,
        # Grammars (forced tool calls, response_format, regex and choice) as vLLM's structured outputs,
        # compiled by the same library as ours (llguidance: the worker runs vLLM with its `guidance`
        # backend), which takes our Lark dialect as a `grammar`.
        "structured_outputs": None if params.guided is None else structured_outputs(params.guided),
    }


def structured_outputs(guided: GuidedDecodingParams) -> dict:
    """vLLM's `StructuredOutputsParams` keyword arguments for our grammar (each kind has its own key)."""
    if guided.lark is not None:
        return {"grammar": guided.lark}
    if guided.regex is not None:
        return {"regex": guided.regex}
    if guided.choice is not None:
        return {"choice": list(guided.choice)}
    return {"json": guided.json_schema}
