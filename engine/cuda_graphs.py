"""Steps replayed from CUDA graphs (mechanism): decode-only steps, and steps with prefill chunks.

A step launches a few hundred small kernels (about fifteen a layer), and on a GPU their launch cost,
not the weights' memory traffic, set the step time: the Llama-3-8B shape measured 14.4 ms a decode step
eagerly on an H100 whose memory streams its weights in 4.4 ms, and 20-23 ms for any pass of 32 to 512
tokens. A CUDA graph records the whole forward pass once and replays it as one launch.

A graph fixes the address and shape of every tensor it touches, so a step's inputs are written into
static buffers sized for the largest step, and one graph is captured per padded size; a smaller step
replays the graph of the next size up, its extra rows padding. Two families:

- `DecodeGraphs`: steps whose every query is one token, keyed by padded batch size (1, 2, 4, then
  multiples of 8), through the paged decode kernel (`triton_decode.py`):

      buffer         shape                       padding rows
      input_ids      [max_batch]                 token 0
      positions      [max_batch]                 0
      slot_mapping   [max_batch]                 the scratch block's first slot (KVCache.scratch_block)
      block_tables   [max_batch, max_blocks]     the scratch block
      context_lens   [max_batch]                 1: the padded query attends to its own scratch slot

- `MixedGraphs`: any other step of up to `max_tokens` tokens over up to `max_seqs` sequences, keyed by
  padded token count (16, 32, 48, 64, 96, ... 1.5x and 2x steps), through the paged attention of every
  query (`triton_prefill.py`):

      buffer         shape                       padding
      input_ids      [max_tokens]                token 0
      positions      [max_tokens]                0
      slot_mapping   [max_tokens]                the scratch block's first slot
      query_start    [max_seqs + 1]              the live token count: later sequences have no rows
      seq_lens       [max_seqs]                  0
      block_tables   [max_seqs, max_blocks]      stale rows, never read
      map_seq/row    [programs for max_tokens]   row NO_ROWS: the kernel's program does nothing

  Padding rows belong to no sequence: their attention output is left unwritten and every later kernel
  works row by row, so it never reaches a live row.

Padding writes its K/V into the scratch block, which no request owns. Columns of a block table past a
row's context may hold block ids of earlier steps: every reader stops at its context's length.

Swap copies stay ordered: the runner makes the compute stream wait for the copies touching a step's
blocks before the replay is queued on it (`KVCache.wait_for_copies`), as before an eager pass.

`capture=False` runs the same static-shape code without graphs: `--enforce-eager` on a GPU (the same
kernels, launched one by one), and on the CPU how the tests check the buffers' bookkeeping and padding
against transformers, token by token, with a torch implementation of each kernel's contract.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from .attention import AttentionMetadata, PagedQueries
from .kv_cache import KVCache, token_slots
from .models.llama import LlamaForCausalLM
from .outputs import SchedulerOutput
from .triton_prefill import max_programs, program_map, queries_per_program, tiling_for


def padded_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a decode graph is captured for: 1, 2, 4, then every multiple of 8, up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def padded_token_counts(max_tokens: int) -> list[int]:
    """The token counts a mixed-step graph is captured for: 16, then each power of two from 32 and one
    and a half times it (32, 48, 64, 96, 128, 192, ...), so a step pads by at most half, up to
    max_tokens rounded up to a multiple of 16."""
    top = -(-max_tokens // 16) * 16
    counts, power = [16], 32
    while power < top:
        counts += [power, power * 3 // 2]
        power *= 2
    return [n for n in counts if n < top] + [top]


class _GraphSet:
    """Static input buffers, staged through pinned host memory, and one graph per padded size."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, sizes: list[int],
                 max_model_len: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.sizes = sizes
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_slot = kv_cache.scratch_block * self.block_size
        # Host copies of a step's inputs are rewritten only once the last step's copies out of them are
        # done (`_copied`; usually long since: its sampled tokens were read). Pinned on CUDA so their
        # copies are asynchronous.
        self.pinned = device.type == "cuda"
        self._copied = torch.cuda.Event() if self.pinned else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> torch.Tensor:
        """The step's final hidden states, one row per token of its chunks in order (then padding)."""
        return self.launch(self.stage(output))

    def stage(self, output: SchedulerOutput) -> int:
        """Write the step's inputs into the static buffers; returns the padded size to `launch`."""
        size = self.padded(self.rows_of(output))
        if self._copied is not None:
            self._copied.synchronize()
        self.write_inputs(output, size)
        if self._copied is not None:
            self._copied.record()
        return size

    @torch.inference_mode()
    def launch(self, size: int) -> torch.Tensor:
        """The forward pass over the staged inputs: the captured graph of `size`, else kernel by kernel."""
        if self.graphs:
            self.graphs[size].replay()
            return self.outputs[size]
        return self.forward(size)

    def _stage_tables(self, host: torch.Tensor, device_buffer: torch.Tensor, tables: list[list[int]],
                      pad_id: int) -> None:
        """Tables, padded with `pad_id` to the widest, as one contiguous [rows, widest] block at the host
        buffer's start: one transfer. Written from one flat array, not converted from nested lists: 64
        sequences over 2,048 tokens took 1 ms of host time a step that way (AMD EPYC, 2026-11-27)."""
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        rows, widest = len(tables), max(int(lengths.max()), 1)
        staged = host.view(-1)[:rows * widest].view(rows, widest)
        view = staged.numpy()  # numpy on the same memory: its small operations cost a tenth of torch's
        view.fill(pad_id)
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
        view[np.arange(widest) < lengths[:, None]] = flat
        device_buffer[:rows, :widest].copy_(staged, non_blocking=True)

    def capture(self, pool) -> None:
        """One graph per padded size, largest first, in `pool`. The buffers hold padding only, so warm-up
        and capture write nowhere but the scratch block."""
        with torch.inference_mode():
            for size in reversed(self.sizes):
                # Warm-up outside the capture: lazy initialisation, and Triton compiles a variant per
                # specialisation of its integer arguments.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.forward(size)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize()

    # Each family's own parts
    def rows_of(self, output: SchedulerOutput) -> int:
        raise NotImplementedError

    def write_inputs(self, output: SchedulerOutput, size: int) -> None:
        raise NotImplementedError

    def forward(self, size: int) -> torch.Tensor:
        """The model over the buffers' first rows for this size: only static shapes, graph-capturable."""
        raise NotImplementedError


