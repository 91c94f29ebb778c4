"""The fp32 main-gradient accumulation: the Triton kernel against torch's add (through Triton's
CPU interpreter), and which tensors take the fast path."""

import textwrap

import pytest
import torch
from interpreted import run_in_interpreter

from trireme.ops.accumulate import accumulate, fast_path_applies

INTERPRETED = textwrap.dedent("""
    import torch
    from trireme.ops.accumulate_triton import BLOCK, accumulate

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1, BLOCK - 1, 2 * BLOCK + 5):  # a ragged last block
            dst = torch.randn(n, generator=gen)
            src = torch.randn(n, generator=gen).to(dtype)
            want = dst + src.float()
            accumulate(dst, src)
            assert torch.equal(dst, want), (dtype, n)  # one fp32 add: exactly torch's
    print("ok")
""")


def test_accumulate_kernel_in_interpreter():
    pytest.importorskip("triton", reason="the accumulation kernel needs Triton")
    assert run_in_interpreter(INTERPRETED) == "ok"


def test_the_plain_path_runs_off_cuda_and_adds():
    dst, src = torch.zeros(5), torch.arange(5.0).to(torch.bfloat16)
    assert not fast_path_applies(dst, src)  # the CPU: torch's add
    accumulate(dst, src)
    accumulate(dst, src)
    assert dst.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
