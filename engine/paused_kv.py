"""Where paused requests' KV lives, kept as it moves, and which paused requests a step must plan.

An agent platform holds many more waiting agents than running ones, so nothing a step does may walk
every paused request. This index (mechanism) serves both schedulers: the native one (`engine/scheduler.py`)
and the vLLM backend's (`engine/vllm_backend/scheduler.py`, for its paused sessions). Each owns one and
reports to it as KV moves; each settles the holders its plan preserved through the same
`PausedKV.settle_preserved`. It reads from a request only `request_id`, `num_tokens`, `priority` (a
tuple: queue order) and `paused_at` (the pause's start on the owner's clock); duration keys and history
versions come from its users. It keeps:

- per paused request its (device, host) KV tokens, updated by the scheduler whenever they change
  (`add`, `moved`, `remove`), and totals by location and by state, so the idle-memory clock, the
  `/metrics` gauges and the swap-out demand are O(1) per step;
- the *holders* (paused requests with device KV: the only ones a plan decides anything for), with the
  newest one on a heap, for memory pressure;
- which holders the next plan must see. A holder is *live* (planned every step) until the policy
  preserves it with a `PreserveGuard`: then it is *settled* and sleeps until a guard may be crossed:
  its expected remaining time may reach a bound (a timer, from `DurationEstimator.next_jump` and the
  estimate's growth rate), the running requests' KV falls below the floor its bound rests on, the
  iteration's forward time reaches its swap bound (heaps keyed by those), or its tool's duration
  history changes in a way its estimate can see (a version per tool; a new duration changes only the
  estimates of calls paused for less than it: `DurationEstimator.changed_since`, so a tool completing
  many times a second wakes only its recent pauses). Swap bounds are watched only in
  steps with swap room: without room no plan swaps. A step then plans the live holders and those that
  woke: O(live + woken + log n), never O(paused);
- the *host holders* (paused requests with host KV: what proactive swap-in may bring back), each keyed
  by the earliest time its copy back could be due (the scheduler's `key_host`: its predicted resume less
  its copy time; a prediction falls as fast as the clock and only jumps up, so a key stays early until
  its tool's history changes where it can see it, which re-keys it). A step asks only for the host holders keyed
  before its horizon (`host_holders_before`) and the new ones, never for all of them.

Every wake is conservative (early rather than late), so a step plans exactly the requests whose
decision could differ from PRESERVE; `Scheduler(event_driven=False)` (for the vLLM backend's scheduler,
an index with `event_driven` False) plans every holder every step, and tests compare the two decision by
decision (tests/test_event_driven_plan.py; tests/vllm_scheduler_cases.py).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .policy.plan import PausedInfo, PreserveGuard
from .policy.estimator import DurationEstimator

if TYPE_CHECKING:  # any record with the attributes above: the native `Request`, the vLLM backend's pause
    from .request import Request

PAUSED_KV_STATES = ("device", "host", "partial", "discarded")

# A settled paused request wakes this much before its guard could be crossed: clock arithmetic rounds,
# and waking early only costs a plan.
WAKE_EARLY_S = 1e-6


def kv_state(device: int, host: int) -> str:
    if device and host:
        return "partial"
    return "device" if device else "host" if host else "discarded"


@dataclass
class _Entry:
    request: Request
    seq: int  # pause order: plans see holders in this order, as they would see the paused dict
    device: int = 0
    host: int = 0
    settled: int = 0  # 0: live (if a holder); else the version of its current wake entries
    tool: str | None = None  # settled with an estimate from this tool's history
    host_key: int = 0  # 0: host KV not keyed (or none); else the version of its current host key
    host_tool: str | None = None  # host-keyed with an estimate from this tool's history


class PausedKV:
    def __init__(self, event_driven: bool = True, history: DurationEstimator | None = None):
        """`history`: the tool durations the plans' estimates read (its `version` and `changed_since`)."""
        self.event_driven = event_driven
        self.history = history if history is not None else DurationEstimator()
        self._now = -math.inf  # the clock of the latest look (an older one only makes wakes earlier)
        self._entries: dict[str, _Entry] = {}
        self._seq = itertools.count()
        self._versions = itertools.count(1)
        self.device_tokens = 0
        self.host_tokens = 0
        self.discarded_tokens = 0
        self.count_by_state = dict.fromkeys(PAUSED_KV_STATES, 0)
        self._live: set[str] = set()  # holders planned every step
        # (-priority elementwise, seq, id) of holders, lazily pruned: the last in queue order on top
        self._newest: list[tuple[tuple, int, str]] = []
        # Wakes of settled holders, lazily pruned by version: (time or seconds, seq, id, version).
        self._expected_wake: list[tuple[float, int, str, int]] = []
        self._swap_wake: list[tuple[float, int, str, int]] = []
        self._swap_iteration: list[tuple[float, int, str, int]] = []
        self._running_floor: list[tuple[float, int, str, int]] = []  # keyed by -min_running_tokens
        self._while_ample: set[str] = set()  # settled only while the device pool stays ample
        self._num_settled = 0
        # Settled holders by the tool whose duration history their estimate read, and the history
        # version they all read (a new observation wakes those whose estimate it changes).
        self._by_tool: dict[str, set[str]] = {}
        self._tool_version: dict[str, int] = {}
        # Host holders for proactive swap-in: (key time, seq, id, version), lazily pruned; the ones not
        # keyed yet; the keyed ones by tool and the history version their keys read.
        self._host_keys: list[tuple[float, int, str, int]] = []
        self._host_unkeyed: set[str] = set()
        self._num_host_keyed = 0
        self._host_by_tool: dict[str, set[str]] = {}
        self._host_tool_version: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    # -- where the KV is ----------------------------------------------------------------------------
    def add(self, request: Request, device: int, host: int) -> None:
        entry = _Entry(request, next(self._seq))
        self._entries[request.request_id] = entry
        self.count_by_state[kv_state(0, 0)] += 1
        self.discarded_tokens += request.num_tokens
        self.moved(request.request_id, device, host)

    def moved(self, request_id: str, device: int, host: int) -> None:
        """The request's KV is now `device` + `host` tokens (the rest of its context is discarded). A
        holder whose device KV changed is planned again (live)."""
        e = self._entries[request_id]
        if (device, host) == (e.device, e.host):
            return
        self._account(e, -1)
        was_holder = e.device > 0
        if host != e.host:  # its copy back takes another time, or there is none: key it again
            self._host_unkey(request_id, e)
            if host:
                self._host_unkeyed.add(request_id)
        e.device, e.host = device, host
        self._account(e, +1)
        self._unsettle(request_id, e)
        if device:
            self._live.add(request_id)
            if not was_holder:
                heapq.heappush(self._newest, (tuple(-x for x in e.request.priority), e.seq, request_id))
                self._compact()
        else:
            self._live.discard(request_id)

    def remove(self, request_id: str) -> None:
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        self._account(e, -1)
        self._unsettle(request_id, e)
        self._live.discard(request_id)
        self._host_unkey(request_id, e)

    def _account(self, e: _Entry, sign: int) -> None:
        self.device_tokens += sign * e.device
        self.host_tokens += sign * e.host
        self.discarded_tokens += sign * (e.request.num_tokens - e.device - e.host)
        self.count_by_state[kv_state(e.device, e.host)] += sign

    def kept(self, request_id: str) -> int:
        """KV tokens (device + host) a paused request keeps; 0 if it is not paused. A plain read of
        numbers the engine thread updates: another thread may see them a step late."""
        e = self._entries.get(request_id)
        return e.device + e.host if e is not None else 0

    def newest_holder(self) -> Request | None:
        """The paused request with device KV that arrived last, or more generally comes last in the
        queues' order (`Request.priority`; ties: paused first)."""
        while self._newest:
            _, seq, request_id = self._newest[0]
            e = self._entries.get(request_id)
            if e is not None and e.seq == seq and e.device:
                return e.request
            heapq.heappop(self._newest)
        return None

    # -- which holders to plan ----------------------------------------------------------------------
    def to_plan(self, now: float, running_tokens: int, swap_room: bool, iteration_s: float,
                ample: bool = False) -> list[Request]:
        """The holders this step's plan must see, in pause order: the live ones and the settled ones
        whose guard may be crossed now (`ample`: the device pool has room for all queued work; if not,
        the holders settled only while it had). Without event-driven planning: every holder."""
        if not self.event_driven:
            return [e.request for e in self._entries.values() if e.device]
        self._now = max(self._now, now)
        if not ample:
            for request_id in list(self._while_ample):
                self._wake(request_id)
        self._wake_due(self._expected_wake, now)
        self._wake_due(self._running_floor, -running_tokens - 0.5)  # floors above the running KV
        if swap_room:
            self._wake_due(self._swap_wake, now)
            self._wake_due(self._swap_iteration, iteration_s)
        for tool in [t for t, ids in self._by_tool.items() if ids]:
            self._check_tool(tool, self.history.version(tool))
        entries = sorted((self._entries[i] for i in self._live), key=lambda e: e.seq)
        return [e.request for e in entries]

    def settle(self, request_id: str, expected_wake: float, swap_wake: float, swap_iteration_s: float,
               min_running_tokens: int, tool: str | None, tool_version: int, while_ample: bool = False) -> None:
        """The plan preserved this holder under a guard: plan it again only once `expected_wake` (a
        time) passes, the running requests' KV falls below `min_running_tokens`, or, in steps with swap
        room, `swap_wake` passes or the iteration's forward time reaches `swap_iteration_s`, or
        `tool`'s history moves past `tool_version`, or (`while_ample`) a step's device pool is not
        ample (`to_plan`)."""
        e = self._entries[request_id]
        if not self.event_driven or not e.device:
            return
        if tool is not None and tool_version < self._tool_version.get(tool, tool_version):
            return  # read an older history than the index has seen: planned again next step
        self._unsettle(request_id, e)
        self._live.discard(request_id)
        e.settled = version = next(self._versions)
        self._num_settled += 1
        heapq.heappush(self._expected_wake, (expected_wake, e.seq, request_id, version))
        heapq.heappush(self._swap_wake, (swap_wake, e.seq, request_id, version))
        heapq.heappush(self._swap_iteration, (swap_iteration_s, e.seq, request_id, version))
        if min_running_tokens > 0:
            heapq.heappush(self._running_floor, (-min_running_tokens, e.seq, request_id, version))
        if while_ample:
            self._while_ample.add(request_id)
        if tool is not None:
            self._check_tool(tool, tool_version)
            e.tool = tool
            self._by_tool.setdefault(tool, set()).add(request_id)
        self._compact()

    def settle_preserved(self, request: Request, info: PausedInfo, guard: PreserveGuard | None,
                         duration_key: str | None, duration_hint: float | None) -> None:
        """The plan just preserved this holder (`info`: how the plan saw it, its estimate from this
        index's history with `duration_key` and `duration_hint`), and its policy gave `guard`
        (`Policy.preserve_guard`): it sleeps until the guard may be crossed. The expected remaining time
        grows at most as fast as the clock until its next jump (`DurationEstimator.next_jump`), so each
        bound gets a timer; a guard that holds only while the device pool is ample wakes the first step
        it is not. No guard, or one already crossed: planned again next step. Both schedulers settle
        through here."""
        if guard is None or not info.expected_s < guard.expected_s:
            return  # planned again next step
        now = request.paused_at + info.elapsed_s  # the clock the plan read
        jump = self.history.next_jump(now, request.paused_at, duration_key, duration_hint)

        def wake(bound: float) -> float:
            if bound == math.inf:
                return math.inf
            return min(now + max(bound - info.expected_s, 0.0), jump) - WAKE_EARLY_S

        tool = duration_key if guard.reads_estimate else None  # else no new duration can wake it
        self.settle(request.request_id, wake(guard.expected_s), wake(guard.swap_expected_s),
                    guard.swap_iteration_s, guard.min_running_tokens, tool, self.history.version(tool),
                    guard.while_ample)

    def replan(self, request_id: str) -> None:
        """Plan this holder again next step, and key its host KV again: what its estimate reads changed
        outside the tool histories (a tool name or client hint learned after it paused)."""
        e = self._entries.get(request_id)
        if e is None:
            return
        self._wake(request_id)
        if e.host:
            self._host_unkey(request_id, e)
            self._host_unkeyed.add(request_id)

    # -- which host holders to look at -----------------------------------------------------------------
    def host_holders_before(self, t: float, now: float) -> list[Request]:
        """The host holders keyed before `t`, those not keyed yet (new on the host, moved, or their key
        read a history of their tool that has changed where their estimate can see it), in pause order.
        Each stays unkeyed until `key_host` keys it. Without event-driven planning: every host holder
        (the keys then serve only `next_host_key`)."""
        if not self.event_driven:
            return [e.request for e in self._entries.values() if e.host]
        self._now = max(self._now, now)
        for tool in [name for name, ids in self._host_by_tool.items() if ids]:
            self._check_host_tool(tool, self.history.version(tool))
        while self._host_keys and self._host_keys[0][0] < t:
            _, _, request_id, version = heapq.heappop(self._host_keys)
            e = self._entries.get(request_id)
            if e is not None and e.host_key == version:
                self._host_unkey(request_id, e)
                self._host_unkeyed.add(request_id)
        return [e.request for e in sorted((self._entries[i] for i in self._host_unkeyed), key=lambda e: e.seq)]

    def key_host(self, request_id: str, at: float | None, tool: str | None, tool_version: int) -> None:
        """Look at this host holder again once `at` (a time) passes, or `tool`'s history moves past
        `tool_version`; `at` None: only then (with no tool: never, while its KV stays where it is)."""
        e = self._entries.get(request_id)
        if e is None or not e.host:
            return
        self._host_unkey(request_id, e)
        if tool is not None and tool_version < self._host_tool_version.get(tool, tool_version):
            self._host_unkeyed.add(request_id)  # read an older history than the index has seen: ask again
            return
        e.host_key = version = next(self._versions)
        self._num_host_keyed += 1
        if at is not None:
            heapq.heappush(self._host_keys, (at, e.seq, request_id, version))
        if tool is not None:
            self._check_host_tool(tool, tool_version)
            e.host_tool = tool
            self._host_by_tool.setdefault(tool, set()).add(request_id)
        self._compact()

    def next_host_key(self) -> float:
        """The earliest key among the host holders (-inf if one is not keyed; inf if none is keyed)."""
        if self._host_unkeyed:
            return -math.inf
        while self._host_keys:
            _, _, request_id, version = self._host_keys[0]
            e = self._entries.get(request_id)
            if e is not None and e.host_key == version:
                return self._host_keys[0][0]
            heapq.heappop(self._host_keys)
        return math.inf

    def _check_host_tool(self, tool: str, version: int) -> None:
        """Host holders keyed on an older history of `tool` than `version` need a key again, where the
        change reaches their estimate (`_changed_for`)."""
        seen = self._host_tool_version.get(tool)
        if seen is None or version > seen:
            for request_id in self._changed_for(self._host_by_tool.get(tool, ()), tool, seen):
                self._host_unkey(request_id, self._entries[request_id])
                self._host_unkeyed.add(request_id)
            self._host_tool_version[tool] = version

    def _host_unkey(self, request_id: str, e: _Entry) -> None:
        """Forget a host holder's key (its heap entry goes stale)."""
        self._host_unkeyed.discard(request_id)
        if e.host_key:
            self._num_host_keyed -= 1
            if e.host_tool is not None:
                self._host_by_tool[e.host_tool].discard(request_id)
        e.host_key, e.host_tool = 0, None

    def _check_tool(self, tool: str, version: int) -> None:
        """Wake the holders settled on an older history of `tool` than `version`, where the change
        reaches their estimate (`_changed_for`)."""
        seen = self._tool_version.get(tool)
        if seen is None or version > seen:
            for request_id in self._changed_for(self._by_tool.get(tool, ()), tool, seen):
                self._wake(request_id)
            self._tool_version[tool] = version

    def _changed_for(self, request_ids, tool: str, seen: int | None) -> list[str]:
        """Of `request_ids` (paused on `tool`, estimated at history version `seen`), those whose estimate
        the history's changes since may move: paused for no longer than the longest duration added or
        dropped (`DurationEstimator.changed_since`); the others' estimates are what they were, for good."""
        reach = math.inf if seen is None else self.history.changed_since(tool, seen)
        if reach == math.inf:
            return list(request_ids)
        return [i for i in request_ids if self._now - self._entries[i].request.paused_at <= reach]

    def _wake_due(self, heap: list[tuple[float, int, str, int]], limit: float) -> None:
        while heap and heap[0][0] <= limit:
            _, _, request_id, version = heapq.heappop(heap)
            e = self._entries.get(request_id)
            if e is not None and e.settled == version:
                self._wake(request_id)

    def _wake(self, request_id: str) -> None:
        e = self._entries[request_id]
        self._unsettle(request_id, e)
        if e.device:
            self._live.add(request_id)

    def _unsettle(self, request_id: str, e: _Entry) -> None:
        """Forget a settled holder's wakes (their heap entries go stale: dropped when reached, or by
        `_compact`)."""
        if e.settled:
            self._num_settled -= 1
            if e.tool is not None:
                self._by_tool[e.tool].discard(request_id)
            self._while_ample.discard(request_id)
        e.settled, e.tool = 0, None

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the valid ones: a heap whose top is valid keeps
        its stale entries otherwise, and a long-running server pauses without end."""
        valid = self._num_settled
        for heap in (self._expected_wake, self._swap_wake, self._swap_iteration, self._running_floor):
            if len(heap) > 2 * valid + 64:
                heap[:] = [x for x in heap if (e := self._entries.get(x[2])) is not None and e.settled == x[3]]
                heapq.heapify(heap)
        if len(self._host_keys) > 2 * self._num_host_keyed + 64:
            self._host_keys[:] = [x for x in self._host_keys
                                  if (e := self._entries.get(x[2])) is not None and e.host_key == x[3]]
            heapq.heapify(self._host_keys)
        holders = self.count_by_state["device"] + self.count_by_state["partial"]
        if len(self._newest) > 2 * holders + 64:
            self._newest[:] = [x for x in self._newest
                               if (e := self._entries.get(x[2])) is not None and e.seq == x[1] and e.device]
            heapq.heapify(self._newest)
