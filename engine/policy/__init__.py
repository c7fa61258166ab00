"""Policy layer of the InferCept engine: cost model, waste equations, duration estimate, KV decisions.

Pure Python (stdlib only, no torch), so the scheduler's decisions can be unit-tested and simulated
without a model (`engine/modeled_runner.py`). Modules:

- `profile`: `Profile` (``T_fwd``, ``S``, ``M``, copy bandwidth; JSON file format), `a100_gptj_6b()`.
- `waste`: the paper's waste equations 1-4.
- `estimator`: `DurationEstimator`, the expected remaining interception time (``T_int`` of Eq. 2).
- `plan`: the policy's inputs (`PausedInfo`, `IterationInfo`) and its per-iteration `KVPlan` (preserve /
  swap out / discard), with `PreserveGuard`.
- `budget`: the per-iteration swap budget and its split, the recompute chunk, the swap round trip,
  `memory_ample`, `resume_imminent`.
- `min_waste`: the min-waste rule (Eq. 5) and `min_waste_plan`.
- `expected_waste`: its expected-waste form over a remaining-time distribution.
- `policies`: the baseline and ablation policies (`Policy` and its subclasses).
- `names`: `POLICIES`, `make_policy` (with switchable parts: `VARIANTS`), `base_policy`.
- `prefetch`: proactive swap-in's choice of the paused requests whose host KV comes back now.
- `admission`: `AdmissionController`, the AIMD cap on active programs under overload (`+admission`).
"""
from .admission import AdmissionController
from .budget import SwapBudget, recompute_chunk_size, split_swap_budget, swap_room
from .estimator import DurationEstimator
from .min_waste import min_waste_plan
from .names import FIGURE3_ABLATION, POLICIES, VARIANTS, base_policy, make_policy
from .plan import KV_STATES, IterationInfo, KVAction, KVDecision, KVPlan, PausedInfo, PreserveGuard
from .policies import PRIORITIES, Policy
from .profile import Profile, a100_gptj_6b, detect_saturation_point
from .waste import waste_chunk_discard, waste_discard, waste_preserve, waste_swap

__all__ = [
    "AdmissionController", "FIGURE3_ABLATION", "KV_STATES", "POLICIES", "PRIORITIES", "VARIANTS", "DurationEstimator", "IterationInfo",
    "KVAction", "KVDecision", "KVPlan", "PausedInfo", "Policy", "PreserveGuard", "Profile", "SwapBudget",
    "a100_gptj_6b", "base_policy", "detect_saturation_point", "make_policy", "min_waste_plan", "recompute_chunk_size",
    "split_swap_budget", "swap_room", "waste_chunk_discard", "waste_discard", "waste_preserve", "waste_swap",
]
