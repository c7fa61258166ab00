"""The cost model the policy reasons with: forward time, saturation point, KV size, copy bandwidth.

A `Profile` describes one (model, device, dtype) setup with four measured quantities:

- ``M`` = ``bytes_per_token``: KV-cache bytes one token occupies (all layers, K and V).
- ``T_fwd(n)``: seconds of one forward iteration that schedules ``n`` query tokens, given as samples
  ``(n, seconds)`` and fitted piecewise-linearly (see `Profile.t_fwd`).
- ``S`` = ``saturation_point``: query tokens per iteration beyond which the iteration time grows
  linearly with no throughput gain (paper §4.2). Stored explicitly, or derived from the samples by
  `detect_saturation_point`.
- device→host (swap-out) and host→device (swap-in) bandwidth in bytes/s; ``T_swap(n) = n·M / bw``
  (paper §4.1).

Pure Python, stdlib only: the scheduler and the modeled runner use it without torch.

File format (JSON, one object; written by `Profile.to_json`, read by `Profile.from_json`)::

    {
      "format": "infercept-profile/1",     # required, exactly this string
      "model": "EleutherAI/gpt-j-6b",      # model id the numbers were measured with
      "device": "NVIDIA A100-SXM4-80GB",   # device name (torch.cuda.get_device_name or "cpu")
      "dtype": "float16",                  # KV/activation dtype
      "bytes_per_token": 458752,           # M, integer bytes
      "block_size": 16,                    # tokens per KV block
      "t_fwd_fit": "piecewise-linear",     # how t_fwd is computed from the samples (only this one)
      "t_fwd_samples": [[1, 0.014], ...],  # [num_tokens, seconds] pairs, num_tokens strictly increasing
      "saturation_point": 512,             # S in tokens (always written; derived if it was not given)
      "d2h_bytes_per_s": 2.5e10,           # swap-out bandwidth
      "h2d_bytes_per_s": 2.5e10,           # swap-in bandwidth
      "attention_read_s_per_token": 0.0,   # optional (default 0): see `Profile.t_attention`
      "attention_pair_s": 0.0,             # optional (default 0)
      "copy_overlap": 0.9,                 # optional (default null): see `Profile.copies_overlap`
      "notes": "free text: where the numbers come from"
    }

Unknown keys are ignored on read, so later versions may add fields.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

PROFILE_FORMAT = "infercept-profile/1"
T_FWD_FIT = "piecewise-linear"

# Saturation rule threshold: S is where doubling the batch buys less than this much throughput.
SATURATION_MIN_GAIN_PER_DOUBLING = 0.10


def detect_saturation_point(samples: Sequence[tuple[float, float]],
                            min_gain_per_doubling: float = SATURATION_MIN_GAIN_PER_DOUBLING) -> int:
    """Saturation point S from ``(num_tokens, seconds)`` samples sorted by ``num_tokens``.

    Rule: throughput at ``n`` is ``n / T_fwd(n)``. For each consecutive pair of samples ``a < b`` the
    gain is normalised to one doubling of the batch, ``(thr_b / thr_a) ** (1 / log2(b / a)) - 1``, so
    the rule does not depend on how densely the curve was sampled. S is the first ``a`` whose gain per
    doubling is below ``min_gain_per_doubling`` (10%): beyond it, more query tokens mostly lengthen the
    iteration. If the gain never drops that low, the GPU is not saturated within the measured range and
    S is the largest sample (a conservative choice: we never claim free capacity we did not measure).
    """
    if not samples:
        raise ValueError("need at least one T_fwd sample")
    for (n_a, t_a), (n_b, t_b) in zip(samples, samples[1:]):
        doublings = math.log2(n_b / n_a)
        gain = ((n_b / t_b) / (n_a / t_a)) ** (1.0 / doublings) - 1.0
        if gain < min_gain_per_doubling:
            return int(n_a)
    return int(samples[-1][0])


def _normalise_samples(samples: Iterable[Sequence[float]]) -> tuple[tuple[int, float], ...]:
    """Samples as a sorted tuple of ``(int tokens, float seconds)``; rejects unusable data."""
    out = tuple(sorted((int(n), float(t)) for n, t in samples))
    if not out:
        raise ValueError("a profile needs at least one T_fwd sample")
    for n, t in out:
        if n <= 0 or not t > 0 or not math.isfinite(t):
            raise ValueError(f"bad T_fwd sample ({n}, {t}): tokens and seconds must be positive")
    ns = [n for n, _ in out]
    if len(set(ns)) != len(ns):
        raise ValueError("T_fwd samples must have distinct token counts")
    return out


@dataclass(frozen=True)
class Profile:
    """Measured (or hand-written) cost model of one model on one device. See the module docstring."""

    model: str
    device: str
    dtype: str
    bytes_per_token: int  # M
    block_size: int
    t_fwd_samples: tuple[tuple[int, float], ...]
    d2h_bytes_per_s: float  # swap-out bandwidth
    h2d_bytes_per_s: float  # swap-in bandwidth
    # S; None means "derive from the samples" (done once, in __post_init__).
    saturation_point: int | None = None
    notes: str = field(default="", compare=False)
    # Attention over the context, which T_fwd (passes from position 0) leaves out (`t_attention`); 0: not
    # modeled. The native engine's profiler measures both (`profiler._attention_costs`).
    attention_read_s_per_token: float = 0.0
    attention_pair_s: float = 0.0
    # Measured share of a swap's copy time hidden behind a forward pass running beside it (1: all of
    # it, 0: none: the copy stalls the pass); None: not measured (`copies_overlap` goes by the device).
    copy_overlap: float | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise and derive through object.__setattr__, once, at construction.
        samples = _normalise_samples(self.t_fwd_samples)
        object.__setattr__(self, "t_fwd_samples", samples)
        if self.saturation_point is None:
            object.__setattr__(self, "saturation_point", detect_saturation_point(samples))
        if self.bytes_per_token <= 0 or self.block_size <= 0 or self.saturation_point <= 0:
            raise ValueError("bytes_per_token, block_size and saturation_point must be positive")
        if self.d2h_bytes_per_s <= 0 or self.h2d_bytes_per_s <= 0:
            raise ValueError("copy bandwidths must be positive")
        if self.attention_read_s_per_token < 0 or self.attention_pair_s < 0:
            raise ValueError("attention costs must not be negative")
        if self.copy_overlap is not None and not 0 <= self.copy_overlap <= 1:
            raise ValueError("copy_overlap must be in [0, 1]")

    # -- forward time ---------------------------------------------------------------------------
    @property
    def M(self) -> int:  # noqa: N802 - the paper's name
        return self.bytes_per_token

    @property
    def S(self) -> int:  # noqa: N802 - the paper's name
        return self.saturation_point  # type: ignore[return-value]  # set in __post_init__

    def t_fwd(self, num_tokens: float) -> float:
        """Seconds of one iteration that schedules ``num_tokens`` query tokens (paper's ``T_fwd``).

        Piecewise-linear through the samples. Between 0 and the smallest sample the time stays at the
        smallest sample's time: an iteration costs at least one pass over the weights however few
        tokens it carries. Beyond the largest sample it extends the last segment's slope (compute-bound
        regime, time grows linearly; a negative slope from noisy samples is clamped to flat).
        ``num_tokens <= 0`` means no iteration at all: 0 s. Fractional token counts are allowed
        (Eq. 4 evaluates ``T_fwd(C/n)``).
        """
        if num_tokens <= 0:
            return 0.0
        samples = self.t_fwd_samples
        n0, t0 = samples[0]
        if num_tokens <= n0:
            return t0
        n_last, t_last = samples[-1]
        if num_tokens >= n_last:
            return t_last + (num_tokens - n_last) * self._tail_slope()
        i = bisect.bisect_left(samples, (num_tokens, -math.inf))  # first sample with n >= num_tokens
        (n_a, t_a), (n_b, t_b) = samples[i - 1], samples[i]
        return t_a + (t_b - t_a) * (num_tokens - n_a) / (n_b - n_a)

    @property
    def copies_overlap(self) -> bool:
        """Whether a KV copy runs beside the forward pass (a GPU's copy stream) or stalls it (a CPU,
        where host and device memory are the same DRAM and the copy is synchronous: `copy_stream.py`).
        As measured (`copy_overlap`, more than half hidden) where the profile measured it, else by the
        device."""
        if self.copy_overlap is not None:
            return self.copy_overlap > 0.5
        return not self.device.lower().startswith("cpu")

    # -- attention over the context ---------------------------------------------------------------
    @property
    def has_attention(self) -> bool:
        return bool(self.attention_read_s_per_token or self.attention_pair_s)

    def t_attention(self, q: float, ctx: float) -> float:
        """Seconds a chunk of ``q`` query tokens over a ``ctx``-token context (its own tokens included)
        adds to ``T_fwd``: ``ctx * max(read_s_per_token, q * pair_s)``, the longer of reading its KV once
        (memory-bound: decode) and the QK^T and PV products (compute-bound: a prefill or recompute
        chunk). Causal masking is ignored (a chunk is charged its whole context): a small overestimate
        when q << ctx. Right within a few percent to leave out at the paper's <= 2k-token contexts, not at
        10k-100k, where a decode step reads every sequence's KV; 0 when the profile does not model it."""
        return ctx * max(self.attention_read_s_per_token, q * self.attention_pair_s)

    def t_recompute_attention(self, C: float, n: int) -> float:
        """Attention of recomputing ``C`` tokens in ``n`` equal chunks, chunk i over the first i chunks."""
        if n <= 0 or not self.has_attention:
            return 0.0
        chunk = C / n
        return sum(self.t_attention(chunk, i * chunk) for i in range(1, n + 1))

    def cheapest_recompute_s(self, C: int) -> float:
        """``min over n of n·T_fwd(C/n)``, n up to ``ceil(C / block_size)``: the least forward time ``C``
        tokens take in equal chunks of at least a block. Memoized per ``C``: the preserve guards ask it of
        every context they settle, each time it is planned (a quarter of the scheduler's time on an agent
        trace before)."""
        memo = self._cheapest_recompute
        if C not in memo:
            chunks = range(1, -(-C // self.block_size) + 1)
            memo[C] = min((n * self.t_fwd(C / n) for n in chunks), default=0.0)
        return memo[C]

    @cached_property
    def _cheapest_recompute(self) -> dict[int, float]:
        return {}

    @cached_property
    def without_attention(self) -> "Profile":
        """This profile as the paper's equations see it: T_fwd alone (`Policy.context_cost` off)."""
        return replace(self, attention_read_s_per_token=0.0, attention_pair_s=0.0) if self.has_attention else self

    def _tail_slope(self) -> float:
        samples = self.t_fwd_samples
        if len(samples) == 1:
            n, t = samples[0]
            return t / n  # one sample: assume time proportional to tokens beyond it
        (n_a, t_a), (n_b, t_b) = samples[-2], samples[-1]
        return max((t_b - t_a) / (n_b - n_a), 0.0)

    # -- swapping -------------------------------------------------------------------------------
    def bandwidth(self, direction: str) -> float:
        """Copy bandwidth in bytes/s: ``"out"`` device→host, ``"in"`` host→device."""
        if direction == "out":
            return self.d2h_bytes_per_s
        if direction == "in":
            return self.h2d_bytes_per_s
        raise ValueError(f"direction must be 'out' or 'in', not {direction!r}")

    def t_swap(self, num_tokens: float, direction: str = "out") -> float:
        """Seconds to copy ``num_tokens`` tokens of KV: ``T_swap(n) = n·M / bandwidth`` (paper §4.1)."""
        return max(num_tokens, 0) * self.bytes_per_token / self.bandwidth(direction)

    def swap_budget_tokens(self, iteration_seconds: float) -> int:
        """Swap limit ``N_i`` of one iteration: solve ``T_swap(N_i) = T_fwd(B_i)`` (paper §4.1).

        ``iteration_seconds`` is ``T_fwd(B_i)`` of the iteration the copies hide behind. The budget is
        shared by swap-in and swap-out (paper §4.1, criterion 1), so it is computed with the slower of
        the two directions: whatever split the scheduler chooses, the copies fit in the iteration.
        """
        if iteration_seconds <= 0:
            return 0
        slowest = min(self.d2h_bytes_per_s, self.h2d_bytes_per_s)
        return int(iteration_seconds * slowest // self.bytes_per_token)

    # -- identity and persistence ---------------------------------------------------------------
    def matches(self, model: str, device: str, dtype: str) -> bool:
        """True when this profile was measured for this model, device name and dtype."""
        return (self.model, self.device, self.dtype) == (model, device, dtype)

    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "bytes_per_token": self.bytes_per_token,
            "block_size": self.block_size,
            "t_fwd_fit": T_FWD_FIT,
            "t_fwd_samples": [[n, t] for n, t in self.t_fwd_samples],
            "saturation_point": self.saturation_point,
            "d2h_bytes_per_s": self.d2h_bytes_per_s,
            "h2d_bytes_per_s": self.h2d_bytes_per_s,
            "attention_read_s_per_token": self.attention_read_s_per_token,
            "attention_pair_s": self.attention_pair_s,
            "copy_overlap": self.copy_overlap,
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not an {PROFILE_FORMAT} file (format={data.get('format')!r})")
        fit = data.get("t_fwd_fit", T_FWD_FIT)
        if fit != T_FWD_FIT:
            raise ValueError(f"unsupported t_fwd_fit {fit!r}; this version knows {T_FWD_FIT!r}")
        return cls(
            model=data["model"],
            device=data["device"],
            dtype=data["dtype"],
            bytes_per_token=int(data["bytes_per_token"]),
            block_size=int(data["block_size"]),
            t_fwd_samples=tuple((int(n), float(t)) for n, t in data["t_fwd_samples"]),
            d2h_bytes_per_s=float(data["d2h_bytes_per_s"]),
            h2d_bytes_per_s=float(data["h2d_bytes_per_s"]),
            saturation_point=data.get("saturation_point"),
            notes=data.get("notes", ""),
            attention_read_s_per_token=float(data.get("attention_read_s_per_token", 0.0)),
            attention_pair_s=float(data.get("attention_pair_s", 0.0)),
            copy_overlap=None if data.get("copy_overlap") is None else float(data["copy_overlap"]),
        )

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        """Written whole or not at all: servers starting together (replicas) may save the same cached
        profile while another reads it."""
        path = Path(path)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staging.write_text(self.to_json() + "\n")
        os.replace(staging, path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(Path(path).read_text())


# -- hand-written GPU profiles (drive the modeled runner) --------------------------------------------

# GPT-J-6B architecture (model card / config.json of EleutherAI/gpt-j-6b; the paper cites the model
# in §5 but not its shape): 28 layers, hidden size 4096, full multi-head attention (no GQA).
_GPTJ_LAYERS = 28
_GPTJ_HIDDEN = 4096
_FP16_BYTES = 2
# M = 2 (K and V) x layers x hidden x bytes = 2*28*4096*2 = 458,752 B per token.
GPTJ_6B_FP16_BYTES_PER_TOKEN = 2 * _GPTJ_LAYERS * _GPTJ_HIDDEN * _FP16_BYTES

# ASSUMPTION (the paper reports no T_fwd numbers): iteration time of GPT-J-6B fp16 on one A100,
# shaped like published vLLM / Sarathi measurements of 6-7B models. Memory-bound floor ~14 ms (12 GB of
# weights at ~2 TB/s HBM plus launch/scheduling overhead), flattening until a few hundred query tokens,
# then compute-bound at ~60 us/token (12 GFLOP/token at ~200 TFLOP/s achieved of 312 peak).
_A100_GPTJ_T_FWD = (
    (1, 0.0140), (16, 0.0142), (64, 0.0150), (128, 0.0165), (256, 0.0200),
    (512, 0.0330), (1024, 0.0610), (2048, 0.1200), (4096, 0.2450),
)
# ASSUMPTION: host link of an A100 is PCIe 4.0 x16, 32 GB/s raw per direction; ~25 GB/s is the usual
# effective rate of pinned-memory cudaMemcpyAsync. The paper only says the link is limited (§3.2, §4.1).
_PCIE4_X16_EFFECTIVE_BYTES_PER_S = 25e9
# vLLM's default block size; InferCept is built on vLLM 0.2 (paper §4.5).
_VLLM_BLOCK_SIZE = 16


def a100_gptj_6b() -> Profile:
    """Hand-written profile of the paper's main setup: GPT-J-6B fp16 on one A100 (paper §5).

    Paper facts used: the model and GPU (§5, Figure 2 "6B"), vLLM as the base system (§4.5, block size
    16), ``S`` defined as the query-token count beyond which throughput stops growing (§4.2). Every
    number the paper does not print is an assumption stated next to its constant above. ``S`` is not
    hard-coded: `detect_saturation_point` derives 512 from the assumed curve (doubling 256→512 still
    gains 21% throughput, 512→1024 only 8%).
    """
    return Profile(
        model="EleutherAI/gpt-j-6b",
        device="NVIDIA A100",
        dtype="float16",
        bytes_per_token=GPTJ_6B_FP16_BYTES_PER_TOKEN,
        block_size=_VLLM_BLOCK_SIZE,
        t_fwd_samples=_A100_GPTJ_T_FWD,
        d2h_bytes_per_s=_PCIE4_X16_EFFECTIVE_BYTES_PER_S,
        h2d_bytes_per_s=_PCIE4_X16_EFFECTIVE_BYTES_PER_S,
        notes="hand-written from the InferCept paper setup (GPT-J-6B, A100); T_fwd and bandwidth assumed, "
              "see infercept.engine.policy.profile",
    )


# -- a current GPU: Llama-3-8B bf16 on one H100 SXM5 80GB --------------------------------------------

# Llama-3-8B architecture (meta-llama/Meta-Llama-3-8B config.json): 32 layers, 8 KV heads (GQA) of
# head dim 128; 8,030,261,248 parameters (model card).
_LLAMA3_8B_LAYERS = 32
_LLAMA3_8B_KV_HEADS = 8
_LLAMA3_8B_HEAD_DIM = 128
LLAMA3_8B_PARAMETERS = 8_030_261_248
_BF16_BYTES = 2
# M = 2 (K and V) x 32 x 8 x 128 x 2 = 131,072 B = 128 KiB per token (GQA: 3.5x less than GPT-J's).
LLAMA3_8B_BF16_BYTES_PER_TOKEN = 2 * _LLAMA3_8B_LAYERS * _LLAMA3_8B_KV_HEADS * _LLAMA3_8B_HEAD_DIM * _BF16_BYTES
# H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): HBM3 at 3.35 TB/s; 989 TFLOPS dense BF16
# (the datasheet's 1,979 is with 2:4 sparsity).
H100_SXM_HBM_BYTES_PER_S = 3.35e12
H100_SXM_BF16_FLOPS = 989e12
# ASSUMPTION: achieved fractions typical of large-batch LLM kernels (~80% of HBM bandwidth for the
# weight stream, ~60% of peak tensor FLOPs for the dense GEMMs), plus ~1.5 ms per iteration of kernel
# launches, sampling and scheduling outside the weight stream (vLLM-era CUDA-graph decode step).
_H100_ACHIEVED_BANDWIDTH = 0.8
_H100_ACHIEVED_FLOPS = 0.6
_H100_ITERATION_OVERHEAD_S = 0.0015
# Host links. PCIe 5.0 x16: 64 GB/s raw per direction (PCI-SIG); ~50 GB/s effective for pinned
# cudaMemcpyAsync. NVLink-C2C on GH200 (Grace Hopper superchip datasheet): 900 GB/s total, 450 GB/s
# per direction; ~350 GB/s effective assumed.
PCIE5_X16_EFFECTIVE_BYTES_PER_S = 50e9
NVLINK_C2C_EFFECTIVE_BYTES_PER_S = 350e9
_HOST_LINKS = {"pcie5": PCIE5_X16_EFFECTIVE_BYTES_PER_S, "nvlink-c2c": NVLINK_C2C_EFFECTIVE_BYTES_PER_S}
_ROOFLINE_SAMPLE_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)


# Query heads (32 x 128 = the 4,096 hidden size): attention FLOPs per (query, context) token pair are
# 2 (multiply-add) x 2 products (QK^T, PV) x 4,096 x 32 layers.
_LLAMA3_8B_ATTENTION_DIM = 4096
LLAMA3_8B_ATTENTION_FLOPS_PER_PAIR = 2 * 2 * _LLAMA3_8B_ATTENTION_DIM * _LLAMA3_8B_LAYERS


def roofline_t_fwd(num_tokens: int, weight_bytes: float, flops_per_token: float, bandwidth: float,
                   flops: float, overhead_s: float) -> float:
    """Iteration time of a dense decoder by the roofline: the longer of streaming the weights once and
    the GEMMs' compute, plus a fixed overhead. Attention over the context is left out (as in the A100
    profile): at <= 2k-token contexts it is a few percent of an 8B model's FLOPs."""
    return overhead_s + max(weight_bytes / bandwidth, num_tokens * flops_per_token / flops)


def h100_llama3_8b(host_link: str = "pcie5", attention: bool = False) -> Profile:
    """Hand-written profile of a current setup: Llama-3-8B bf16 on one H100 SXM5 80GB.

    ``T_fwd`` from the roofline (`roofline_t_fwd`) with the datasheet numbers and the achieved fractions
    above: a ~6 ms weight stream (16 GB at 2.7 TB/s) + 1.5 ms floor, compute-bound from ~220 query tokens
    at 27 us/token (2 x 8.03 GFLOP per token at 593 TFLOPS). ``S`` is derived by
    `detect_saturation_point` (256 with these samples). `host_link` is ``"pcie5"`` (H100 SXM/PCIe boards)
    or ``"nvlink-c2c"`` (GH200). `attention`: also model attention over the context (`t_attention`, for
    long contexts; Llama-3.1-8B has these shapes and a 128k window): a decoding sequence reads its
    128 KiB per context token at the achieved HBM bandwidth, a prefill chunk's attention runs at the
    achieved tensor FLOP/s; a 50k-token context adds 2.4 ms to a decode step and 11 ms to a 256-token
    chunk. Off by default: the paper-scale comparisons (<= 2k tokens) were made without it."""
    if host_link not in _HOST_LINKS:
        raise ValueError(f"host_link must be one of {', '.join(_HOST_LINKS)}")
    weight_bytes = LLAMA3_8B_PARAMETERS * _BF16_BYTES
    samples = tuple((n, roofline_t_fwd(n, weight_bytes, 2 * LLAMA3_8B_PARAMETERS,
                                       H100_SXM_HBM_BYTES_PER_S * _H100_ACHIEVED_BANDWIDTH,
                                       H100_SXM_BF16_FLOPS * _H100_ACHIEVED_FLOPS, _H100_ITERATION_OVERHEAD_S))
                    for n in _ROOFLINE_SAMPLE_TOKENS)
    bandwidth = _HOST_LINKS[host_link]
    return Profile(
        model="meta-llama/Meta-Llama-3-8B",
        device="NVIDIA H100 80GB HBM3" if host_link == "pcie5" else "NVIDIA GH200",
        dtype="bfloat16",
        bytes_per_token=LLAMA3_8B_BF16_BYTES_PER_TOKEN,
        block_size=_VLLM_BLOCK_SIZE,
        t_fwd_samples=samples,
        d2h_bytes_per_s=bandwidth,
        h2d_bytes_per_s=bandwidth,
        attention_read_s_per_token=(LLAMA3_8B_BF16_BYTES_PER_TOKEN / (H100_SXM_HBM_BYTES_PER_S * _H100_ACHIEVED_BANDWIDTH)
                                    if attention else 0.0),
        attention_pair_s=(LLAMA3_8B_ATTENTION_FLOPS_PER_PAIR / (H100_SXM_BF16_FLOPS * _H100_ACHIEVED_FLOPS)
                          if attention else 0.0),
        notes=f"hand-written: Llama-3-8B bf16, H100 datasheet roofline, host link {host_link}"
              f"{', attention modeled' if attention else ''}; see infercept.engine.policy.profile",
    )