class DecodeGraphs(_GraphSet):
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, max_batch: int,
                 max_model_len: int, decode_kernel):
        """decode_kernel: the attention kernel of single-token queries (`AttentionMetadata.decode_kernel`);
        None: the torch reference path over whole padded tables, fine for the CPU tests, not for graphs."""
        super().__init__(model, kv_cache, device, padded_batch_sizes(max_batch), max_model_len)
        self.max_batch = self.sizes[-1]
        self.decode_kernel = decode_kernel
        scratch = kv_cache.scratch_block
        longs = dict(dtype=torch.int64, device=device)
        # The four vectors are the rows of one buffer, copied up whole in one transfer a step (rows past
        # a step's padded size are stale, never read); the host side is written through numpy.
        self._vectors = torch.tensor([[0], [0], [self.scratch_slot], [1]], **longs).repeat(1, self.max_batch)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self._vectors
        self.block_tables = torch.full((self.max_batch, self.max_blocks), scratch, **longs)
        self.rows = torch.arange(self.max_batch, **longs)  # a decode-only step's rows are the batch, in order
        self._host_vectors = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=self.pinned)
        self._host_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int64, pin_memory=self.pinned)
        self._padding = np.array([[0], [0], [self.scratch_slot], [1]], dtype=np.int64)

    def fits(self, output: SchedulerOutput) -> bool:
        """A decode-only step small enough for the largest graph."""
        return 0 < len(output.chunks) <= self.max_batch and all(len(c.token_ids) == 1 for c in output.chunks)

    def rows_of(self, output: SchedulerOutput) -> int:
        return len(output.chunks)

    def write_inputs(self, output: SchedulerOutput, padded: int) -> None:
        bs, scratch, n = self.block_size, self.kv_cache.scratch_block, len(output.chunks)
        positions = [c.start_pos for c in output.chunks]
        tables = [c.block_table[:p // bs + 1] for c, p in zip(output.chunks, positions)]
        vectors = self._host_vectors.numpy()
        vectors[0, :n] = [c.token_ids[0] for c in output.chunks]
        vectors[1, :n] = positions
        vectors[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]  # `token_slots`
        vectors[3, :n] = vectors[1, :n] + 1
        vectors[:, n:padded] = self._padding
        self._vectors.copy_(self._host_vectors, non_blocking=True)
        self._stage_tables(self._host_tables, self.block_tables, tables + [[]] * (padded - n), scratch)

    def forward(self, padded: int) -> torch.Tensor:
        lens = self.context_lens[:padded]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded], prefills=[], decode_rows=self.rows[:padded],
            decode_key_blocks=self.block_tables[:padded].reshape(-1), decode_mask=None, decode_lens=lens,
            block_size=self.block_size, decode_kernel=self.decode_kernel)
        if self.decode_kernel is None:  # the torch reference path attends over whole padded tables, masked
            key_pos = torch.arange(self.max_blocks * self.block_size, device=lens.device)
            meta.decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
        return self.model(self.input_ids[:padded], self.positions[:padded], meta, self.kv_cache.layer_views)


