"""The split-K kernel's residual and norm fusions (trireme.ops.skinny_fused): through Triton's
interpreter the kernel's new = x + a W^T and its per-tile sums of squares, and its rmsnorm'd
products (plain and SwiGLU), equal the torch references, the semaphores are left at zero, and a
chain of the two equals the plain ops; the references equal x + F.linear and F.rms_norm; the
kernels compile for sm_90."""

import pytest
import torch
import torch.nn.functional as F
from interpreted import BF16_DOT, BF16_ROUND, compile_recorded_for_sm90, run_in_interpreter

from trireme.ops.skinny_fused import (
    COUNTERS,
    normed_reference,
    residual_reference,
    skinny_normed,
    skinny_residual,
)


def test_references_are_the_plain_ops():
    gen = torch.Generator().manual_seed(0)
    a, w, x = (torch.randn(*s, generator=gen) for s in ((5, 256), (128, 256), (5, 128)))
    new, sumsq = residual_reference(a, w, 4, x)
    torch.testing.assert_close(new, x + F.linear(a, w), rtol=1e-5, atol=1e-5)
    assert sumsq.shape == (2, 5)
    torch.testing.assert_close(sumsq.sum(0), new.square().sum(1), rtol=1e-5, atol=1e-5)
    g = torch.randn(128, generator=gen)
    torch.testing.assert_close(normed_reference(new, sumsq, g, 1e-5),
                               F.rms_norm(new, (128,), g, 1e-5), rtol=1e-5, atol=1e-5)
    # the ops off CUDA: their references
    counters = torch.zeros(COUNTERS, dtype=torch.int32)
    assert all(torch.equal(u, v) for u, v in zip(skinny_residual(a, w, 4, x, counters),
                                                 (new, sumsq)))
    wg = torch.randn(256, 128, generator=gen)
    act = skinny_normed(new, sumsq, g, 1e-5, wg, 1, True)
    h = F.rms_norm(new, (128,), g, 1e-5)
    gate, up = F.linear(h, wg).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-4, atol=1e-4)


SCRIPT = BF16_DOT + BF16_ROUND + """
import json, torch
import torch.nn.functional as F
from trireme.ops.skinny_gemm import skinny_mm_reference, skinny_swiglu_reference
from trireme.ops.skinny_fused import residual_reference, normed_reference
from trireme.ops.skinny_gemm_triton import skinny_mm
out = {}
gen = torch.Generator().manual_seed(1)
bf = torch.bfloat16
for m, splits, bm, swap in [(5, 2, 16, False), (20, 4, 16, True), (3, 4, 64, False)]:
    n, k = 128, 1024
    a = torch.randn(m, k, generator=gen).to(bf)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(bf)
    x = torch.randn(m, n, generator=gen).to(bf)
    counters = torch.zeros(64, dtype=torch.int32)
    new, sumsq = torch.empty_like(x), torch.empty(n // 64, m)
    part = skinny_mm(a, w, splits, 64, 128, bm, swap, residual=(x, new, sumsq, counters))
    want, want_sq = residual_reference(a, w, splits, x)
    key = f"residual {m} {splits} {bm} {swap}"
    out[key] = [(new.float() - want.float()).abs().max().item(),
                ((sumsq - want_sq).abs() / want_sq).max().item(),
                int(counters.abs().sum()),
                (part.sum(0) - (a.float() @ w.float().t())).abs().max().item()]
    # the norm: rmsnorm(new) W^T as planes, and SwiGLU's
    g = (1 + 0.1 * torch.randn(n, generator=gen)).to(bf)
    h = normed_reference(new, sumsq, g, 1e-5)
    w2 = (torch.randn(256, n, generator=gen) * 0.1).to(bf)
    for s2 in (1, 2):
        got = skinny_mm(new, w2, s2, 64, 64, bm, swap, norm=(sumsq, g, 1e-5))
        ref = skinny_mm_reference(h, w2, s2)
        out[f"norm {m} {s2} {bm} {swap}"] = (got.float() - ref.float()).abs().max().item()
    got = skinny_mm(new, w2, 1, 64, 64, bm, swap, glu=True, norm=(sumsq, g, 1e-5))[0]
    ref = skinny_swiglu_reference(h, w2)
    out[f"glu {m} {bm} {swap}"] = (got.float() - ref.float()).abs().max().item()
print(json.dumps(out))
"""


def test_fused_kernels_equal_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    import json

    out = json.loads(run_in_interpreter(SCRIPT).splitlines()[-1])
    assert len(out) == 3 * 4, out
    for key, value in out.items():
        if key.startswith("residual"):
            new_err, sq_rel, counters, part_err = value
            assert new_err <= 0.032 and sq_rel < 1e-5 and counters == 0 and part_err < 1e-2, out
        else:  # products of bf16 operands, fp32 sums in another order: a rounding apart
            assert value < 1e-3, out


def test_fused_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    import trireme.ops.skinny_gemm_triton as module

    bf = torch.bfloat16
    a, w, x = torch.empty(64, 2048, dtype=bf), torch.empty(2048, 2048, dtype=bf), torch.empty(
        64, 2048, dtype=bf)
    residual = (x, torch.empty_like(x), torch.empty(32, 64), torch.zeros(128, dtype=torch.int32))
    norm = (torch.empty(32, 64), torch.empty(2048, dtype=bf), 1e-5)

    small = (x[:16], torch.empty_like(x[:16]), torch.empty(32, 16), residual[3])

    def calls():
        module.skinny_mm(a, w, 4, 64, 128, 64, residual=residual)
        module.skinny_mm(torch.empty(16, 8192, dtype=bf), torch.empty(2048, 8192, dtype=bf), 4,
                         64, 128, 16, True, 4, 5, residual=small)  # the down tile, <= 16 rows
        module.skinny_mm(x, torch.empty(16384, 2048, dtype=bf), 1, 64, 128, 64, glu=True,
                         norm=norm)
        module.skinny_mm(x, torch.empty(3072, 2048, dtype=bf), 4, 64, 128, 64, norm=norm)

    kernels = compile_recorded_for_sm90(module, calls)
    assert len(kernels) == 4
    for kernel in kernels[:2]:  # the semaphore (one thread's acquire-release atomic), a barrier
        ptx = kernel.asm["ptx"]
        assert "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx


def test_bad_buffers_get_one_line_errors():
    pytest.importorskip("triton")
    from trireme.ops.skinny_gemm_triton import skinny_mm

    a, w, x = torch.randn(4, 256), torch.randn(128, 256), torch.randn(4, 128)
    sums, counters = torch.empty(2, 4), torch.zeros(8, dtype=torch.int32)
    good = (x, torch.empty_like(x), sums, counters)
    for bad in [(x.t().contiguous().t(), *good[1:]), (x, x[:3], sums, counters),
                (x, good[1], sums, counters.long()), (x, good[1], sums, counters[:0])]:
        with pytest.raises(ValueError, match="a residual needs splits > 1, r and new"):
            skinny_mm(a, w, 2, 64, 128, 16, residual=bad)
    with pytest.raises(ValueError, match="a residual needs splits > 1"):
        skinny_mm(a, w, 1, 64, 128, 16, residual=good)
    with pytest.raises(ValueError, match=r"the norm needs g \[256\]"):
        skinny_mm(a, w, 2, 64, 128, 16, norm=(torch.empty(2, 4), torch.ones(128), 1e-5))
    with pytest.raises(ValueError, match="a residual or a norm, not both"):
        skinny_mm(a, w, 2, 64, 128, 16, residual=good, norm=(sums, torch.ones(256), 1e-5))
