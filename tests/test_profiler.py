"""The start-up profile cache: a cached profile is reused unless it was measured on a busy machine."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from transformers import LlamaConfig

from infercept.engine import LLM
from infercept.engine.policy import Profile
from infercept.engine.profiler import SPOT_CHECK_TOKENS, cached_profile_path, load_or_measure


def scaled(profile: Profile, factor: float) -> Profile:
    return dataclasses.replace(profile, t_fwd_samples=tuple((n, t * factor) for n, t in profile.t_fwd_samples))


def test_a_cached_profile_too_slow_for_this_machine_is_measured_again(tmp_path, monkeypatch, default_model_dir):
    from test_architectures import TINY, build_tiny_model
    monkeypatch.setenv("INFERCEPT_CACHE", str(tmp_path / "cache"))
    build_tiny_model(LlamaConfig(**TINY), tmp_path / "model", default_model_dir)
    engine = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_gb=0.05, progress=False).engine
    path = cached_profile_path(str(tmp_path / "model"), engine.kv_cache.device_kv.device,
                               engine.kv_cache.device_kv.dtype, engine.runner.kernels)
    measured = Profile.load(path)  # the first start measured and cached it
    assert engine.profile == measured

    def load() -> Profile:
        return load_or_measure(str(tmp_path / "model"), engine.runner, engine.kv_cache,
                               engine.profile.bytes_per_token, progress=False)

    # Measured while the cores were shared: 100x slow. Replaced by a fresh measurement, on disk too.
    scaled(measured, 100).save(path)
    again = load()
    assert again.t_fwd(SPOT_CHECK_TOKENS) < 10 * measured.t_fwd(SPOT_CHECK_TOKENS)
    assert json.loads(Path(path).read_text()) == again.to_dict()

    # Faster than a pass now: the machine may be the busy one, so the cached profile is kept.
    fast = scaled(measured, 0.01)
    fast.save(path)
    assert load() == fast