class MixedGraphs(_GraphSet):
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, max_tokens: int,
                 max_seqs: int, max_model_len: int, prefill_kernel):
        """prefill_kernel: `triton_prefill.paged_prefill_attention`, or a function of the same contract
        (`attention.paged_prefill_reference` in the CPU tests)."""
        super().__init__(model, kv_cache, device, padded_token_counts(max_tokens), max_model_len)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        self.prefill_kernel = prefill_kernel
        spec = model.spec
        self.per_program = queries_per_program(spec.num_heads, spec.num_kv_heads,
                                               tiling_for(kv_cache.device_kv.dtype).rows)
        self.programs = {n: max_programs(n, max_seqs, self.per_program) for n in self.sizes}
        # The vectors live in one buffer (one copy a step); each is a fixed slice of it.
        T, S, P = self.max_tokens, max_seqs, self.programs[self.max_tokens]
        self._layout = {"input_ids": T, "positions": T, "slot_mapping": T, "query_start": S + 1, "seq_lens": S,
                        "map_seq": P, "map_row": P}
        longs = dict(dtype=torch.int64, device=device)
        self._vectors = torch.zeros(sum(self._layout.values()), **longs)
        self._host_vectors = torch.zeros(self._vectors.shape[0], dtype=torch.int64, pin_memory=self.pinned)
        start = 0
        for name, n in self._layout.items():
            setattr(self, name, self._vectors[start:start + n])
            start += n
        self.slot_mapping.fill_(self.scratch_slot)
        self.block_tables = torch.full((S, self.max_blocks), kv_cache.scratch_block, **longs)
        self._host_tables = torch.zeros(S, self.max_blocks, dtype=torch.int64, pin_memory=self.pinned)

    def fits(self, output: SchedulerOutput) -> bool:
        """A step of few enough sequences and tokens for the largest graph, within the tables' width."""
        return (0 < len(output.chunks) <= self.max_seqs and self.rows_of(output) <= self.max_tokens
                and max(c.start_pos + len(c.token_ids) for c in output.chunks) <= self.max_blocks * self.block_size)

    def rows_of(self, output: SchedulerOutput) -> int:
        return sum(len(c.token_ids) for c in output.chunks)

    def write_inputs(self, output: SchedulerOutput, size: int) -> None:
        bs = self.block_size
        ids, positions, slots, query_start, seq_lens, tables = [], [], [], [0], [], []
        for chunk in output.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            table = chunk.block_table
            ids += chunk.token_ids
            positions += range(chunk.start_pos, end)
            slots += token_slots(table, chunk.start_pos, end, bs)
            query_start.append(query_start[-1] + len(chunk.token_ids))
            seq_lens.append(end)
            tables.append(table[:-(-end // bs)])
        live, pad = len(ids), size - len(ids)
        unused = self.max_seqs - len(output.chunks)
        map_seq, map_row = program_map([len(c.token_ids) for c in output.chunks], self.per_program,
                                       self.programs[size])
        values = {"input_ids": ids + [0] * pad, "positions": positions + [0] * pad,
                  "slot_mapping": slots + [self.scratch_slot] * pad, "query_start": query_start + [live] * unused,
                  "seq_lens": seq_lens + [0] * unused, "map_seq": map_seq, "map_row": map_row}
        start, host = 0, self._host_vectors.numpy()
        for name, n in self._layout.items():
            v = values[name]
            host[start:start + len(v)] = v
            start += n
        self._vectors.copy_(self._host_vectors, non_blocking=True)
        self._stage_tables(self._host_tables, self.block_tables, tables, 0)

    def forward(self, size: int) -> torch.Tensor:
        programs = self.programs[size]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], prefills=[], decode_rows=None, decode_key_blocks=None,
            decode_mask=None, block_size=self.block_size,
            paged=PagedQueries(self.block_tables, self.query_start, self.seq_lens, self.map_seq[:programs],
                               self.map_row[:programs], self.prefill_kernel))
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_cache.layer_views)
