"""dst += src for an fp32 `dst` and a bf16 / fp16 `src`, as one vectorized Triton kernel (imported
only where it runs: it needs Triton). torch's own `dst.add_(src)` with two dtypes falls back to its
unrolled, non-vectorized elementwise kernel, about half the memory bandwidth; for the main-gradient
accumulation of a large model (every parameter, every micro batch) that is a tenth of a step.
trireme.ops.accumulate has the plain version it is tested against (through Triton's interpreter
on the CPU, TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _accumulate_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dst = tl.load(dst_ptr + offsets, mask=mask)
    src = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(dst_ptr + offsets, dst + src, mask=mask)


def accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src in place (both contiguous, the same number of elements, dst fp32)."""
    n = dst.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](dst, src, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
