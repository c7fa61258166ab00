"""Decode-only steps replayed from CUDA graphs (mechanism).

At small batch a decode step launches a few hundred small kernels (about fifteen per layer), and on a
GPU their launch overhead, not the weights' memory traffic, sets the step time: the Llama-3-8B shape
measured 14.4 ms a step eagerly on an H100 whose memory streams its weights in 4.4 ms. A CUDA graph
records the whole forward pass once and replays it as one launch.

A graph fixes the address and shape of every tensor it touches, so a step's inputs are written into
static buffers sized for the largest batch, and one graph is captured per padded batch size (a batch
of 5 replays the graph of 8). Rows past the live batch are padding:

    buffer         shape                       padding rows
    input_ids      [max_batch]                 token 0
    positions      [max_batch]                 0
    slot_mapping   [max_batch]                 the scratch block's first slot (KVCache.scratch_block)
    block_tables   [max_batch, max_blocks]     the scratch block
    context_lens   [max_batch]                 1: the padded query attends to its own scratch slot
    hidden         [padded batch, hidden]      the forward's output, one tensor per graph

so padding writes its K/V into the scratch block, which no request owns, and reads only that. Columns
of a block table past a row's context may hold block ids of earlier steps: every reader stops at (the
kernel) or masks past (the torch reference) `context_lens`.

Steps with a prefill chunk (any chunk of more than one token) run eagerly. Swap copies stay ordered:
the runner makes the compute stream wait for the copies touching a step's blocks before the replay is
queued on it (`KVCache.wait_for_copies`), as before an eager pass.

`capture=False` runs the same static-shape code eagerly: on the CPU it is how the tests check the
buffers' bookkeeping and padding against the plain path, token by token.
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .kv_cache import KVCache
from .models.llama import LlamaForCausalLM
from .outputs import SchedulerOutput


def padded_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8, up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, max_batch: int,
                 max_model_len: int, decode_kernel, capture: bool):
        """decode_kernel: the attention kernel of single-token queries (`AttentionMetadata.decode_kernel`);
        None: the torch reference path over whole padded tables, fine for the CPU tests, not for graphs."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.batch_sizes = padded_batch_sizes(max_batch)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // self.block_size)
        self.decode_kernel = decode_kernel
        scratch = kv_cache.scratch_block
        longs = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_batch, **longs)
        self.positions = torch.zeros(self.max_batch, **longs)
        self.slot_mapping = torch.full((self.max_batch,), scratch * self.block_size, **longs)
        self.block_tables = torch.full((self.max_batch, self.max_blocks), scratch, **longs)
        self.context_lens = torch.ones(self.max_batch, **longs)
        self.rows = torch.arange(self.max_batch, **longs)  # a decode-only step's rows are the batch, in order
        # Host side of each step's inputs, one [4, max_batch] block (ids, positions, slots, lengths) and the
        # tables; pinned on CUDA so their copies are asynchronous. They are rewritten only once the last
        # step's copies out of them are done (`_copied`; usually long since: its sampled tokens were read).
        pinned = device.type == "cuda"
        self._host_vectors = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int64, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, output: SchedulerOutput) -> bool:
        """A decode-only step small enough for the largest graph."""
        return 0 < len(output.chunks) <= self.max_batch and all(len(c.token_ids) == 1 for c in output.chunks)

    def padded(self, batch: int) -> int:
        return next(b for b in self.batch_sizes if b >= batch)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> torch.Tensor:
        """The step's final hidden states, [len(output.chunks), hidden], one row per chunk in order."""
        batch = len(output.chunks)
        padded = self.padded(batch)
        self._write_inputs(output, padded)
        if self.graphs:
            self.graphs[padded].replay()
            return self.outputs[padded][:batch]
        return self._forward(padded)[:batch]

    def _write_inputs(self, output: SchedulerOutput, padded: int) -> None:
        bs, scratch = self.block_size, self.kv_cache.scratch_block
        if self._copied is not None:
            self._copied.synchronize()
        pad = padded - len(output.chunks)
        positions = [c.start_pos for c in output.chunks]
        widest = max(positions) // bs + 1
        tables = [c.block_table[:p // bs + 1] for c, p in zip(output.chunks, positions)]
        tables = [t + [scratch] * (widest - len(t)) for t in tables] + [[scratch] * widest] * pad
        self._host_vectors[:, :padded] = torch.tensor([
            [c.token_ids[0] for c in output.chunks] + [0] * pad,
            positions + [0] * pad,
            [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + [scratch * bs] * pad,
            [p + 1 for p in positions] + [1] * pad])
        # Staged contiguous ([padded, widest] at the buffer's start), so the copy is one transfer.
        staged_tables = self._host_tables.view(-1)[:padded * widest].view(padded, widest)
        staged_tables.copy_(torch.tensor(tables))
        for dst, src in zip((self.input_ids, self.positions, self.slot_mapping, self.context_lens), self._host_vectors):
            dst[:padded].copy_(src[:padded], non_blocking=True)
        self.block_tables[:padded, :widest].copy_(staged_tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, padded: int) -> torch.Tensor:
        """The model over the first `padded` rows of the buffers: only static shapes, graph-capturable."""
        lens = self.context_lens[:padded]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded], prefills=[], decode_rows=self.rows[:padded],
            decode_key_blocks=self.block_tables[:padded].reshape(-1), decode_mask=None, decode_lens=lens,
            block_size=self.block_size, decode_kernel=self.decode_kernel)
        if self.decode_kernel is None:  # the torch reference path attends over whole padded tables, masked
            key_pos = torch.arange(self.max_blocks * self.block_size, device=lens.device)
            meta.decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
        return self.model(self.input_ids[:padded], self.positions[:padded], meta, self.kv_cache.layer_views)

    def _capture_all(self) -> None:
        """One graph per padded batch size, largest first, all in one memory pool. The buffers hold
        padding only, so warm-up and capture write nowhere but the scratch block."""
        with torch.inference_mode():
            pool = torch.cuda.graph_pool_handle()
            for padded in reversed(self.batch_sizes):
                # Warm-up outside the capture: lazy initialisation, and Triton compiles a variant per
                # specialisation of its integer arguments (a batch of 1 is one of them).
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._forward(padded)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[padded] = self._forward(padded)
                self.graphs[padded] = graph
            torch.cuda.synchronize()
