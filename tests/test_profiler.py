"""The start-up profile: its cache (a cached profile is reused unless it was measured on a busy machine) and the copy-overlap measurement."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
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
    engine = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_gb=0.05, host_kv_gb=0.05, progress=False).engine
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


def test_copy_overlap_is_a_share_and_needs_room_to_keep_copies_apart(engine):
    """The measurement a GPU profile takes at start-up (`_copy_overlap`), run here on the CPU where it is
    not needed (copies are synchronous): a share in [0, 1], and None where the pools cannot hold the
    pass's blocks and the copied ones apart. What it means for the policy: `Profile.copies_overlap`."""
    from infercept.engine.profiler import _copy_overlap

    kv = engine.kv_cache
    before = kv.device_kv.clone()
    overlap = _copy_overlap(engine.runner, kv, num_tokens=16, num_blocks=2, repeats=1)
    assert 0.0 <= overlap <= 1.0
    assert _copy_overlap(engine.runner, kv, num_tokens=16, num_blocks=kv.num_host_blocks + 1) is None
    assert _copy_overlap(engine.runner, kv, num_tokens=kv.num_blocks * kv.block_size, num_blocks=1) is None
    kv.device_kv.copy_(before)  # the shared engine's prefix-cached blocks as they were


def test_measured_copy_overlap_decides_whether_copies_overlap():
    from infercept.engine.policy.profile import h100_llama3_8b

    gpu = h100_llama3_8b()
    assert gpu.copy_overlap is None and gpu.copies_overlap  # unmeasured: by the device
    assert not dataclasses.replace(gpu, copy_overlap=0.2).copies_overlap
    assert dataclasses.replace(gpu, copy_overlap=0.9).copies_overlap
    assert Profile.from_json(dataclasses.replace(gpu, copy_overlap=0.9).to_json()).copy_overlap == 0.9
    with pytest.raises(ValueError, match="copy_overlap"):
        dataclasses.replace(gpu, copy_overlap=1.5)


def test_attention_costs_recover_the_profiles_attention_model(engine, monkeypatch):
    """`_attention_costs` times decodes over long and one-block contexts and a prefill chunk after a long
    context and from position 0. Against passes that cost exactly what `Profile.t_attention` models
    (on a virtual clock that each pass advances), it gives back the model's two constants; with a pool of
    too few blocks a sequence, none."""
    from infercept.engine import profiler

    read, pair = 3e-7, 5e-9  # a decode reads its context (q * pair < read at q = 1); a 128-token chunk computes
    model = dataclasses.replace(engine.profile, attention_read_s_per_token=read, attention_pair_s=pair)
    clock = [0.0]

    def modeled_pass(output):
        clock[0] += 0.01 + sum(model.t_attention(len(c.token_ids), c.start_pos + len(c.token_ids))
                               for c in output.chunks)

    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine.runner, "run", modeled_pass)
    kv = engine.kv_cache
    measured = profiler._attention_costs(engine.runner, kv, max_len=8192)
    assert measured == pytest.approx((read, pair), rel=1e-6)
    assert profiler._attention_costs(engine.runner, kv, max_len=4 * kv.block_size) == (0.0, 0.0)
