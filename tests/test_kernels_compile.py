"""Every Triton kernel a CUDA run takes by default compiles for sm_90 (the H100 / H200) with
Triton's real compiler, on a machine without a GPU: the launches its Python launcher makes for a
llama3-1b-sized call are recorded (tests/interpreted.py: recorded_launches) and compiled as
recorded. The interpreter tests check what the kernels compute; they run Python, so a kernel can
pass there and fail to compile (as the split-K GEMM's swapped tile once did, which kept the
serving engine from starting on the H200)."""

import pytest
import torch
from interpreted import compile_recorded_for_sm90

pytest.importorskip("triton", reason="the kernels need Triton")

BF16 = torch.bfloat16


def compiled(module_name: str, call) -> int:
    """How many launches of trireme.ops.<module_name>'s kernels `call` made, each compiled."""
    import importlib

    module = importlib.import_module(f"trireme.ops.{module_name}")
    kernels = compile_recorded_for_sm90(module, call)
    for kernel in kernels:
        assert kernel.asm["ptx"], module_name
    return len(kernels)


def test_greedy_and_finite_compiles():
    from trireme.ops.argmax_triton import PROGRAMS_PER_SM, greedy_and_finite

    logits = torch.empty(64, 128256, dtype=BF16)
    assert compiled("argmax_triton",
                    lambda: greedy_and_finite(logits, programs=PROGRAMS_PER_SM * 132)) == 2


@pytest.mark.parametrize("e5m2", [False, True])
def test_cross_entropy_kernel_compiles(e5m2):
    from trireme.ops.cross_entropy_triton import loss_and_grad

    logits = torch.empty(8, 128256, dtype=BF16)
    labels, weight = torch.zeros(8, dtype=torch.long), torch.ones(8)
    scale = torch.ones(()) if e5m2 else None
    assert compiled("cross_entropy_triton",
                    lambda: loss_and_grad(logits, labels, weight, out_scale=scale)) == 1


def test_swiglu_backward_compiles():
    from trireme.ops.swiglu_triton import swiglu_backward

    h, dy = torch.empty(64, 2 * 8192, dtype=BF16), torch.empty(64, 8192, dtype=BF16)
    assert compiled("swiglu_triton", lambda: swiglu_backward(h, dy)) == 1


def test_accumulate_compiles():
    from trireme.ops.accumulate_triton import accumulate

    dst, src = torch.zeros(1 << 16), torch.empty(1 << 16, dtype=BF16)
    assert compiled("accumulate_triton", lambda: accumulate(dst, src)) == 1


def test_moe_permutation_kernels_compile():
    from trireme.ops.moe_permute_triton import gather_sum, unpermute_backward

    rows, index = torch.empty(64, 2048, dtype=BF16), torch.zeros(32, 2, dtype=torch.long)
    weights = torch.ones(32, 2)
    dy, out = torch.empty(32, 2048, dtype=BF16), torch.empty(64, 2048, dtype=BF16)
    token_of, w_sorted = torch.zeros(64, dtype=torch.long), torch.ones(64)

    def both():
        gather_sum(rows, index, weights)
        unpermute_backward(dy, out, w_sorted, token_of)

    assert compiled("moe_permute_triton", both) == 2


