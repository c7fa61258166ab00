"""Seeded requests on vLLM's CPU worker: loaded into vLLM's worker process as its worker extension
(`worker_extension_cls`, set by worker.py where vLLM runs on a CPU).

vLLM 0.32's model runner rewinds the random generator of a request whose sampled token it discards (a
step that computed a prefill chunk other than the prompt's last) with `Generator.set_offset`, which a
CUDA generator has and a CPU one does not: "CPU Generator does not use offset" kills the engine core at
the first request with a `seed` whose prompt is computed in more than one step (longer than the step's
token budget, or sharing it with other requests). The CPU runner inherits that code unchanged. Importing
this module makes it leave CPU generators alone there: such a request is served, and its samples then
depend on how its prompt was split into steps (the discarded draw is not taken back), where a CUDA
generator's would not. Nothing else changes; a GPU worker never loads this.
"""
from __future__ import annotations

import functools

import numpy as np
from vllm.v1.worker.cpu_model_runner import CPUModelRunner


class CpuSeededSampling:
    """The worker extension (nothing to add to the worker: importing the module is the fix)."""


def _leaving_cpu_generators(bookkeeping):
    @functools.wraps(bookkeeping)
    def wrapped(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
        held = {int(i): generators.pop(int(i)) for i in discarded
                if int(i) in generators and generators[int(i)].device.type == "cpu"}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)
    wrapped.leaves_cpu_generators = True
    return wrapped


if not getattr(CPUModelRunner._bookkeeping_sync, "leaves_cpu_generators", False):
    CPUModelRunner._bookkeeping_sync = _leaving_cpu_generators(CPUModelRunner._bookkeeping_sync)
