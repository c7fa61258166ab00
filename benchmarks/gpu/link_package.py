"""Make `infercept` importable from this source tree without installing the project: a folder
`<dest>/infercept/` whose subpackages are symlinks to the source folders pyproject.toml maps them to
(`infercept.engine` -> engine/, ...). Put `<dest>` on PYTHONPATH. A GPU host without network cannot
`pip install` the project (its dependencies include the server's), and links keep the tree the code
runs from the one that was copied there.

    python3 benchmarks/gpu/link_package.py /tmp/scratch/pkg
"""
from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top_level_packages(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{"engine": "engine", ...}: infercept.X -> source folder, for the packages directly under infercept
    (their subpackages come with the link)."""
    dirs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: folder for name, folder in dirs.items()
            if name.startswith("infercept.") and name.count(".") == 1}


def link(dest: Path, root: Path = ROOT) -> Path:
    pkg = dest / "infercept"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, folder in top_level_packages(root / "pyproject.toml").items():
        target = pkg / name
        if target.is_symlink() or target.exists():
            target.unlink()
        os.symlink(root / folder, target)
    return pkg


if __name__ == "__main__":
    print(link(Path(sys.argv[1])))
