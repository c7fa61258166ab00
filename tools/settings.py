"""Tool settings: one frozen dataclass; the only place that reads the tools' environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_DOCS = PACKAGE_DIR / "docs"
# One copy of the paper's augmentation profiles, kept with the benchmarks that also replay it. It is
# found beside this package in a source checkout (editable install); elsewhere set INFERCEPT_AUGMENTS.
REPOSITORY_AUGMENTS = PACKAGE_DIR.parent / "benchmarks" / "augments.json"


@dataclass(frozen=True)
class ToolSettings:
    # Folder of .md/.txt files that document_lookup searches (INFERCEPT_DOCS_DIR).
    docs_dir: Path = BUNDLED_DOCS
    # augments.json with the simulated tools' duration and result-length profiles (INFERCEPT_AUGMENTS).
    augments_path: Path = REPOSITORY_AUGMENTS
    # Multiplies every simulated duration: 1 replays the paper's seconds, 0.01 makes a 28 s chatbot
    # turn last 0.28 s (INFERCEPT_SIMULATED_TIME_SCALE).
    simulated_time_scale: float = 1.0
    # Seed of the simulated tools' draws; each tool draws its own reproducible sequence
    # (INFERCEPT_SIMULATED_SEED).
    simulated_seed: int = 0

    def __post_init__(self):
        if self.simulated_time_scale < 0:
            raise ValueError("simulated_time_scale must be >= 0")

    @classmethod
    def from_env(cls) -> "ToolSettings":
        env = os.environ
        return cls(docs_dir=Path(env.get("INFERCEPT_DOCS_DIR", BUNDLED_DOCS)),
                   augments_path=Path(env.get("INFERCEPT_AUGMENTS", REPOSITORY_AUGMENTS)),
                   simulated_time_scale=float(env.get("INFERCEPT_SIMULATED_TIME_SCALE", 1.0)),
                   simulated_seed=int(env.get("INFERCEPT_SIMULATED_SEED", 0)))
