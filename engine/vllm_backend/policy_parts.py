"""Which of a policy's parts the vLLM backend runs, and the policy it runs.

A policy's parts are `Policy` attributes a name may switch after ``+`` (`engine.policy.names.PARTS`).
`InterceptScheduler` (scheduler.py) runs the policy's plans, guards, reclaim rule and choice of the host
KV to bring back ahead of a resume on vLLM, so the parts that live in those run there as on the native
engine; the parts that need mechanism only the native scheduler has (its own queue order, its admission
gate) do not. This module says which is which, in one place: the start-up check (backend.py, before vLLM
starts) and the scheduler inside vLLM both build the policy with `vllm_policy`, so a name that asks for a
part the backend cannot run is refused by name (no policy class turns one on by default: a test says
so). Policy names and parts stay the policy layer's (`engine.policy`); this module only reads them. No
vLLM import: the server's environment reads it too.
"""
from __future__ import annotations

from ..policy import Policy, make_policy
from ..policy.names import part_setting

# The parts this backend runs, and how: the same `engine.policy` code as the native engine, over the inputs
# `InterceptScheduler` gives it.
HONOURED = {
    "expected_waste": "plans and guards over the remaining-time samples of the scheduler's tool histories",
    "context_cost": "the wastes read the attention the profile models (the worker's measured profile models "
                    "none, so there the part changes nothing; the native engine's profile measures it)",
    "deferred_swap": "a discard the spent swap budget would force waits for the steps its swap needs, within "
                     "the host tier's room",
    "ample_preserve": "while vLLM's free blocks hold all queued work (waiting requests' uncomputed tokens, "
                      "paused KV on the host, one step's token budget), in every mode",
    "preemption": "the rule for paused KV taken back under memory pressure (Policy.reclaim); a running "
                  "request that vLLM itself preempts is recomputed under either rule",
    "prefetch": "a paused session whose KV is all on the host gets device blocks from vLLM's free pool (less "
                "what running requests and the next step's admissions need) once its resume looks imminent, and the host tier "
                "copies it back within the step's swap budget, whole (an idle engine is woken for it)",
}
# The parts only the native engine runs, and why not here. On this backend each stays at `Policy`'s own
# value (off; arrival order).
NATIVE_ONLY = {
    "priority": "vLLM orders its queues by arrival; least attained service and program arrival need the "
                "native scheduler's queues",
    "admission": "the AIMD cap reads the native engine's thrashing and holds new programs in its own queue",
}


def native_only_parts(name: str) -> list[str]:
    """The parts written after "+" in `name` that switch on a part only the native engine runs."""
    asked = []
    for part in name.split("+")[1:]:
        attribute, value = part_setting(part)
        if attribute in NATIVE_ONLY and value != getattr(Policy, attribute):
            asked.append(part)
    return asked


def vllm_policy(name: str) -> Policy:
    """The policy `name` names (`make_policy`), as the vLLM backend runs it. ValueError, naming the parts, if
    `name` asks for a part only the native engine runs."""
    asked = native_only_parts(name)
    if asked:
        why = "; ".join(f"{_shown(part_setting(p)[0])}: {NATIVE_ONLY[part_setting(p)[0]]}" for p in asked)
        raise ValueError(f"policy {name!r}: {', '.join('+' + p for p in asked)} "
                         f"{'does' if len(asked) == 1 else 'do'} not run on the vLLM backend ({why}); "
                         f"{'it works' if len(asked) == 1 else 'they work'} on the native engine "
                         f"(--backend native). {summary()}")
    return make_policy(name)


def summary() -> str:
    """One line for the start-up log: the parts this backend runs and those only the native engine runs."""
    return (f"Policy parts on the vLLM backend: {', '.join(map(_shown, HONOURED))}; on the native engine only: "
            f"{', '.join(map(_shown, NATIVE_ONLY))}.")


def _shown(attribute: str) -> str:
    """A part as names write it (`expected_waste` -> expected-waste)."""
    return attribute.replace("_", "-")
