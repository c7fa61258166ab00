"""The paper's six augmentations (math, qa, ve, chatbot, image, tts) as simulated tools: each call
sleeps for a duration and returns text of a length drawn from that augmentation's profile in
augments.json, so benchmarks can replay the paper's interception workloads against the real server.

Every (mean, spread) pair of the profile is a mean and standard deviation (see its "about"), drawn
from a lognormal because durations and lengths are positive and right-skewed."""
from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infercept.tools.base import Tool, string_parameter

# Returned text is made of these words. Each is one token (with its leading space) in common BPE
# vocabularies, so N words are about N tokens, the length the profile asks for.
WORDS = ("the", "result", "is", "a", "value", "of", "and", "in", "for", "data", "found", "with", "page", "one",
         "two", "three", "more", "next", "room", "door", "table", "image", "sound", "text")


def load_augments(path: Path) -> dict[str, dict]:
    """The "augments" section of augments.json: augmentation name -> profile."""
    with open(path) as f:
        return json.load(f)["augments"]


def lognormal(rng: random.Random, mean: float, sd: float) -> float:
    """A positive draw with the given mean and standard deviation (the mean itself when sd <= 0)."""
    if sd <= 0:
        return mean
    sigma2 = math.log1p((sd / mean) ** 2)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


@dataclass(frozen=True)
class Draw:
    duration_s: float  # already multiplied by the time scale
    num_tokens: int  # length of the returned text, at least 1


class SimulatedTool(Tool):
    def __init__(self, name: str, profile: dict, *, seed: int = 0, time_scale: float = 1.0):
        self.name = name
        self.kind = profile["kind"]  # tool / env / human / model: what the interception stands for
        self.description = (f"Simulated {name} augmentation ({profile['source']}): waits like the real one "
                            "and returns placeholder text of a realistic length.")
        self.parameters = string_parameter("input", "the request to the augmentation")
        self.profile = profile
        self.time_scale = time_scale
        # A string seed is hashed deterministically, so each tool has its own reproducible sequence.
        self.rng = random.Random(f"{seed}:{name}")

    def draw(self) -> Draw:
        duration = lognormal(self.rng, *self.profile["interception_s"]) * self.time_scale
        num_tokens = max(1, round(lognormal(self.rng, *self.profile["return_tokens_assumed"])))
        return Draw(duration, num_tokens)

    async def run(self, arguments: dict[str, Any]) -> str:
        draw = self.draw()
        await asyncio.sleep(draw.duration_s)
        return " ".join(self.rng.choice(WORDS) for _ in range(draw.num_tokens))


def simulated_tools(augments_path: Path, *, seed: int = 0, time_scale: float = 1.0) -> list[SimulatedTool]:
    return [SimulatedTool(name, profile, seed=seed, time_scale=time_scale)
            for name, profile in load_augments(augments_path).items()]
