"""Prometheus metrics: request counters and TTFT kept by the server, engine state read at scrape time.

Each app has its own `CollectorRegistry`, so several apps (tests) can live in one process. Engine
numbers (its counters, block pools, where paused KV lives) come from the backend's `snapshot()` when
/metrics is scraped, then are exported by a custom collector.
"""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infercept.engine.backend import PAUSED_KV_STATES as KV_STATES, RESUME_KV_PLACES, EngineSnapshot

disable_created_metrics()  # no `*_created` series next to every counter

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
INTERCEPTION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # tools to humans
MAX_TOOL_LABELS = 64


class _EngineCollector:
    def __init__(self, model: str):
        self.model = model
        self.snapshot = EngineSnapshot()

    def collect(self):
        s, m = self.snapshot, [self.model]

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(m, value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(m, value)
            return g

        yield counter("infercept_engine_steps", "Engine iterations", s.num_steps)
        yield counter("infercept_engine_forward_seconds", "Seconds spent in engine steps", s.forward_seconds)
        yield counter("infercept_computed_tokens", "Tokens processed by forward passes", s.num_computed_tokens)
        yield counter("infercept_recomputed_tokens", "Computed tokens whose KV had been computed before",
                      s.num_recomputed_tokens)
        yield counter("infercept_recompute_seconds", "Seconds of engine steps spent recomputing, modeled: each "
                      "step's time split over its tokens pro rata", s.recompute_seconds)
        yield counter("infercept_swapped_out_blocks", "KV blocks copied device -> host", s.num_swapped_out_blocks)
        yield counter("infercept_swapped_in_blocks", "KV blocks copied host -> device", s.num_swapped_in_blocks)
        yield counter("infercept_discarded_tokens", "KV tokens of paused requests dropped", s.num_discarded_tokens)
        yield counter("infercept_preemptions", "Running requests taken off the device for room",
                      s.num_preemptions)
        yield counter("infercept_preemptions_by_swap", "Preemptions whose KV went to the host instead of "
                      "being recomputed", s.num_preemptions_by_swap)
        yield counter("infercept_memory_waste_byte_seconds",
                      "Held-but-idle KV of paused requests: bytes x wall-clock seconds (between steps too)",
                      s.memory_waste_byte_seconds)
        yield gauge("infercept_kv_device_blocks_total", "Device KV pool size in blocks", s.device_blocks_total)
        yield gauge("infercept_kv_device_blocks_used", "Device KV blocks in use", s.device_blocks_used)
        yield gauge("infercept_kv_device_usage", "Share of the device KV pool in use",
                    s.device_blocks_used / s.device_blocks_total if s.device_blocks_total else 0.0)
        yield gauge("infercept_kv_host_blocks_total", "Host KV pool size in blocks", s.host_blocks_total)
        yield gauge("infercept_kv_host_blocks_used", "Host KV blocks in use", s.host_blocks_used)
        yield counter("infercept_prefix_cache_queried_blocks", "Full prompt blocks looked up in the prefix cache",
                      s.prefix_queried_blocks)
        yield counter("infercept_prefix_cache_hit_blocks", "Looked-up blocks found cached and reused",
                      s.prefix_hit_blocks)
        yield counter("infercept_prefix_cache_miss_blocks", "Looked-up blocks not cached (computed)",
                      s.prefix_queried_blocks - s.prefix_hit_blocks)
        yield counter("infercept_prefix_cache_evicted_blocks", "Cached blocks reused for new content",
                      s.prefix_evicted_blocks)
        yield gauge("infercept_prefix_cache_blocks", "Device blocks addressable by content (in use or evictable)",
                    s.prefix_cached_blocks)
        yield gauge("infercept_requests_running", "Requests running or swapping in", s.num_running)
        yield gauge("infercept_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield gauge("infercept_programs_active", "Programs (generations) scheduled once and not finished: "
                    "running, paused, or waiting to resume", s.num_active_programs)
        yield gauge("infercept_admission_cap", "Cap on active programs under overload (policy part +admission); "
                    "+Inf: uncapped", math.inf if s.admission_cap is None else s.admission_cap)
        yield gauge("infercept_programs_held_back", "New programs waiting because the admission cap holds them back",
                    s.num_held_back)
        yield counter("infercept_thrashed_tokens", "KV tokens computed or copied again: recomputed, preempted by "
                      "swap, swap-ins evicted half-way (the admission cap's signal)", s.num_thrashed_tokens)
        paused = GaugeMetricFamily("infercept_paused_requests", "Paused generations by where their KV lives",
                                   labels=["model", "kv_state"])
        for state in KV_STATES:
            paused.add_metric([self.model, state], s.paused_by_state.get(state, 0))
        yield paused
        tokens = GaugeMetricFamily("infercept_paused_tokens", "Context tokens of paused generations by KV location",
                                   labels=["model", "location"])
        for loc, n in s.paused_tokens_by_location.items():
            tokens.add_metric([self.model, loc], n)
        yield tokens
        resumed = CounterMetricFamily("infercept_resumed_kv", "Paused generations resumed, by where their KV was "
                                      "when the resume came: all on the device, some on the host (copied back "
                                      "first), or none (recomputed past the prefix cache)", labels=["model", "place"])
        for place in RESUME_KV_PLACES:
            resumed.add_metric([self.model, place], s.resumes_by_kv.get(place, 0))
        yield resumed


class ServerMetrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("infercept_requests", "Finished HTTP requests to the generation endpoints",
                                ["model", "endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("infercept_prompt_tokens", "Prompt tokens of served requests", ["model"],
                                     registry=r)
        self.cached_tokens = Counter("infercept_cached_prompt_tokens",
                                     "Prompt tokens whose KV was reused rather than computed", ["model"], registry=r)
        self.generation_tokens = Counter("infercept_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.resumes = Counter("infercept_resumes", "Requests that continued a paused generation",
                               ["model", "how"], registry=r)
        self.resume_fallbacks = Counter("infercept_resume_fallbacks",
                                        "Requests that named or matched a paused generation but were served fresh",
                                        ["model"], registry=r)
        self.evictions = Counter("infercept_paused_evictions", "Paused generations aborted, by cause: limits "
                                 "(--max-paused-tokens / --max-paused: the one keeping the least KV goes; or its "
                                 "session or response over its own limit), quota (a tenant over its own: its oldest "
                                 "goes), ttl (--idle-ttl), shutdown, client (deleted or continued differently)",
                                 ["model", "cause"], registry=r)
        self.released_kv_tokens = Counter("infercept_paused_released_kv_tokens",
                                          "KV tokens (device + host) the aborted paused generations still kept: "
                                          "what their agents' next turns recompute", ["model", "cause"], registry=r)
        self.forwarded = Counter("infercept_forwarded_requests", "Requests naming a conversation another replica "
                                 "holds, or a prompt_cache_key whose home is another replica, forwarded there "
                                 "(replicas behind a router: server/replica_forwarding.py), by kind: chat, "
                                 "session, response, conversation, item (an item_reference), prompt_cache_key", ["model", "kind"],
                                 registry=r)
        self.ttft = Histogram("infercept_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("infercept_inter_token_latency_seconds",
                                     "Time between consecutive generated tokens of a request", ["model"],
                                     buckets=ITL_BUCKETS, registry=r)
        self.interceptions = Histogram("infercept_interception_seconds", "How long paused generations waited for "
                                       "their interception's result (pause to resume), by tool (`tokens`: a "
                                       "token-level interception; `other` past MAX_TOOL_LABELS names)",
                                       ["model", "tool"], buckets=INTERCEPTION_BUCKETS, registry=r)
        self._tool_labels: set[str] = set()
        for metric in (self.prompt_tokens, self.cached_tokens, self.generation_tokens, self.resume_fallbacks,
                       self.ttft, self.inter_token):
            metric.labels(model)  # exported (as zero) before the first request
        for cause in ("limits", "ttl"):
            self.evictions.labels(model, cause)
            self.released_kv_tokens.labels(model, cause)
        self.engine = _EngineCollector(model)
        r.register(self.engine)

    def observe_interception(self, tool: str, seconds: float) -> None:
        """Tool names come from clients: past MAX_TOOL_LABELS distinct ones, the rest count as `other`
        (a label per name would let any client grow the scrape without bound)."""
        if tool not in self._tool_labels:
            if len(self._tool_labels) >= MAX_TOOL_LABELS:
                tool = "other"
            self._tool_labels.add(tool)
        self.interceptions.labels(self.model, tool).observe(max(seconds, 0.0))

    def observe_request(self, endpoint: str, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                        completion_tokens: int) -> None:
        self.requests.labels(self.model, endpoint, finish_reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.cached_tokens.labels(self.model).inc(cached_tokens)
        self.generation_tokens.labels(self.model).inc(completion_tokens)
