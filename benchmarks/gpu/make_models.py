"""A random-weight model of a given shape, from the embedded model's config and tokenizer (`pack.py`'s
`model/`): the GPU host cannot download weights, and the 64 MiB that travels there holds no real ones.
Speed depends on the shape, not the values; tests that compare two paths of the engine (CUDA against
CPU, a captured graph against eager) need no real weights either.

Shapes: `embedded` (SmolLM2-135M's own; written by default to the default model path, where the tests'
`default_model_dir` fixture and `ensure_default_model` find it), `llama3-8b` (Llama-3-8B's layers,
heads and MLP with the embedded tokenizer's vocabulary: 7.38 B parameters, 14.8 GB in bf16) and `tiny`
(two layers, for the dry run and the tests). Weights are drawn on the device (quick on a GPU; writing
the 15 GB is what takes the time) in bf16, one shard at a time, and written with safetensors beside an
index, as `save_pretrained` lays a sharded checkpoint out.

    python3 benchmarks/gpu/make_models.py --src .gpu-check/model --shape embedded
    python3 benchmarks/gpu/make_models.py --src .gpu-check/model --shape llama3-8b --dst /tmp/llama3-8b
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

SHAPES = {
    "embedded": {},
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192,
                      rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=8192,
                 rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
}
# Standard deviation of the weights. The embedded shape's tests compare greedy tokens of two paths, so its
# logits are spread wider (0.1: no near-ties for rounding to flip); 0.02 is Llama's initializer range.
STD = {"embedded": 0.1, "llama3-8b": 0.02, "tiny": 0.02}
SHARD_BYTES = 4 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def parameter_shapes(config) -> dict[str, torch.Size]:
    """Checkpoint tensor names and shapes of transformers' Llama for `config` (built on the meta device:
    no memory, no time). Tied embeddings appear once, as transformers saves them."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: p.shape for name, p in model.named_parameters()}


def make_model(src: str | Path, dst: str | Path, shape: str, device: str | torch.device = "cpu",
               std: float | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write the model folder; returns {"path", "parameters", "bytes", "seconds"}."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(SHAPES[shape])
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    config = LlamaConfig.from_dict(cfg)
    std = STD[shape] if std is None else std
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config.save_pretrained(dst)
    for f in src.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(f, dst / f.name)

    # Group the tensors into shards first (the file names say how many), then draw and write one shard at
    # a time: host memory holds one shard, not the model.
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups, group, group_bytes = [], [], 0
    for name, size in parameter_shapes(config).items():
        group.append((name, size))
        group_bytes += size.numel() * itemsize
        if group_bytes >= SHARD_BYTES:
            groups.append(group)
            group, group_bytes = [], 0
    if group:
        groups.append(group)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, total, numel = {}, 0, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        tensors = {}
        for name, size in group:
            t = torch.empty(size, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)  # RMSNorm scales start at one, as transformers initializes them
            else:
                t.normal_(0.0, std, generator=gen)
            tensors[name] = t.cpu()
            total, numel = total + t.numel() * itemsize, numel + t.numel()
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if len(groups) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"path": str(dst), "shape": shape, "parameters": numel, "bytes": total,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="config + tokenizer folder (.gpu-check/model)")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dst", default=None, help="model folder to write (default: the default model path)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the weights are drawn (default: cuda where there is one)")
    ap.add_argument("--std", type=float, default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.dst is None:
        from infercept.engine.download import default_model_dir
        args.dst = default_model_dir()
    info = make_model(args.src, args.dst, args.shape, args.device, args.std)
    print(f"{info['path']}: {args.shape}, {info['parameters'] / 1e9:.3f} B parameters, "
          f"{info['bytes'] / 1e9:.2f} GB, {info['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
