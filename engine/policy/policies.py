"""The named policies: the paper's baselines and Figure 3 ablation steps, `infercept-paper` and the
default `infercept`, and the parts a policy may switch per instance (`Policy` attributes). Each turns the
paused requests into a `KVPlan` with the rules of `min_waste` and `expected_waste`; `names` builds them
from a name.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

from .budget import memory_ample, resume_imminent, swap_room, swap_round_trip
from .expected_waste import expected_waste_guard, expected_waste_plan
from .min_waste import (_drop, _holding_device, _in_input_order, _Scored, _swap_in_order,
                        cheaper_to_swap_than_discard, min_waste_plan, score, without_discards)
from .plan import IterationInfo, KVAction, KVDecision, KVPlan, PausedInfo, PreserveGuard
from .profile import Profile

PREEMPTIONS = ("recompute", "swap")  # Policy.preemption
PRIORITIES = ("arrival", "program-arrival", "las")  # Policy.priority
# Policy.ample_preserve, the default's: keep everything where copies stall the forward pass (a CPU), no
# discard only where they overlap it (a GPU's copy stream).
BY_COPY_OVERLAP = "by-copy-overlap"
AMPLE_NO_DISCARD = "no-discard"  # Policy.ample_preserve: no discard while memory is ample; swaps stay


class Policy:
    """A named way to hold paused requests' KV. Subclasses implement `plan`.

    Class attributes the scheduler reads:

    - ``keeps_arrival_time``: a resumed request keeps its original arrival time in the FCFS queues;
      False means it is requeued at the tail (arrival = resume time), like a brand-new request.
    - ``chunked_recompute``: recompute a discarded context ``S - B_i`` tokens per iteration
      (`recompute_chunk_size`); False recomputes it all in one iteration.
    - ``swap_synchronous``: swaps are whole-context and block the iteration (the paper's Swap baseline);
      False means swaps are budgeted per iteration and overlap the forward pass.
    - ``lazy_discard``: a discarded context's blocks stay content-addressed and reusable until evicted
      (the prefix cache of today's servers); False frees them for good (the paper's baselines, vLLM 0.2).
    - ``preemption``: how KV forced off the device under memory pressure leaves it (`reclaim`):
      "recompute" (freed, recomputed later: the paper's baselines, vLLM) or "swap" (copied to the host
      when that wastes less than recomputing). Overridable per instance, for the ablation that
      separates this from the pause-time plan (`make_policy("swap+swap-preemption")`).
    - ``priority``: the order of the scheduler's queues (waiting, swapped, running; also who gives way
      under memory pressure), one of `PRIORITIES`. "arrival": the request's arrival
      time (the paper's three FCFS queues; with ``keeps_arrival_time`` a resumed turn keeps its
      program's, without it the resume time). "program-arrival": the program's first arrival, whatever
      ``keeps_arrival_time`` says. "las": least attained service, the tokens the program has had
      computed before this turn was queued (Autellix), ties by program arrival. In this engine a resumed
      generation is the same request, so a request is a program.
    - ``expected_waste``: decide by expected waste over the remaining-time distribution, with re-queue
      delays (`expected_waste_plan`), instead of Eq. 2 at the mean. Only the
      min-waste policies read it.
    - ``ample_preserve``: preserve every paused request while the device pool has room for all queued
      work (`memory_ample`); the waste rule decides only under memory pressure (the goal: with ample
      memory `infercept` is never worse than `prefix-cache`). ``"no-discard"`` (`AMPLE_NO_DISCARD`,
      ``+ample-no-discard``): while memory is ample only what the waste rule would discard is preserved,
      and its swaps within the budget stay (`without_discards`): a recompute is never free, a budgeted
      swap on a GPU is, and it frees the room before pressure comes instead of leaving kept KV for the
      reclaim path to take back. ``"by-copy-overlap"`` (`BY_COPY_OVERLAP`, the default's): everything
      kept where a copy stalls the forward pass (`Profile.copies_overlap` false: a CPU, where a swap
      stalls its step), no discard only where it overlaps (a GPU). Measured on the H100 model
      (benchmarks/README.md, "Beyond the paper"): keeping everything cost the six-augment mix 3-12%, no
      discard costs it nothing; both halve `approval@10`'s latency. Only the min-waste policies read it.
    - ``prefetch``: proactive swap-in: a paused request whose KV is on the host starts
      coming back within the swap-in budget once its resume looks imminent (`resume_imminent`, on an
      estimate from a hint or the tool's history: `DurationEstimator.predicted`), and the
      plan keeps what came back on the device while it still does. Only the min-waste policies read it.
    - ``context_cost``: the wastes count the attention a recompute spends over the context it rebuilds
      (`Profile.t_attention`, when the profile models it): chunk i of n attends to i/n of the context,
      so recomputing C tokens costs ~C^2 more than ``n * T_fwd(C/n)`` says. Without it the policy sees
      the profile without attention, as the paper's equations do. Only matters for long contexts.
    - ``deferred_swap``: a paused context the waste rule would discard because this iteration's swap
      budget is spent is kept for the iterations its swap needs, when that wastes less (`defer_swap`;
      beyond the paper, which weighs a discard only against preserving for the whole pause). Only the
      min-waste policies read it.
    - ``admission``: admission under overload: while the device pool thrashes, new
      programs start only within an AIMD cap on the active ones (`admission.AdmissionController`, one
      per scheduler); turns of active programs are never held back. Any policy may add it.
    """

    name: ClassVar[str] = ""
    keeps_arrival_time: ClassVar[bool] = True
    chunked_recompute: ClassVar[bool] = False
    swap_synchronous: ClassVar[bool] = False
    lazy_discard: bool = False
    preemption: str = "recompute"
    priority: str = "arrival"
    expected_waste: bool = False
    prefetch: bool = False
    context_cost: bool = False
    deferred_swap: bool = False
    admission: bool = False
    ample_preserve: bool | str = False  # or AMPLE_NO_DISCARD, BY_COPY_OVERLAP

    def __init__(self, *, lazy_discard: bool | None = None, preemption: str | None = None,
                 priority: str | None = None, expected_waste: bool | None = None, prefetch: bool | None = None,
                 context_cost: bool | None = None, deferred_swap: bool | None = None,
                 admission: bool | None = None, ample_preserve: bool | str | None = None):
        if lazy_discard is not None:
            self.lazy_discard = lazy_discard  # per-instance override, e.g. for ablations
        if preemption is not None:
            if preemption not in PREEMPTIONS:
                raise ValueError(f"preemption must be one of {', '.join(PREEMPTIONS)}, not {preemption!r}")
            self.preemption = preemption
        if priority is not None:
            if priority not in PRIORITIES:
                raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
            self.priority = priority
        if expected_waste is not None:
            self.expected_waste = expected_waste
        if prefetch is not None:
            self.prefetch = prefetch
        if context_cost is not None:
            self.context_cost = context_cost
        if deferred_swap is not None:
            self.deferred_swap = deferred_swap
        if admission is not None:
            self.admission = admission
        if ample_preserve is not None:
            if ample_preserve not in (True, False, BY_COPY_OVERLAP, AMPLE_NO_DISCARD):
                raise ValueError(f"ample_preserve must be True, False, {BY_COPY_OVERLAP!r} or "
                                 f"{AMPLE_NO_DISCARD!r}, not {ample_preserve!r}")
            self.ample_preserve = ample_preserve

    def seen(self, profile: Profile) -> Profile:
        """The profile the wastes are computed with: with attention only under `context_cost`."""
        return profile if self.context_cost else profile.without_attention

    def plan(self, paused: Sequence[PausedInfo], iteration: IterationInfo, profile: Profile) -> KVPlan:
        raise NotImplementedError

    def preserve_guard(self, info: PausedInfo, iteration: IterationInfo, profile: Profile) -> PreserveGuard | None:
        """For a request this policy's plan just preserved in `iteration`: bounds within which every later plan
        preserves it too (`PreserveGuard`), or None if it must be planned again every iteration. The
        bounds must be sound, not tight: a guard that ends early only costs a plan; one that ends late
        would change decisions (tests replay traces with and without guards and compare every one)."""
        return None

    def reclaim(self, info: PausedInfo, iteration: IterationInfo, profile: Profile) -> KVAction:
        """A running request needs device blocks and this request's KV must leave the device now: the
        newest paused holder, or, when no paused KV is left, the newest running request (preemption;
        its `info` then has no expected time away). DISCARD (recompute later) or SWAP_OUT (whole device
        part, if the host pool has room), by `preemption`: with "swap", min-waste under pressure (an
        extension of the paper, whose fallback under pressure is vLLM's discard and preemption by
        recompute): swapped when a synchronous copy wastes less than chunked recomputation."""
        if self.preemption == "swap" and cheaper_to_swap_than_discard(info, iteration, self.seen(profile)):
            return KVAction.SWAP_OUT
        return KVAction.DISCARD

    @property
    def label(self) -> str:
        """The name `make_policy` takes to build this policy again: the registered name and the parts
        that differ from its defaults."""
        cls, parts = type(self), []
        if self.preemption != cls.preemption:
            parts.append(f"{self.preemption}-preemption")
        if self.priority != cls.priority:
            parts.append(f"{self.priority}-priority")
        if self.expected_waste != cls.expected_waste:
            parts.append("expected-waste" if self.expected_waste else "mean-waste")
        if self.prefetch != cls.prefetch:
            parts.append("prefetch" if self.prefetch else "no-prefetch")
        if self.context_cost != cls.context_cost:
            parts.append("context-cost" if self.context_cost else "no-context-cost")
        if self.deferred_swap != cls.deferred_swap:
            parts.append("deferred-swap" if self.deferred_swap else "no-deferred-swap")
        if self.admission != cls.admission:
            parts.append("admission" if self.admission else "no-admission")
        if self.ample_preserve != cls.ample_preserve:
            parts.append("ample-no-discard" if self.ample_preserve == AMPLE_NO_DISCARD
                         else "ample-preserve" if self.ample_preserve else "no-ample-preserve")
        return "+".join([self.name, *parts])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.label!r})"

    def _score_all(self, paused, iteration, profile) -> list[_Scored]:
        profile = self.seen(profile)
        return [score(p, iteration, profile, chunked=self.chunked_recompute) for p in _holding_device(paused)]


class DiscardPolicy(Policy):
    """The paper's vLLM baseline: drop the KV at once, requeue at the tail, recompute in one go."""

    name = "discard"
    keeps_arrival_time = False

    def plan(self, paused, iteration, profile):
        return _in_input_order(paused, {s.info.request_id: _drop(s)
                                        for s in self._score_all(paused, iteration, profile)})


class ImprovedDiscardPolicy(DiscardPolicy):
    """ImprovedDiscard (§3.2; Figure 3 step 2): discard, but keep the original arrival time."""

    name = "improved-discard"
    keeps_arrival_time = True


class ChunkedDiscardPolicy(ImprovedDiscardPolicy):
    """Figure 3 step 3: ImprovedDiscard plus recomputation chunking (§4.2)."""

    name = "chunked-discard"
    chunked_recompute = True


class BudgetedSwapPolicy(ChunkedDiscardPolicy):
    """Figure 3 step 4: swap out within the per-iteration budget, discard once the limit is reached.

    No waste model yet, so the order is: swaps already in progress first (finish what was started),
    then by original arrival time.
    """

    name = "budgeted-swap"

    def plan(self, paused, iteration, profile):
        ordered = sorted(self._score_all(paused, iteration, profile), key=_swap_fcfs_key)
        decisions, rest = _swap_in_order(ordered, swap_room(iteration), profile)
        decisions.update({s.info.request_id: _drop(s) for s in rest})
        return _in_input_order(paused, decisions)


class HeuristicPreservePolicy(BudgetedSwapPolicy):
    """Figure 3 step 5: preserve short (automated) interceptions; budgeted swap, then discard, for long
    (interactive) ones.

    The paper splits by interception type; here "long" means an expected remaining time of at least
    ``long_threshold_s`` (default 2 s: between the automated tools of Table 1, at most 0.69 s on average,
    and the human or model-plus-human ones, 17 s or more).
    """

    name = "heuristic-preserve"

    def __init__(self, *, long_threshold_s: float = 2.0, **parts):
        super().__init__(**parts)
        self.long_threshold_s = long_threshold_s

    def plan(self, paused, iteration, profile):
        scored = self._score_all(paused, iteration, profile)
        short = [s for s in scored if s.info.expected_s < self.long_threshold_s]
        long = sorted((s for s in scored if s.info.expected_s >= self.long_threshold_s), key=_swap_fcfs_key)
        decisions, rest = _swap_in_order(long, swap_room(iteration), profile)
        decisions.update({s.info.request_id: _drop(s) for s in rest})
        decisions.update({s.info.request_id: s.decide(KVAction.PRESERVE) for s in short})
        return _in_input_order(paused, decisions)

    def preserve_guard(self, info, iteration, profile):
        # Short interceptions are preserved, whatever the iteration, until they look long.
        if info.kv_state == "partial":
            return PreserveGuard.until_swap_room()
        return PreserveGuard(expected_s=self.long_threshold_s)


class InferCeptPaperPolicy(Policy):
    """Figure 3 step 6, the paper's full system: chunked recompute, budgeted pipelined swap, min-waste
    (§4.3), with this project's swap-preemption. Kept without the policy parts beyond the paper, so the
    comparison with `infercept` can always be rerun."""

    name = "infercept-paper"
    chunked_recompute = True
    lazy_discard = True
    # Min-waste under pressure too: a request preserved because its interception looked short, or a
    # running request preempted for room, is swapped out rather than discarded when that wastes less.
    preemption = "swap"

    def plan(self, paused, iteration, profile):
        ample = bool(self.ample_preserve) and memory_ample(iteration)
        if ample and self._keeps_all_while_ample(profile):
            return _in_input_order(paused, {p.request_id: KVDecision(p.request_id, KVAction.PRESERVE)
                                            for p in _holding_device(paused)})
        plan = self._waste_plan(paused, iteration, profile)
        return without_discards(plan) if ample else plan

    def _keeps_all_while_ample(self, profile: Profile) -> bool:
        """With memory ample: keep every paused request (True), or only what the rule would discard."""
        if self.ample_preserve == BY_COPY_OVERLAP:
            return not profile.copies_overlap
        return self.ample_preserve is True

    def _waste_plan(self, paused, iteration, profile) -> KVPlan:
        """The waste rule's plan (min-waste or expected waste), keeping prefetched KV whose resume is near."""
        profile = self.seen(profile)
        held: dict[str, KVDecision] = {}
        if self.prefetch:
            # Prefetched KV whose resume still looks imminent stays: swapping it out again would undo
            # the prefetch for nothing.
            step_s = iteration.step_lead_s or profile.t_fwd(iteration.num_batched_tokens)
            for p in _holding_device(paused):
                if p.prefetched and resume_imminent(p.expected_s, profile, step_s, p.num_tokens):
                    held[p.request_id] = KVDecision(p.request_id, KVAction.PRESERVE)
        plan = (expected_waste_plan if self.expected_waste else min_waste_plan)(
            [p for p in paused if p.request_id not in held], iteration, profile, self.deferred_swap)
        if not held:
            return plan
        held.update((d.request_id, d) for d in plan)
        return _in_input_order(paused, held)

    def preserve_guard(self, info, iteration, profile):
        """With ``expected_waste``: `expected_waste_guard`. Otherwise: preserve beats chunked discard
        (Eq. 4) whatever the recompute chunk while
        ``T_int < T_fwd(C) / 2 + b · C_other`` with ``b = min over n of n · T_fwd(C / n) / C``; the
        guard takes half of this iteration's ``C_other`` as a floor (so the running batch may shrink to
        half before the request is planned again). No swap is worth it while both the expected time and
        the iteration stay below the round trip (`worth_swapping`). The factor below 1 keeps the bound
        strict under float rounding. The profile is the one `plan` computes with (`seen`)."""
        profile = self.seen(profile)
        ample = bool(self.ample_preserve) and memory_ample(iteration)
        if ample and self._keeps_all_while_ample(profile):
            return PreserveGuard(while_ample=True)  # `plan` keeps every paused request while memory is ample
        if self.prefetch and info.prefetched:
            return None  # planned every iteration while it may be kept for its resume
        if info.kv_state == "partial":
            return PreserveGuard.until_swap_room()
        if ample:
            # While memory is ample `plan` turns its discards into preserves: only a swap, which needs the
            # round trip to pay, could replace this preserve (without it, a holder whose discard would
            # waste less was planned every step on a GPU profile, where this mode is the default).
            round_trip = swap_round_trip(info, profile)
            return PreserveGuard(swap_expected_s=round_trip, swap_iteration_s=round_trip, while_ample=True)
        if self.expected_waste:
            return expected_waste_guard(info, iteration, profile)
        C = info.num_device_tokens
        per_other_token = profile.cheapest_recompute_s(C) / C
        floor = iteration.num_running_tokens // 2
        round_trip = swap_round_trip(info, profile)
        return PreserveGuard(expected_s=(profile.t_fwd(C) / 2 + per_other_token * floor) * (1 - 1e-9),
                             swap_expected_s=round_trip, swap_iteration_s=round_trip, min_running_tokens=floor)


class InferCeptPolicy(InferCeptPaperPolicy):
    """The default: the paper's policy with the policy parts beyond the paper that the GPU-scale
    simulation supports (benchmarks/README.md, "Beyond the paper": never worse than `infercept-paper` beyond
    seed-to-seed noise there, more resumes finding their KV on the device): expected-waste decisions
    and proactive swap-in; and while the device pool has room for all queued work, no swap or discard
    where copies stall the forward pass (a CPU; from the real server, benchmarks/README.md, "Ample
    memory"), no discard where they overlap it (a GPU; `approval@10` twice as fast, the mix unchanged);
    and deferred swaps (`defer_swap`: the long-context workload 1.06x the sustainable programs/s, its
    recompute share of forward time at 0.1 programs/s from 9.5% to 1.4%, every other workload
    unchanged). Least attained service is not among them: it raised latency on every loaded workload
    measured."""

    name = "infercept"
    expected_waste = True
    prefetch = True
    ample_preserve = BY_COPY_OVERLAP
    deferred_swap = True


class PreservePolicy(Policy):
    """Preserve (§3.2): keep every paused request's KV on the device."""

    name = "preserve"

    def plan(self, paused, iteration, profile):
        return _in_input_order(paused, {s.info.request_id: s.decide(KVAction.PRESERVE)
                                        for s in self._score_all(paused, iteration, profile)})

    def preserve_guard(self, info, iteration, profile):
        return PreserveGuard()  # always


class SwapPolicy(Policy):
    """Swap (§3.2): synchronously copy the whole context to the host at interception.

    No per-iteration budget (the copy blocks the iteration instead); only the host pool limits it, and
    a request that does not fit there is discarded.
    """

    name = "swap"
    swap_synchronous = True

    def plan(self, paused, iteration, profile):
        room = iteration.free_host_tokens
        decisions = {}
        for s in sorted(self._score_all(paused, iteration, profile), key=_swap_fcfs_key):
            tokens = s.info.num_device_tokens
            if room is None or tokens <= room:
                decisions[s.info.request_id] = s.decide(KVAction.SWAP_OUT, tokens)
                room = None if room is None else room - tokens
            else:
                decisions[s.info.request_id] = _drop(s)
        return _in_input_order(paused, decisions)


class PrefixCachePolicy(DiscardPolicy):
    """Today's vLLM V1 / SGLang: the tool call ends the request, its blocks stay in the
    prefix cache until evicted, and the next request reuses what survived (chunked prefill for the rest).
    """

    name = "prefix-cache"
    keeps_arrival_time = False
    chunked_recompute = True
    lazy_discard = True


def _swap_fcfs_key(s: _Scored):
    return (s.info.kv_state != "partial", s.info.arrival_time, s.info.request_id)

