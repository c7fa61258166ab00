"""The Triton paged decode kernel (engine/triton_decode.py) against a torch reference, on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernel's Python body with numpy, program by
program, so the GPU kernel's indexing, masks and online softmax are checked on any machine.

The kernel runs in a child process started with TRITON_INTERPRET=1 (this file run as a script): the
variable is read when `triton.jit` decorates, and that includes Triton's own library functions
(`tl.sum`, `tl.zeros`, ... are `@jit` functions decorated when `triton.language` is imported). Once
Triton is imported in a process without the variable, a kernel decorated afterwards under it still
fails in the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel"), and a process
that imported Triton under the variable has no real GPU kernels left. So the pytest process never
flips it: it builds the same seeded inputs, computes the references, and compares. Shapes stay small:
the interpreter is slow.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from triton_interpreter import interpreted_outputs

F32, BF16, F16, I32, I64 = torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64
LENS = [1, 15, 16, 17, 40]  # one token, a block less one, exactly one, one past, several blocks

# name: (context lens, H, Hkv, head_dim, block_size, dtype, index dtype, q a strided view, tolerance)
CASES = {
    "G1-fp32": (LENS, 2, 2, 64, 16, F32, I64, False, 1e-5),
    "G4-fp32": (LENS, 8, 2, 64, 16, F32, I64, False, 1e-5),
    "G3-fp32": (LENS, 3, 1, 64, 16, F32, I64, False, 1e-5),
    "G1-bf16": (LENS, 2, 2, 64, 16, BF16, I32, False, 2e-2),
    "G4-bf16": (LENS, 8, 2, 64, 16, BF16, I32, False, 2e-2),
    "G3-bf16": (LENS, 3, 1, 64, 16, BF16, I32, False, 2e-2),
    "strided-q-fp32": (LENS, 4, 2, 64, 16, F32, I64, True, 1e-5),
    "strided-q-fp16": (LENS, 4, 2, 64, 16, F16, I32, True, 2e-3),
    # a head_dim that is not a power of two (masked to 64 lanes) and blocks of 8 tokens
    "D40-block8-fp32": ([1, 7, 8, 9, 20], 3, 1, 40, 8, F32, I32, False, 1e-5),
    # contexts of several 64-position tiles (the kernel's rounds), ending inside, at and past a tile's end
    "tiles-fp32": ([63, 64, 65, 150], 8, 2, 64, 16, F32, I64, False, 1e-5),
    "tiles-bf16": ([63, 64, 65, 150], 8, 2, 64, 16, BF16, I32, False, 2e-2),
    # a block size that is not a power of two (a tile ends inside a block)
    "block12-fp32": ([1, 11, 12, 13, 100], 4, 2, 64, 12, F32, I64, False, 1e-5),
}


def make_inputs(name: str):
    """(q, k_cache, v_cache, block_tables, context_lens, scale, block_size) for a case, from a fixed seed.

    Every sequence's blocks are in shuffled, non-contiguous order, and its table is padded past its end
    with a junk block whose K/V would swamp the result if read; the unused tail slots of a sequence's
    last block hold random data. A strided q is the first H * D columns of a fused qkv row."""
    lens, H, Hkv, D, block_size, dtype, index_dtype, strided, _ = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(per_seq) + 1  # at least one junk entry in every row
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    junk = order.pop()
    tables, start = [], 0
    for n in per_seq:
        tables.append(order[start:start + n] + [junk] * (max_blocks - n))
        start += n
    k_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen)
    k_cache.view(num_blocks, block_size, Hkv, D)[junk] = 50.0
    v_cache.view(num_blocks, block_size, Hkv, D)[junk] = 1e3
    B = len(lens)
    if strided:
        q = torch.randn(B, (H + 2 * Hkv) * D, generator=gen).to(dtype)[:, :H * D].view(B, H, D)
        assert not q.is_contiguous() and q.stride(0) == (H + 2 * Hkv) * D
    else:
        q = torch.randn(B, H, D, generator=gen).to(dtype)
    return (q, k_cache.to(dtype), v_cache.to(dtype), torch.tensor(tables, dtype=index_dtype),
            torch.tensor(lens, dtype=index_dtype), D ** -0.5, block_size)


def reference(q, k_cache, v_cache, block_tables, context_lens, scale, block_size):
    """Each sequence's context gathered slot by slot through its table; softmax attention in fp32."""
    B, H, D = q.shape
    G = H // k_cache.shape[1]
    out = torch.empty(B, H, D)
    for b in range(B):
        pos = torch.arange(int(context_lens[b]))
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(G, dim=1)  # [n, H, D]: query head h reads kv head h // G
        v = v_cache[slots].float().repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def run_kernel_in_interpreter(out_path: str) -> None:
    """The child's side: every case through the kernel, under TRITON_INTERPRET=1 set at process start."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from triton.runtime.interpreter import InterpretedFunction

    from infercept.engine import triton_decode

    results = {"available": triton_decode.available(),
               "interpreted": isinstance(triton_decode._paged_decode_kernel, InterpretedFunction)}
    for name in CASES:
        results[name] = triton_decode.paged_decode_attention(*make_inputs(name))
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory):
    results = interpreted_outputs(__file__, tmp_path_factory.mktemp("triton_decode"))
    assert results["available"] and results["interpreted"], "the kernel did not run in Triton's interpreter"
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(kernel_outputs, name):
    inputs = make_inputs(name)
    out, tol = kernel_outputs[name], CASES[name][-1]
    q = inputs[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), reference(*inputs), atol=tol, rtol=tol)


def test_imports_and_reports_unavailable_without_triton(monkeypatch):
    """The engine imports the module unconditionally; without Triton it loads and says it cannot run."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("triton_decode_without_triton",
                                                  importlib.util.find_spec("infercept.engine.triton_decode").origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a private copy: sys.modules keeps the real one
    assert module.triton is None and not module.available()
    with pytest.raises(RuntimeError, match="needs Triton"):
        module.paged_decode_attention(*make_inputs("G1-fp32"))


if __name__ == "__main__":
    run_kernel_in_interpreter(sys.argv[1])
