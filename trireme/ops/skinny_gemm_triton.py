"""y = x W^T for few rows as one Triton kernel, split over K (imported only where it runs: it
needs Triton). trireme.ops.skinny_gemm has the dispatcher, the plan and the reference.

x [M, K] (unit column stride, rows at any stride), W [N, K] contiguous, M small (a decode step's
batch). Such a product reads W once and is bound by that read; cuBLAS runs the decode step's
smaller ones (2048 x 2048, 3072 x 2048, 2048 x 8192) well below the memory bandwidth on the
H200, where the larger ones come near it (bench/gemm_layouts.py): too few programs read too few
bytes at a time.
Here program (n, s, m) takes rows n * BLOCK_N .. + BLOCK_N of W and the s-th of SPLITS equal
chunks of K (k_chunk columns, whole BLOCK_K tiles), multiplies them by rows m * BLOCK_M .. of x
and writes its partial sum, fp32 (bf16 / fp16 operands, fp32 accumulation in the tensor cores),

    part[s, m, n] = sum over k in chunk s of x[m, k] W[n, k]

and y = sum_s part[s] is summed by the caller in a fixed order (deterministic, no atomics; in a
compiled decode step Inductor fuses that sum into the next kernel). With SPLITS = 1 the program
writes y itself, in the output dtype. SWAP computes the transposed tile, acc[n, m] = W x^T
(W's rows fill the tensor core's larger M side: for M of 1-16 the x tile is mostly padding
either way, and which is faster is the sweep's to say: bench/skinny_gemm.py). Rows of x past M
are masked (read as 0, not written). GLU (SwiGLU's first layer, one split) multiplies x by the
gate rows W[n] and the up rows W[N/2 + n] of its tile in two accumulators and writes
silu(gate) * up, rounded once: the [M, N] product and the activation's kernel are never made.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelSettings
from trireme.ops.pdl import early_reads, launch_pdl
from trireme.ops.pdl_triton import enter, l2_prefetch


@triton.jit
def _tile_dot(x, w, acc, SWAP: tl.constexpr):
    """acc + x w^T for x [BM, BK], w [BN, BK]: acc [BM, BN], or [BN, BM] transposed (SWAP).
    One return after the branch: Triton's compiler (3.6-3.9) builds the statements after a
    return inside a constexpr `if` too (here: a dot of the other shape, a compile error), which
    the interpreter, a plain Python run, never shows (tests/test_skinny_gemm.py compiles the
    kernel for sm_90 as well)."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["m_rows"])
def _skinny_kernel(x_ptr, w_ptr, out_ptr, m_rows, n_cols, k_chunk, x_row_stride,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP: tl.constexpr, K: tl.constexpr, GLU: tl.constexpr,
                   PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """out[s, m, n] (module docstring) for this program's BLOCK_M x BLOCK_N tile and chunk s;
    with GLU (one chunk) silu(x W_gate^T) * (x W_up^T), W_up's rows n_cols below W_gate's.
    PREFETCH (with PDL; 2-byte weights, BLOCK_K >= 64): the first two weight tiles' 128-byte
    lines are prefetched into the L2 before the wait, while the kernel before this one
    finishes."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_chunk + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K  # [BN, 1]
    up_rows = n_cols.to(tl.int64) * K  # W_up's offset from W_gate's
    if PREFETCH:
        lines = split * k_chunk + tl.minimum(tl.arange(0, 4 * BLOCK_K // 128) * 64,
                                             k_chunk - 64)  # 128-byte lines, in the chunk
        l2_prefetch(w_rows + lines[None, :])
        if GLU:
            l2_prefetch(w_rows + up_rows + lines[None, :])
    enter(PDL)  # nothing before this reads what an earlier kernel writes
    x_at = x_ptr + rows[:, None].to(tl.int64) * x_row_stride + ks[None, :]  # [BM, BK]
    w_at = w_rows + ks[None, :]  # [BN, BK]
    live = rows[:, None] < m_rows
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = acc  # GLU's second accumulator (unused otherwise)
    for _ in range(0, k_chunk, BLOCK_K):
        x = tl.load(x_at, mask=live, other=0.0)
        acc = _tile_dot(x, tl.load(w_at), acc, SWAP)
        if GLU:
            up = _tile_dot(x, tl.load(w_at + up_rows), up, SWAP)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if GLU:
        acc = acc * tl.sigmoid(acc) * up  # silu(gate) * up, in fp32
    if SWAP:
        acc = tl.trans(acc)
    plane = split.to(tl.int64) * m_rows * n_cols
    out_at = out_ptr + plane + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=live)


def skinny_mm(x: torch.Tensor, weight: torch.Tensor, splits: int, block_n: int, block_k: int,
              block_m: int = 16, swap: bool = False, num_warps: int = 4,
              num_stages: int = 4, glu: bool = False,
              kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """part [splits, M, N] fp32 (splits > 1) or y [1, M, N] in x's dtype (splits == 1) for
    x [M, K], weight [N, K] (module docstring); with `glu` (splits 1) y [1, M, N / 2] =
    silu(x W_gate^T) * (x W_up^T) for weight = [W_gate; W_up], rounded once. The caller checks
    the shapes divide: N (N / 2 with glu) % block_n == 0 and K % (splits * block_k) == 0.
    `kernels`: whether to launch with PDL and early reads (trireme.ops.pdl)."""
    m_rows, k = x.shape
    n_cols = weight.shape[0] // 2 if glu else weight.shape[0]
    if (n_cols % block_n or k % (splits * block_k) or weight.shape[1] != k or x.stride(1) != 1
            or not weight.is_contiguous() or (glu and splits != 1)):
        raise ValueError(f"skinny_mm: x {tuple(x.shape)} (strides {x.stride()}) and weight "
                         f"{tuple(weight.shape)} do not tile as {splits} splits of "
                         f"{block_n} x {block_k}{' (glu: 1 split)' if glu else ''}")
    dtype = torch.float32 if splits > 1 else x.dtype
    out = torch.empty(splits, m_rows, n_cols, dtype=dtype, device=x.device)
    if m_rows == 0:
        return out
    grid = (n_cols // block_n, splits, triton.cdiv(m_rows, block_m))
    # Triton launches on the current device (the interpreter: the CPU)
    where = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    pdl = launch_pdl(x, kernels)
    with where:
        _skinny_kernel[grid](x, weight, out, m_rows, n_cols, k // splits, x.stride(0),
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, K=k,
                             GLU=glu, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
                             launch_pdl=pdl, PREFETCH=early_reads(x, kernels) and block_k >= 64
                             and x.element_size() == 2)
    return out
