"""Where `--model` finds a model: the embedded default, a local folder, or a Hugging Face Hub repo id
resolved through `huggingface_hub` (here from its cache, offline: this machine cannot reach the Hub)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infercept.engine.backend import EngineInfo
from infercept.server import cli
from infercept.engine.download import resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, model_dir: str) -> Path:
    """`model_dir`'s files laid out as huggingface_hub caches a download of `repo_id` at `REVISION`."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def infercept(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infercept.server.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_hub_repo_id_is_served_from_the_hugging_face_cache_as_its_folder_would_be(default_model_dir, tmp_path):
    snapshot = hub_cache(tmp_path / "hub", "infercept-tests/smollm2", default_model_dir)
    env = offline_env(tmp_path / "hub")
    found = infercept("download", "--model", "infercept-tests/smollm2", env=env)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(snapshot)
    generate = ["generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--temperature", "0"]
    by_id = infercept(*generate, "--model", "infercept-tests/smollm2", env=env)
    by_folder = infercept(*generate, "--model", default_model_dir, env=env)
    assert by_id.returncode == 0 == by_folder.returncode, by_id.stderr + by_folder.stderr
    assert by_id.stdout == by_folder.stdout and by_id.stdout.strip()


def test_a_model_found_nowhere_is_a_clear_error(tmp_path):
    env = offline_env(tmp_path / "empty-hub")
    missing = infercept("download", "--model", "infercept-tests/absent", env=env)
    assert missing.returncode == 2
    assert "'infercept-tests/absent': no local folder, not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stderr and "Traceback" not in missing.stderr
    # A path is not looked up on the Hub: it is a folder or the loader's error.
    folder = str(tmp_path / "no" / "such" / "folder")
    assert resolve_model(folder) == folder and resolve_model("./relative-model") == "./relative-model"
    for args, says in ((["download"], f"{folder!r}: no such folder"),
                       (["generate", "--prompt", "Hi"], f"{folder!r} is not a model folder")):
        refused = infercept(*args, "--model", folder, env=env)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr


def test_revision_picks_the_snapshot_and_applies_to_repo_ids_only(default_model_dir, tmp_path, capsys):
    """--revision: a commit or a branch the cache knows resolves to its own snapshot (offline, as cached),
    one it does not know is named in the error; with the embedded model or a folder it is refused."""
    hub_cache(tmp_path / "hub", "infercept-tests/smollm2", default_model_dir)
    repo = tmp_path / "hub" / "models--infercept-tests--smollm2"
    other = "fedcba9876543210fedcba9876543210fedcba98"
    (repo / "snapshots" / other).mkdir()
    for f in Path(default_model_dir).iterdir():
        (repo / "snapshots" / other / f.name).symlink_to(f)
    (repo / "refs" / "v2").write_text(other)
    env = offline_env(tmp_path / "hub")
    for revision in (other, "v2"):
        found = infercept("download", "--model", "infercept-tests/smollm2", "--revision", revision, env=env)
        assert found.returncode == 0 and found.stdout.strip() == str(repo / "snapshots" / other), found.stderr
    unknown = infercept("download", "--model", "infercept-tests/smollm2", "--revision", "v3", env=env)
    assert unknown.returncode == 2 and "at revision 'v3'" in unknown.stderr, unknown.stderr
    for args in (["download"], ["generate", "--prompt", "Hi", "--model", default_model_dir]):
        with pytest.raises(SystemExit) as refused:
            cli.main([*args, "--revision", "v2"])
        assert refused.value.code == 2 and "applies to a Hugging Face Hub repo id" in capsys.readouterr().err


def test_the_served_name_of_a_hub_snapshot_is_its_repo_id(tmp_path):
    def name(model: str) -> str:
        return EngineInfo(model, "llama", 2048, 100, frozenset({0}), None, "bfloat16", "cpu", 1024).model_name

    assert name(f"/cache/hub/models--Qwen--Qwen2.5-7B-Instruct/snapshots/{REVISION}") == "Qwen/Qwen2.5-7B-Instruct"
    assert name(f"/cache/hub/models--gpt2/snapshots/{REVISION}/") == "gpt2"
    assert name("/models/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"
    assert name(f"/data/snapshots/{REVISION}") == REVISION  # not a Hub cache: the folder's name
