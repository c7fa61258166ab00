"""Policy names: the registry (`POLICIES`), the paper's Figure 3 ablation order, and `make_policy`,
which builds a policy from its name with parts switched after ``+`` (`VARIANTS`, each setting one of
`PARTS`: `part_setting`); `Policy.label` is the inverse.
"""
from __future__ import annotations

from .policies import (AMPLE_NO_DISCARD, PREEMPTIONS, PRIORITIES, BudgetedSwapPolicy, ChunkedDiscardPolicy,
                       DiscardPolicy, HeuristicPreservePolicy, ImprovedDiscardPolicy, InferCeptPaperPolicy,
                       InferCeptPolicy, Policy, PrefixCachePolicy, PreservePolicy, SwapPolicy)

POLICIES: dict[str, type[Policy]] = {
    "discard": DiscardPolicy,
    "vllm": DiscardPolicy,  # Figure 3's name for the same baseline
    "improved-discard": ImprovedDiscardPolicy,
    "chunked-discard": ChunkedDiscardPolicy,
    "budgeted-swap": BudgetedSwapPolicy,
    "heuristic-preserve": HeuristicPreservePolicy,
    "infercept": InferCeptPolicy,
    "infercept-paper": InferCeptPaperPolicy,
    "preserve": PreservePolicy,
    "swap": SwapPolicy,
    "prefix-cache": PrefixCachePolicy,
}

# Paper Figure 3 (§5.2): each step adds one technique to the one before it.
FIGURE3_ABLATION = ("vllm", "improved-discard", "chunked-discard", "budgeted-swap", "heuristic-preserve",
                    "infercept-paper")

# The parts a policy name may add after "+", each switching one thing (`Policy` attributes).
VARIANTS = tuple(f"{p}-preemption" for p in PREEMPTIONS) + tuple(f"{p}-priority" for p in PRIORITIES) + (
    "expected-waste", "mean-waste", "prefetch", "no-prefetch", "context-cost", "no-context-cost", "deferred-swap",
    "no-deferred-swap", "admission", "no-admission", "ample-preserve", "no-ample-preserve", "ample-no-discard")


# The `Policy` attributes a part after "+" sets: the policy's switchable parts.
PARTS = ("preemption", "priority", "expected_waste", "prefetch", "context_cost", "deferred_swap", "admission",
         "ample_preserve")


def part_setting(part: str) -> tuple[str, object]:
    """The `Policy` attribute (one of `PARTS`) a part written after "+" sets, and its value; ValueError
    naming the choices if unknown."""
    if part.endswith("-preemption") and part.removesuffix("-preemption") in PREEMPTIONS:
        return "preemption", part.removesuffix("-preemption")
    if part.endswith("-priority") and part.removesuffix("-priority") in PRIORITIES:
        return "priority", part.removesuffix("-priority")
    if part in ("expected-waste", "mean-waste"):
        return "expected_waste", part == "expected-waste"
    if part in ("prefetch", "no-prefetch"):
        return "prefetch", part == "prefetch"
    if part in ("context-cost", "no-context-cost"):
        return "context_cost", part == "context-cost"
    if part in ("deferred-swap", "no-deferred-swap"):
        return "deferred_swap", part == "deferred-swap"
    if part in ("admission", "no-admission"):
        return "admission", part == "admission"
    if part in ("ample-preserve", "no-ample-preserve"):
        return "ample_preserve", part == "ample-preserve"
    if part == "ample-no-discard":
        return "ample_preserve", AMPLE_NO_DISCARD
    raise ValueError(f"unknown policy variant {part!r}; use {', '.join('+' + v for v in VARIANTS)}")


def base_policy(name: str) -> str:
    """The registered policy a name starts from: ``"infercept+prefetch"`` -> ``"infercept"``."""
    return name.split("+")[0]


def make_policy(name: str, **kwargs) -> Policy:
    """The policy registered under ``name``, optionally with parts switched after ``+``: another
    preemption rule (``"infercept+recompute-preemption"``, ``"swap+swap-preemption"``: the ablation that
    credits the pause-time plan and the preemption rule separately), another queue order
    (``"infercept-paper+las-priority"``), expected-waste decisions (``"infercept-paper+expected-waste"``),
    admission under overload (``"infercept-paper+admission"``); several may be chained. ValueError naming the choices if unknown."""
    base, parts = base_policy(name), name.split("+")[1:]
    for part in parts:
        key, value = part_setting(part)
        kwargs[key] = value
    try:
        cls = POLICIES[base]
    except KeyError:
        raise ValueError(f"unknown policy {base!r}; choose one of {', '.join(sorted(POLICIES))} "
                         f"(optionally +recompute-preemption or +swap-preemption, +las-priority, "
                         f"+program-arrival-priority, +expected-waste, +prefetch, +context-cost, +deferred-swap, "
                         f"+admission, +ample-preserve, +ample-no-discard)") from None
    return cls(**kwargs)
