"""Which of the wheels `pack.py` shipped this host must install: those whose distribution it lacks, or
has at a version that misses what the project or another shipped wheel requires (`need` in the
manifest). The image's own packages stay where they meet it: replacing a working package of the
image risks breaking something beside it.

    python3 benchmarks/gpu/select_wheels.py .gpu-check/wheels     # prints the wheel paths, one a line
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet


def host_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def select(wheel_dir: Path, version_of=host_version) -> list[tuple[Path, str]]:
    """(wheel, why) for each shipped wheel to install."""
    manifest = json.loads((wheel_dir / "manifest.json").read_text())
    chosen = []
    for w in manifest["wheels"]:
        have = version_of(w["name"])
        if have is None:
            chosen.append((wheel_dir / w["file"], f"{w['name']} absent"))
        elif not SpecifierSet(w["need"]).contains(have, prereleases=True):
            chosen.append((wheel_dir / w["file"], f"{w['name']} {have} misses {w['need']}"))
    return chosen


def main() -> None:
    for path, why in select(Path(sys.argv[1])):
        print(f"installing {path.name}: {why}", file=sys.stderr)
        print(path)


if __name__ == "__main__":
    main()
