"""Executes a SchedulerOutput on the real model: build batch tensors, forward, sample (mechanism)."""
from __future__ import annotations

import itertools

import torch

from . import cpu_kernels
from .attention import AttentionMetadata, PrefillSpan, VarlenMetadata, flash_attn_varlen
from .decode_graphs import DecodeGraphs
from .guided_decoding import GuidedDecoder
from .kv_cache import KVCache
from .models.llama import LlamaForCausalLM
from .outputs import RunnerOutput, SchedulerOutput
from .sampler import TokenHistory, sample, to_device


def gpu_decode_kernel():
    """Triton's paged decode attention where Triton runs here, else None (imported only on CUDA hosts:
    importing Triton takes a third of a second)."""
    from . import triton_decode

    return triton_decode.paged_decode_attention if triton_decode.available() else None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 eos_token_ids: frozenset[int], seed: int = 0, tokenizer=None, cuda_graphs: bool = False,
                 max_batch: int = 0, max_model_len: int = 0):
        """cuda_graphs: replay decode-only steps of up to `max_batch` requests from CUDA graphs (needs
        CUDA and Triton; otherwise every step runs eagerly)."""
        self.model = model
        # Grammar-constrained sampling needs the tokenizer (token bytes); without one, no grammars.
        self.guided = GuidedDecoder(tokenizer, eos_token_ids) if tokenizer is not None else None
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        dtype = kv_cache.device_kv.dtype
        self.use_varlen = flash_attn_varlen() is not None and device.type == "cuda" and dtype != torch.float32
        self.decode_kernel = gpu_decode_kernel() if device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.decode_kernel is not None:
            self.graphs = DecodeGraphs(model, kv_cache, device, max_batch, max_model_len, self.decode_kernel,
                                       capture=True)

    @property
    def kernels(self) -> str:
        """Names the kernels a forward pass runs, for caches of measurements (profiles)."""
        if self.device.type == "cpu":
            return cpu_kernels.signature()
        return "+".join(["torch-kernels"] + ["triton-fused"] * (self.model.norm.kernels is not None)
                        + ["triton-decode"] * (self.decode_kernel is not None)
                        + ["flash-attn"] * self.use_varlen + ["cuda-graphs"] * (self.graphs is not None))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.default_generator
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def build_varlen_metadata(self, output: SchedulerOutput) -> VarlenMetadata:
        key_slots: list[int] = []
        cu_q, cu_k = [0], [0]
        for chunk in output.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            key_slots += self._slots(chunk.block_table, 0, end)
            cu_q.append(cu_q[-1] + len(chunk.token_ids))
            cu_k.append(cu_k[-1] + end)
        as_i32 = dict(device=self.device, dtype=torch.int32)
        return VarlenMetadata(
            key_slots=torch.tensor(key_slots, device=self.device), cu_seqlens_q=torch.tensor(cu_q, **as_i32),
            cu_seqlens_k=torch.tensor(cu_k, **as_i32),
            max_seqlen_q=max(len(c.token_ids) for c in output.chunks),
            max_seqlen_k=max(c.start_pos + len(c.token_ids) for c in output.chunks))

    def build_metadata(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        for chunk in output.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            input_ids += chunk.token_ids
            positions += range(chunk.start_pos, end)
            slot_mapping += self._slots(chunk.block_table, chunk.start_pos, end)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, device=self.device), prefills=[],
                                 decode_rows=None, decode_key_blocks=None, decode_mask=None,
                                 block_size=self.block_size)
        if self.use_varlen:
            meta.varlen = self.build_varlen_metadata(output)
        else:
            self._add_torch_metadata(output, meta)
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
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
                blocks = torch.tensor(chunk.block_table[:-(-end // self.block_size)], device=self.device)
                query_pos = torch.arange(chunk.start_pos, end, device=self.device)
                mask = torch.arange(end, device=self.device)[None, :] <= query_pos[:, None]  # [chunk, end]
                meta.prefills.append(PrefillSpan(row, row + n, chunk.start_pos, blocks, mask))
            row += n
        if not decode_rows:
            return
        meta.decode_kernel = self.decode_kernel
        meta.decode_rows = torch.tensor(decode_rows, device=self.device)
        max_blocks = -(-max(decode_lens) // self.block_size)
        tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in decode_tables]
        meta.decode_key_blocks = torch.tensor(tables, device=self.device).view(-1)
        lens = torch.tensor(decode_lens, device=self.device)
        meta.decode_lens = lens
        if meta.decode_kernel is not None:
            return
        positions = torch.arange(max_blocks * self.block_size, device=self.device)
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> RunnerOutput:
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
            if self.guided is not None:
                self.guided.free(request_id)
        # Copies first, swap-out before swap-in: a block freed by a swap-out may be refilled in this
        # step. On CUDA they run on a copy stream, overlapping the forward pass unless it touches them.
        self.kv_cache.copy_blocks_out(output.swap_out)
        self.kv_cache.copy_blocks_in(output.swap_in)
        if not output.chunks:
            return RunnerOutput(sampled={})
        # The blocks this pass reads and writes (block 0 also pads eager decode block tables); lazy, as
        # they are only looked at while copies are in flight.
        blocks = itertools.chain([0], *(chunk.block_table for chunk in output.chunks))
        if self.graphs is not None and self.graphs.fits(output):
            self.kv_cache.wait_for_copies(blocks)
            hidden = self.graphs.run(output)
        else:
            input_ids, positions, meta = self.build_metadata(output)
            self.kv_cache.wait_for_copies(blocks)
            hidden = self.model(input_ids, positions, meta, self.kv_cache.layer_views)
        # Only the last row of each chunk that reaches its request's end produces a token.
        rows, to_sample = [], []
        end = 0
        for chunk in output.chunks:
            end += len(chunk.token_ids)
            if chunk.sample:
                rows.append(end - 1)
                to_sample.append(chunk)
        if not to_sample:
            return RunnerOutput(sampled={})
        # A slice where the rows are the first ones in order (every decode-only step): indexing with a list
        # copies it to the device and waits for the pass to finish before the logits are even queued.
        picked = hidden[:len(rows)] if rows[-1] == len(rows) - 1 else hidden[to_device(rows, hidden.device)]
        logits = self.model.compute_logits(picked)
        params = [c.sampling_params for c in to_sample]
        generators = [self._generator(c.request_id, c.sampling_params.seed) for c in to_sample]
        banned = [self._banned(c) for c in to_sample]
        allowed = self.guided.allowed_tokens(to_sample, logits.shape[-1]) if self.guided is not None else None
        histories = [TokenHistory(c.context_token_ids, c.num_output_tokens) if c.context_token_ids is not None
                     else None for c in to_sample]
        tokens = sample(logits, params, generators, banned, allowed, histories)
        if allowed is not None:
            self.guided.accept(to_sample, tokens)
        return RunnerOutput(sampled={c.request_id: t for c, t in zip(to_sample, tokens)})

    def _banned(self, chunk) -> list[int]:
        params = chunk.sampling_params
        if chunk.num_output_tokens >= params.min_tokens:
            return []
        return list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
