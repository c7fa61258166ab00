"""Executes a SchedulerOutput on the real model: build batch tensors, forward, sample (mechanism)."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import bad_words, cpu_kernels, prompt_logprobs
from .attention import AttentionMetadata, PrefillSpan
from .copy_stream import to_device
from .cuda_graphs import DecodeGraphs, MixedGraphs
from .guided_decoding import GuidedDecoder
from .kv_cache import KVCache, token_slots
from .models.llama import LlamaForCausalLM
from .outputs import RunnerOutput, SampledToken, SchedulerOutput
from .request import PLACEHOLDER
from .sampler import DeviceSamples, TokenHistory, sample_on_device
from .thinking_budget import ThinkingBudgets


def gpu_attention_kernels():
    """Triton's paged decode attention and paged attention of mixed steps where Triton runs here, else
    (None, None) (imported only on CUDA hosts: importing Triton takes a third of a second)."""
    from . import triton_decode, triton_prefill

    if not triton_decode.available():
        return None, None
    return triton_decode.paged_decode_attention, triton_prefill.paged_prefill_attention


@dataclass
class PendingSamples:
    """A step's sampled tokens still on their way to the host (`ModelRunner.run` with `defer_samples`), and
    the span of its pass on the device (`ModelRunner.device_seconds`), readable once they arrived.
    `on_read` runs once, when they are first read: the grammars that constrained them and the thinking
    budgets that count them take them."""

    request_ids: list[str]
    samples: DeviceSamples
    device_span: tuple | None
    on_read: Callable[[RunnerOutput], None] | None = None
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)  # read already (`run`)
    _read: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._read is None:
            self._read = RunnerOutput(sampled=dict(zip(self.request_ids, self.samples.result())),
                                      prompt_logprobs=self.prompt_logprobs)
            if self.on_read is not None:
                self.on_read(self._read)
        return self._read


# Mixed steps of up to this many tokens replay graphs even when the step budget is smaller: the profile
# measures passes up to 2,048 tokens (profiler.QUICK_SIZES_GPU) before the budget is chosen from it.
GRAPH_TOKENS = 2048


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 eos_token_ids: frozenset[int], seed: int = 0, tokenizer=None, cuda_graphs: bool = False,
                 max_batch: int = 0, max_model_len: int = 0, max_tokens: int = 0):
        """On CUDA with Triton, steps of up to `max_batch` sequences (and `max_tokens` tokens, at least
        GRAPH_TOKENS) run through static buffers (`cuda_graphs.py`): replayed from CUDA graphs with
        `cuda_graphs`, launched kernel by kernel without. Everywhere else, and for bigger steps, the
        torch path runs."""
        self.model = model
        # Grammar-constrained sampling needs the tokenizer (token bytes); without one, no grammars.
        self.guided = GuidedDecoder(tokenizer, eos_token_ids) if tokenizer is not None else None
        # Thinking budgets force the end-of-thinking marker's tokens, which the tokenizer gives.
        self.thinking = ThinkingBudgets.of_tokenizer(tokenizer) if tokenizer is not None else None
        self.tokenizer = tokenizer  # (bad words are tokenized here, as vLLM tokenizes them)
        # Per request: its bad words' token sequences, and its allowed_token_ids as a mask on the device.
        self._bad_words: dict[str, list[list[int]]] = {}
        self._permitted: dict[str, torch.Tensor] = {}
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.decode_kernel, prefill_kernel = gpu_attention_kernels() if device.type == "cuda" else (None, None)
        self.graph_sets: list[DecodeGraphs | MixedGraphs] = []
        self.cuda_graphs = False
        self._device_span: tuple[float, float] | tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        # The last step's samples: their tokens on the device are the next step's inputs where the
        # scheduler planned it before they reached the host (a `PLACEHOLDER`).
        self._last_samples: PendingSamples | None = None
        # The last `run`'s host time (the step log's): staging its inputs (all before its pass, copies
        # apart), queueing its swap copies before its pass and while it ran.
        self.input_host_seconds = self.copy_host_seconds = self.copy_overlapped_host_seconds = 0.0
        if self.decode_kernel is not None:
            self.graph_sets = [
                DecodeGraphs(model, kv_cache, device, max_batch, max_model_len, self.decode_kernel),
                MixedGraphs(model, kv_cache, device, max(max_tokens, GRAPH_TOKENS), max_batch, max_model_len,
                            prefill_kernel)]
            if cuda_graphs:
                pool = torch.cuda.graph_pool_handle()  # one pool: steps replay one at a time
                for graphs in self.graph_sets:
                    graphs.capture(pool)
                self.cuda_graphs = True

    @property
    def kernels(self) -> str:
        """Names the kernels a forward pass runs, for caches of measurements (profiles)."""
        if self.device.type == "cpu":
            return cpu_kernels.signature()
        return "+".join(["torch-kernels"] + ["triton-fused"] * (self.model.norm.kernels is not None)
                        + ["triton-attention"] * bool(self.graph_sets) + ["cuda-graphs"] * self.cuda_graphs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.default_generator
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]

    def build_metadata(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The torch path's inputs. Lists go up through pinned memory (`to_device`): a list made a CUDA
        tensor directly waits for the pass before, which asynchronous scheduling leaves computing."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        for chunk in output.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            input_ids += chunk.token_ids
            positions += range(chunk.start_pos, end)
            slot_mapping += token_slots(chunk.block_table, chunk.start_pos, end, self.block_size)
        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, self.device), prefills=[],
                                 decode_rows=None, decode_key_blocks=None, decode_mask=None,
                                 block_size=self.block_size)
        self._add_torch_metadata(output, meta)
        ids = to_device(input_ids, self.device)
        pos = to_device(positions, self.device)
        return ids, pos, meta

    def _add_torch_metadata(self, output: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Prefill spans one by one; all single-token queries as one padded batch."""
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for chunk in output.chunks:
            n = len(chunk.token_ids)
            end = chunk.start_pos + n
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(chunk.block_table)
                decode_lens.append(end)
            elif chunk.start_pos == 0:
                meta.prefills.append(PrefillSpan(row, row + n, 0, None, None))
            else:
                blocks = to_device(chunk.block_table[:-(-end // self.block_size)], self.device)
                query_pos = torch.arange(chunk.start_pos, end, device=self.device)
                mask = torch.arange(end, device=self.device)[None, :] <= query_pos[:, None]  # [chunk, end]
                meta.prefills.append(PrefillSpan(row, row + n, chunk.start_pos, blocks, mask))
            row += n
        if not decode_rows:
            return
        meta.decode_kernel = self.decode_kernel
        meta.decode_rows = to_device(decode_rows, self.device)
        max_blocks = -(-max(decode_lens) // self.block_size)
        # Padded with the scratch block, as the graphs' tables are: the padding is masked out, and a
        # request's block there would make the pass wait for a copy that writes it (`wait_for_copies`).
        scratch = self.kv_cache.scratch_block
        tables = [t[:max_blocks] + [scratch] * (max_blocks - len(t[:max_blocks])) for t in decode_tables]
        meta.decode_key_blocks = to_device(tables, self.device).view(-1)
        lens = to_device(decode_lens, self.device)
        meta.decode_lens = lens
        if meta.decode_kernel is not None:
            return
        positions = torch.arange(max_blocks * self.block_size, device=self.device)
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, while_running: Callable[[], None] | None = None,
            defer_samples: bool = False) -> RunnerOutput | PendingSamples:
        """The step: its inputs staged, its swap copies queued, its forward pass and sampling launched,
        `while_running` (host work that overlaps the pass on CUDA; on a CPU the pass has computed by then),
        its samples. With `defer_samples` they are returned still on their way (`PendingSamples`), so the
        next step can be planned and launched before they arrive (asynchronous scheduling).

        A request planned on a placeholder whose next token depends on the tokens before it on the host (a
        grammar's mask, penalties' counts, a thinking budget about to be spent) is sampled after
        `while_running`, which reads the step before's samples: the pass computes meanwhile, and the
        grammar, counts or budget take the token it read."""
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
            self._bad_words.pop(request_id, None)
            self._permitted.pop(request_id, None)
            if self.guided is not None:
                self.guided.free(request_id)
            if self.thinking is not None:
                self.thinking.free(request_id)
        inputs = time.perf_counter()
        if not output.chunks:
            after_launch = self._queue_copies(output)
            if after_launch is not None:
                after_launch()  # no pass to overlap
            if while_running is not None:
                while_running()
            self.input_host_seconds = 0.0
            return RunnerOutput(sampled={})
        # The step's inputs go up before its swap copies: on CUDA, transfers to the device may run in
        # the order queued, whatever their stream, and the pass's few kilobytes should not wait out a
        # swap-in's megabytes.
        static = next((graphs for graphs in self.graph_sets if graphs.fits(output)), None)
        if static is not None:
            size = static.stage(output)
            input_ids = static.input_ids
        else:
            input_ids, positions, meta = self.build_metadata(output)
        self._fill_placeholders(output, input_ids)
        after_launch = self._queue_copies(output)
        # The blocks this pass reads and writes; lazy, as they are only looked at while copies are in flight.
        self.kv_cache.wait_for_copies(itertools.chain.from_iterable(chunk.block_table for chunk in output.chunks))
        self.input_host_seconds = time.perf_counter() - inputs - self.copy_host_seconds
        started = self._mark()
        if static is not None:
            hidden = static.launch(size)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_cache.layer_views)
        sample_late = any(chunk.sample and chunk.token_ids[-1] == PLACEHOLDER and self._needs_last_sample(chunk)
                          for chunk in output.chunks)
        if not sample_late:
            pending = self._sample(output, hidden, started)  # queued behind the pass at once
        if after_launch is not None:
            after_launch()
        if while_running is not None:
            while_running()
        if sample_late:
            # Read by `while_running` (else here): the grammars took them. The pass's span on the device now
            # ends at this sampling, so it counts a wait for the host where the host took longer than the pass.
            self._last_samples.result()
            pending = self._sample(output, hidden, started)
        self._last_samples = pending
        scored = self._score_prompts(output, hidden)
        if pending is None:
            return RunnerOutput(sampled={}, prompt_logprobs=scored)
        pending.prompt_logprobs = scored
        if defer_samples:
            self._device_span = None  # read from `pending` once its tokens are on the host
            return pending
        return pending.result()

    def _sample(self, output: SchedulerOutput, hidden: torch.Tensor, started) -> PendingSamples | None:
        """The step's next tokens, queued on the device behind its pass (begun at `started`), or None if it
        samples none. Only the last row of each chunk that reaches its request's end produces a token."""
        rows, to_sample = [], []
        end = 0
        for chunk in output.chunks:
            end += len(chunk.token_ids)
            if chunk.sample:
                rows.append(end - 1)
                to_sample.append(chunk)
        if not to_sample:
            self._device_span = (started, self._mark())
            return None
        # A slice where the rows are the first ones in order (every decode-only step): indexing with a list
        # copies it to the device and waits for the pass to finish before the logits are even queued.
        picked = hidden[:len(rows)] if rows[-1] == len(rows) - 1 else hidden[to_device(rows, hidden.device)]
        logits = self.model.compute_logits(picked)
        params = [c.sampling_params for c in to_sample]
        generators = [self._generator(c.request_id, c.sampling_params.seed) for c in to_sample]
        histories = [self._history(c) for c in to_sample]
        banned = [self._banned(c, h) for c, h in zip(to_sample, histories)]
        permitted = [self._permitted_mask(c, logits.shape[-1]) for c in to_sample]
        grammar = self.guided.allowed_tokens(to_sample, logits.shape[-1]) if self.guided is not None else None
        allowed = grammar
        budgeted = [c for c in to_sample if self._on_budget(c)]
        if budgeted:
            allowed = self.thinking.forced_tokens(to_sample, logits.shape[-1], grammar)
        samples = sample_on_device(logits, params, generators, banned, allowed, histories,
                                   permitted if any(m is not None for m in permitted) else None)
        samples.to_host()
        self._device_span = (started, self._mark())
        constrained = [] if grammar is None else [to_sample[r] for r in grammar.rows]
        return PendingSamples([c.request_id for c in to_sample], samples, self._device_span,
                              self._taken_by(constrained, budgeted) if constrained or budgeted else None)

    def _score_prompts(self, output: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[SampledToken]]:
        """The prompt logprobs the step's chunks are to report (`ScheduledChunk.prompt_logprob_targets`)."""
        spans, row = [], 0
        for chunk in output.chunks:
            if chunk.prompt_logprob_targets is not None:
                spans.append(prompt_logprobs.PromptSpan(chunk.request_id, row, chunk.prompt_logprob_targets,
                                                        chunk.sampling_params.prompt_logprobs))
            row += len(chunk.token_ids)
        return prompt_logprobs.score(self.model.compute_logits, hidden, spans) if spans else {}

    def _taken_by(self, constrained: list, budgeted: list) -> Callable[[RunnerOutput], None]:
        """What advances the grammars of the `constrained` chunks' requests and the thinking budgets of
        the `budgeted` ones once their samples are read."""
        def take(read: RunnerOutput) -> None:
            if constrained:
                self.guided.accept(constrained, [read.sampled[c.request_id] for c in constrained])
            for chunk in budgeted:
                self.thinking.take(chunk.request_id, read.sampled[chunk.request_id].token_id)
        return take

    def _needs_last_sample(self, chunk) -> bool:
        """Whether the chunk's sampling depends on the token before it on the host (`run`)."""
        if chunk.sampling_params.needs_history:
            return True
        return self._on_budget(chunk) and self.thinking.may_force(chunk)

    def _on_budget(self, chunk) -> bool:
        """The chunk's request thinks on a budget this runner can enforce (it has the tokenizer's markers)."""
        return chunk.sampling_params.thinking_token_budget is not None and self.thinking is not None

    def _history(self, chunk) -> TokenHistory | None:
        """A penalized request's tokens for its penalties, the placeholder it was planned on (the step
        before's sample, read by now) replaced by its token."""
        if chunk.context_token_ids is None:
            return None
        tokens = chunk.context_token_ids
        if tokens[-1] == PLACEHOLDER:
            tokens = [*tokens[:-1], self._last_samples.result().sampled[chunk.request_id].token_id]
        return TokenHistory(tokens, chunk.num_output_tokens)

    def _fill_placeholders(self, output: SchedulerOutput, input_ids: torch.Tensor) -> None:
        """Where the step was planned before the last step's samples reached the host, its input is their
        token, read from the device: a `PLACEHOLDER` is only ever the last token of a request's chunk."""
        rows, sources = [], []
        row = 0
        sampled_row: dict[str, int] | None = None
        for chunk in output.chunks:
            row += len(chunk.token_ids)
            if chunk.token_ids[-1] == PLACEHOLDER:
                if sampled_row is None:
                    last = self._last_samples.request_ids if self._last_samples is not None else []
                    sampled_row = {request_id: i for i, request_id in enumerate(last)}
                source = sampled_row.get(chunk.request_id)
                if source is None:
                    raise RuntimeError(f"{chunk.request_id}: a placeholder input with no token sampled for it")
                rows.append(row - 1)
                sources.append(source)
        if rows:
            device = input_ids.device
            tokens = self._last_samples.samples.tokens
            input_ids.index_copy_(0, to_device(rows, device), tokens[to_device(sources, device)])

    def _queue_copies(self, output: SchedulerOutput) -> Callable[[], None] | None:
        """The step's swap copies, swap-out before swap-in (a block freed by a swap-out may be refilled
        in this step). On CUDA they run on a copy stream beside the forward pass (`copy_stream.py`).
        What must precede the pass is queued here: a swap-out's gather (the pass may overwrite its
        blocks), and swap-ins the pass reads (it waits for them). The rest is returned, to be queued
        once the pass is launched, so that the host's queueing overlaps the pass as the copies do
        (0.45 ms of host time for 64 blocks each way on an H100, 2026-11-28); it starts on the copy
        stream where it would have started queued here. None if nothing is left."""
        kv = self.kv_cache
        queueing = time.perf_counter()
        staged = kv.stage_blocks_out(output.swap_out)
        written = {d for _, d in output.swap_in}
        mark = kv.copy_stream.mark() if staged is not None or written else None

        def queue_transfers() -> None:
            kv.send_blocks_out(staged, after=mark)
            kv.copy_blocks_in(output.swap_in, after=mark)

        if mark is None or not written.isdisjoint(
                itertools.chain.from_iterable(chunk.block_table for chunk in output.chunks)):
            queue_transfers()
            self.copy_host_seconds, self.copy_overlapped_host_seconds = time.perf_counter() - queueing, 0.0
            return None
        self.copy_host_seconds = time.perf_counter() - queueing

        def after_launch() -> None:
            queueing = time.perf_counter()
            queue_transfers()
            self.copy_overlapped_host_seconds = time.perf_counter() - queueing
        return after_launch

    def _mark(self) -> float | torch.cuda.Event:
        """Now, on the compute stream (a timing event) on CUDA, on the host clock elsewhere."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def device_seconds(self, span: tuple | None = None) -> float:
        """Seconds of the last `run` (or of `span`, a `PendingSamples.device_span` whose tokens reached the
        host) from its forward pass to its sampled ids (0 without a pass): on CUDA the span on the compute
        stream, which the host's own work in the step (planning, inputs, outputs) overlaps only where it
        runs while the device computes; on a CPU, which computes synchronously, the wall time of the same
        calls. The step's time less this is what the host adds."""
        if span is None:
            span, self._device_span = self._device_span, None
        if span is None:
            return 0.0
        start, end = span
        if isinstance(start, float):
            return end - start
        end.synchronize()  # recorded after the sampled ids were queued to the host: already done, or nearly
        return start.elapsed_time(end) / 1e3

    def _banned(self, chunk, history: TokenHistory | None) -> list[int]:
        """The tokens the chunk may not sample: the ends of the turn before min_tokens, and the last
        token of a bad word the output so far (`history`, which such a chunk has) has begun."""
        params = chunk.sampling_params
        banned = []
        if chunk.num_output_tokens < params.min_tokens:
            banned += list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        if params.bad_words:
            if chunk.request_id not in self._bad_words:
                if self.tokenizer is None:
                    raise ValueError("bad_words need the model's tokenizer")
                self._bad_words[chunk.request_id] = bad_words.word_token_ids(self.tokenizer, params.bad_words)
            output = history.token_ids[len(history.token_ids) - history.num_output:]
            banned += bad_words.forbidden_next(self._bad_words[chunk.request_id], output)
        return banned

    def _permitted_mask(self, chunk, vocab_size: int) -> torch.Tensor | None:
        """The chunk's `allowed_token_ids` as a mask on the device (made once per request), or None."""
        ids = chunk.sampling_params.allowed_token_ids
        if ids is None:
            return None
        mask = self._permitted.get(chunk.request_id)
        if mask is None:
            mask = self._permitted[chunk.request_id] = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            mask[to_device(ids, self.device)] = True
        return mask
