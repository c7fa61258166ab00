"""Fill `.gpu-check/` (git-ignored) with what `benchmarks/gpu/run.sh` needs on a GPU host that has no
network: wheels the host's image lacks, and the embedded model's config and tokenizer without weights
(run.sh makes random-weight models from them there; a real checkpoint would not fit the 64 MiB that
travels with the checkout, and random weights are enough to time a forward pass).

Runs on the development machine (network to PyPI, the project's .venv):

    .venv/bin/python benchmarks/gpu/pack.py          # or `make gpu-pack`

The host's image has torch, transformers 5.17, triton and pytest. What it lacks, from the imports of
`infercept.engine`, the engine's guided decoding (`llguidance`), tool-call validation (`jsonschema` and
its dependencies) and the gpu-marked tests:

- transformers at the project's pin (pyproject.toml), for the same model code and loaders as here;
- huggingface_hub: transformers 5.23 checks hub >= 1.31 on import where 5.17 wanted >= 1.5; the
  newest 1.x is shipped (2.x needs `httpx2`, which an image built for transformers 5.17, whose hub is
  < 2, has no reason to hold). transformers 5.17 and 5.23
  want the same tokenizers (>= 0.23.1, < 0.24), safetensors (>= 0.8), regex, typer, tqdm and numpy, so
  the host's copies of those do;
- llguidance, jsonschema, jsonschema-specifications, referencing, rpds-py, attrs.

Versions other than transformers' and hub's are those installed here (tested here). `wheels/manifest.json`
names each wheel and `need`: what pyproject.toml and the shipped wheels require of that distribution
(transformers: ==5.23.0; hub: >=1.31.0,<3.0, from transformers' metadata). `select_wheels.py` installs
a wheel there only where the host's copy misses `need`, so a working package of the image is not
replaced for nothing.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"  # the GPU host's python3
# llguidance's wheels are manylinux_2_31 since 1.7; the host's python3 (3.12.3, Ubuntu 24.04's) has glibc 2.39.
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
# At least these versions where the host has them; the versions installed here are shipped.
AT_LEAST = ("llguidance", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "attrs")
HUB = "huggingface_hub>=1.31,<2"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
LIMIT_MIB = 40  # of the 64 MiB that may travel with the checkout


def project_dependencies() -> list[Requirement]:
    return [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def project_pin(name: str) -> str:
    """The `name==version` requirement of pyproject.toml's dependencies."""
    pin = next((r for r in project_dependencies() if canonicalize_name(r.name) == name
                and any(s.operator == "==" for s in r.specifier)), None)
    if pin is None:
        raise SystemExit(f"pyproject.toml does not pin {name}")
    return str(pin)


def to_download() -> list[str]:
    """The requirement of every wheel shipped."""
    return [project_pin("transformers"), HUB] + [f"{name}=={importlib.metadata.version(name)}" for name in AT_LEAST]


def wheel_requirements(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel (extras' requirements left out)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if not (r.marker and "extra" in str(r.marker))]


def needs(shipped: dict[str, Path]) -> dict[str, str]:
    """For each shipped distribution, every specifier pyproject.toml or a shipped wheel places on it,
    combined (a host copy that meets it is used as is)."""
    reqs = project_dependencies() + [r for path in shipped.values() for r in wheel_requirements(path)]
    out = {}
    for name in shipped:
        spec = SpecifierSet()
        for r in reqs:
            if canonicalize_name(r.name) == name:
                spec &= r.specifier
        out[name] = str(spec)
    return out


def download(requirement: str, dest: Path, python_version: str) -> Path:
    """One wheel, without dependencies, for the host's interpreter and platform; returns its path."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest), requirement]
    for platform in PLATFORMS:
        cmd[-1:-1] = ["--platform", platform]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    if len(new) != 1:
        raise SystemExit(f"pip download {requirement}: expected one new wheel, got {sorted(p.name for p in new)}")
    return new.pop()


def wheel_name_version(path: Path) -> tuple[str, str]:
    """Distribution name (normalized) and version from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def copy_model_files(model_dir: Path, dest: Path) -> list[str]:
    """Everything in the model folder except weights: config, generation config, tokenizer, chat template."""
    dest.mkdir(parents=True)
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))
    for name in names:
        shutil.copy(model_dir / name, dest / name)
    if "config.json" not in names:
        raise SystemExit(f"{model_dir} has no config.json")
    return names


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def checkout_mib() -> float | None:
    """What travels besides the pack: tracked files and untracked ones git does not ignore."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file()) / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".gpu-check"))
    ap.add_argument("--python-version", default=PYTHON_VERSION,
                    help="the GPU host's Python (default %(default)s; the wheels of rpds-py are per version)")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model, fetched if absent)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    if args.model:
        model_dir = Path(args.model)
    else:
        from infercept.engine import ensure_default_model
        model_dir = Path(ensure_default_model())
    names = copy_model_files(model_dir, out / "model")
    print(f"model/ (from {model_dir}): {', '.join(names)}")

    shipped = {}
    for requirement in to_download():
        path = download(requirement, wheels, args.python_version)
        shipped[wheel_name_version(path)[0]] = path
        print(f"wheels/{path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
    need = needs(shipped)
    manifest = [{"file": path.name, "name": name, "version": wheel_name_version(path)[1], "need": need[name]}
                for name, path in shipped.items()]
    (wheels / "manifest.json").write_text(json.dumps(
        {"python_version": args.python_version, "platforms": list(PLATFORMS), "wheels": manifest}, indent=1) + "\n")

    total, tree = size_mib(out), checkout_mib()
    print(f"{out}: {total:.1f} MiB (limit {LIMIT_MIB} MiB); with the checkout ({tree or 0:.1f} MiB): "
          f"{total + (tree or 0):.1f} of the 64 MiB that may travel")
    if total > LIMIT_MIB:
        raise SystemExit(f"{out} is {total:.1f} MiB, over {LIMIT_MIB} MiB")


if __name__ == "__main__":
    main()
