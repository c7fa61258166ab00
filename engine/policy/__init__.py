"""Policy layer of the InferCept engine: cost model, waste equations, duration estimate, KV decisions.

Pure Python (stdlib only, no torch), so the scheduler's decisions can be unit-tested and simulated
without a model (`engine/modeled_runner.py`). Modules:

- `profile`: `Profile` (``T_fwd``, ``S``, ``M``, copy bandwidth; JSON file format), `a100_gptj_6b()`.
- `waste`: the paper's waste equations 1-4.
- `estimator`: `DurationEstimator`, the expected remaining interception time (``T_int`` of Eq. 2).
- `decisions`: per-iteration `KVPlan` (preserve / swap out / discard), the min-waste rule (Eq. 5) and
  its expected-waste form over a remaining-time distribution, the baseline and ablation policies,
  `make_policy` (with switchable parts: `VARIANTS`).
- `admission`: `AdmissionController`, the AIMD cap on active programs under overload (`+admission`).
"""
from .admission import AdmissionController
from .decisions import (FIGURE3_ABLATION, KV_STATES, POLICIES, PRIORITIES, VARIANTS, IterationInfo, KVAction,
                        KVDecision, KVPlan, PausedInfo, Policy, PreserveGuard, SwapBudget, make_policy, min_waste_plan,
                        recompute_chunk_size, split_swap_budget, swap_room)
from .estimator import DurationEstimator
from .profile import Profile, a100_gptj_6b, detect_saturation_point
from .waste import waste_chunk_discard, waste_discard, waste_preserve, waste_swap

__all__ = [
    "AdmissionController", "FIGURE3_ABLATION", "KV_STATES", "POLICIES", "PRIORITIES", "VARIANTS", "DurationEstimator", "IterationInfo",
    "KVAction", "KVDecision", "KVPlan", "PausedInfo", "Policy", "PreserveGuard", "Profile", "SwapBudget",
    "a100_gptj_6b", "detect_saturation_point", "make_policy", "min_waste_plan", "recompute_chunk_size",
    "split_swap_budget", "swap_room", "waste_chunk_discard", "waste_discard", "waste_preserve", "waste_swap",
]
