"""The sampling a request gets for the fields it leaves out.

By default the model's own: the sampling fields of `generation_config.json` in its folder, where its
authors put the settings they recommend (Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama 3:
temperature 0.6, top_p 0.9). Agents rarely send these (Claude Code sends no temperature), and a
thinking model sampled at temperature 1 or greedily loops more often. `--generation-config none` gives
the neutral defaults instead (temperature 1, no truncation, no penalties), a folder reads another
`generation_config.json`, and `--override-generation-config` sets fields over either (`{"temperature": 0}`:
greedy unless asked). The flags and the field names are vLLM's (its `vllm` source is our `none`), so an
operator's settings carry over; both backends get them, as the server applies them.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from infercept.engine.backend import SamplingParams

logger = logging.getLogger("infercept.server")

# generation_config.json's sampling fields -> the request's (vLLM reads the same ones).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def check_source(source: str) -> None:
    """ValueError unless `source` is auto, none or a folder holding generation_config.json."""
    if source not in ("auto", "none") and not os.path.isfile(os.path.join(source, "generation_config.json")):
        raise ValueError(f"--generation-config {source!r}: expected auto, none or a folder holding "
                         "generation_config.json")


def check_overrides(overrides: Mapping) -> None:
    """ValueError for a field that is not a sampling field, or a value no request could give."""
    for key in overrides:
        if key not in FIELDS:
            raise ValueError(f"--override-generation-config: {key!r} is not one of {', '.join(FIELDS)}")
    _check({FIELDS[k]: v for k, v in overrides.items()}, "--override-generation-config")


def _check(fields: Mapping, where: str) -> None:
    """The engine's own checks of these values (top_k -1 is "off", as vLLM reads it)."""
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int if key in ("top_k", "max_tokens") else (int, float)):
            raise ValueError(f"{where}: {key} must be {'an integer' if key in ('top_k', 'max_tokens') else 'a number'}, "
                             f"not {value!r}")
    if "top_k" in fields and fields["top_k"] == -1:
        fields = {**fields, "top_k": 0}
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def sampling_defaults(model_dir: str, source: str = "auto", overrides: Mapping | None = None) -> dict:
    """The defaults by the request's field names (`Sampling`'s); a field left out keeps its neutral value."""
    fields: dict = {}
    folder = model_dir if source == "auto" else None if source == "none" else source
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path and os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
        # The fields that differ from transformers' defaults, as vLLM reads them: a tool that saves every
        # field writes top_k 50 or temperature 1.0 without anyone having chosen them.
        fields = {FIELDS[k]: v for k, v in config.items()
                  if k in FIELDS and v is not None and TRANSFORMERS_DEFAULTS.get(k) != v}
        _check(fields, f"{path} (--generation-config none leaves it unread)")
    fields |= {FIELDS[k]: v for k, v in (overrides or {}).items()}
    if fields:
        logger.info("sampling defaults for the fields a request leaves out: %s (--generation-config %s%s)",
                    ", ".join(f"{k} {v}" for k, v in sorted(fields.items())), source,
                    ", with --override-generation-config" if overrides else "")
    return fields