def test_the_decode_step_kernels_compile_with_pdl(monkeypatch):
    """On sm_90 the decode step's own kernels launch with programmatic dependent launch
    (trireme.ops.pdl): so recorded, each compiles with its griddepcontrol wait before its first
    global load, store or async copy."""
    import importlib

    from trireme.ops.argmax_triton import PROGRAMS_PER_SM, greedy_and_finite
    from trireme.ops.paged_attention_triton import paged_decode_attention
    from trireme.ops.skinny_gemm_triton import skinny_mm

    x = torch.empty(64, 2048, dtype=BF16)
    q, pool = torch.empty(64, 32, 64, dtype=BF16), torch.empty(64 * 42, 16, 8, 64, dtype=BF16)
    tables, lengths = torch.zeros(64, 42, dtype=torch.long), torch.full((64,), 667)
    qkv = torch.empty(64, 48, 64, dtype=BF16)  # the compiled step's views of its qkv output
    new = (qkv[:, 32:40], qkv[:, 40:], torch.zeros(64, dtype=torch.long))
    calls = {"skinny_gemm_triton": lambda: (
                 skinny_mm(x, torch.empty(16384, 2048, dtype=BF16), 1, 64, 128, 64, glu=True),
                 skinny_mm(torch.empty(64, 8192, dtype=BF16), torch.empty(2048, 8192, dtype=BF16),
                           4, 64, 128, 64, num_stages=5)),
             "paged_attention_triton": lambda: (
                 paged_decode_attention(q, pool, pool, tables, lengths, variant="v2"),
                 paged_decode_attention(qkv[:, :32], pool, pool, tables, lengths,
                                        variant="v2", new=new)),
             "argmax_triton": lambda: greedy_and_finite(torch.empty(64, 128256, dtype=BF16),
                                                        programs=PROGRAMS_PER_SM * 132)}
    for name, call in calls.items():
        module = importlib.import_module(f"trireme.ops.{name}")
        monkeypatch.setattr(module, "launch_pdl", lambda t, kernels: True)
        kernels = compile_recorded_for_sm90(module, call)
        assert kernels, name
        for kernel in kernels:  # the wait comes before the kernel touches global memory
            lines = kernel.asm["ptx"].splitlines()
            wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
            memory = [i for i, line in enumerate(lines)
                      if any(op in line for op in ("ld.global", "st.global", "cp.async"))]
            assert memory and wait < min(memory), name


def _spill_bytes(ptx: str) -> int:
    """ptxas's spill stores for sm_90 (bytes)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o",
                                 "/dev/null"], capture_output=True, text=True)
    return int(re.search(r"(\d+) bytes spill stores", report.stderr).group(1))


def test_early_reads_are_l2_prefetches_before_the_wait(monkeypatch):
    """With early reads (trireme.ops.pdl.early_reads) the split-K GEMMs and the paged
    kernel prefetch into the L2, before griddepcontrol.wait, weight tiles and the first tile of
    pooled keys and values: no store, atomic or async copy comes before the wait (the paged
    kernel loads its step inputs there: 64-bit loads; q and the new keys, bf16, come after;
    the GEMMs load nothing), and no more register spills than without it; without it,
    no prefetch. (Compiled this way, without the launch's alignment hints, the shipped paged
    kernel spills already, as it did before these changes.)"""
    import trireme.ops.paged_attention_triton as paged
    import trireme.ops.skinny_gemm_triton as gemm

    x = torch.empty(64, 2048, dtype=BF16)
    q, pool = torch.empty(64, 32, 64, dtype=BF16), torch.empty(64 * 42, 16, 8, 64, dtype=BF16)
    tables, lengths = torch.zeros(64, 42, dtype=torch.long), torch.full((64,), 667)
    qkv = torch.empty(64, 48, 64, dtype=BF16)  # the decode step's views of its qkv output
    new = (qkv[:, 32:40], qkv[:, 40:], torch.zeros(64, dtype=torch.long))
    calls = {gemm: lambda: (
                 gemm.skinny_mm(x, torch.empty(16384, 2048, dtype=BF16), 1, 64, 128, 64,
                                glu=True),
                 gemm.skinny_mm(x, torch.empty(2048, 2048, dtype=BF16), 4, 64, 128, 64)),
             paged: lambda: (
                 paged.paged_decode_attention(q, pool, pool, tables, lengths, variant="v2"),
                 paged.paged_decode_attention(qkv[:, :32], pool, pool, tables, lengths,
                                              variant="v2", new=new))}
    for module, call in calls.items():
        monkeypatch.setattr(module, "launch_pdl", lambda t, kernels: True)
        spills = {}
        for early in (False, True):
            monkeypatch.setattr(module, "early_reads", lambda t, kernels, e=early: e)
            for kernel in compile_recorded_for_sm90(module, call):
                lines = kernel.asm["ptx"].splitlines()
                wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
                before = lines[:wait]
                assert not any(op in line for line in before
                               for op in ("st.global", "atom", "cp.async", "red.")), early
                assert any("prefetch.global.L2" in line for line in before) == early
                assert not any("prefetch.global.L2" in line for line in lines[wait:])
                loads = [line for line in before if "ld.global" in line]
                assert all(".b64" in line for line in loads), loads  # lengths, tables
                assert module is paged or not loads
                spills.setdefault(early, []).append(_spill_bytes(kernel.asm["ptx"]))
        assert all(e <= b for e, b in zip(spills[True], spills[False])), spills
