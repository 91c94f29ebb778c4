"""The dropless MoE permutation's two memory-bound passes as Triton kernels (imported only when they
run: they need Triton). trireme.ops.moe_permute has the formulas and the plain torch versions they
are tested against (tests/test_moe.py runs these kernels on the CPU through Triton's interpreter,
TRITON_INTERPRET=1).

gather_sum: one program per (token, column tile) loads its k rows (k a compile-time constant, so
the k loads are in flight together), sums them in fp32, times their weights, and stores one row:
it reads the N = T k rows once, where a gather and a sum (or torch's embedding_bag, or an
index_add) read or write them two to four times.

unpermute_backward: one program per sorted row i loads dy[token_of[i]] and out_sorted[i] once
and stores both w_sorted[i] * dy[token_of[i]] (a row of d out_sorted) and their dot product
(d w_sorted[i]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 2048  # columns per program: 16 per thread of 4 warps, two 16-byte loads in bf16
NUM_WARPS = 4


@triton.jit
def _gather_sum_kernel(
    rows_ptr, index_ptr, weights_ptr, y_ptr, hidden,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(index_ptr + t * TOP_K + j).to(tl.int64)
        x = tl.load(rows_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            x = x * tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += x
    tl.store(y_ptr + t * hidden + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward_kernel(
    dy_ptr, out_ptr, w_ptr, token_ptr, d_out_ptr, d_w_ptr, hidden, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(token_ptr + i).to(tl.int64)
    w = tl.load(w_ptr + i).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        g = tl.load(dy_ptr + t * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + i * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        dot += g * o
        tl.store(d_out_ptr + i * hidden + cols, (w * g).to(d_out_ptr.dtype.element_ty), mask=mask)
    tl.store(d_w_ptr + i, tl.sum(dot, axis=0))


def _block(hidden: int, block: int | None) -> int:
    return block or min(MAX_BLOCK, triton.next_power_of_2(max(hidden, 1)))


def gather_sum(
    rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """[T, h], rows' dtype: y[t] = sum_j weights[t, j] * rows[index[t, j]] (index [T, k]),
    summed in fp32 and rounded once."""
    rows, index = rows.contiguous(), index.contiguous()
    (t, k), hidden = index.shape, rows.shape[1]
    y = rows.new_empty(t, hidden)
    block = _block(hidden, block)
    if t > 0 and hidden > 0:
        w = weights.contiguous() if weights is not None else index  # (unread without weights)
        _gather_sum_kernel[(t, triton.cdiv(hidden, block))](
            rows, index, w, y, hidden, TOP_K=k, HAS_WEIGHTS=weights is not None, BLOCK=block,
            num_warps=NUM_WARPS,
        )
    return y


def unpermute_backward(
    dy: torch.Tensor, out_sorted: torch.Tensor, w_sorted: torch.Tensor, token_of: torch.Tensor,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d out_sorted [N, h] in its dtype, d w_sorted [N] fp32): w_sorted[i] * dy[token_of[i]]
    and <dy[token_of[i]], out_sorted[i]>, in fp32."""
    dy, out_sorted = dy.contiguous(), out_sorted.contiguous()
    n, hidden = out_sorted.shape
    d_out = torch.empty_like(out_sorted)
    d_w = torch.empty(n, device=out_sorted.device, dtype=torch.float32)
    if n > 0 and hidden > 0:
        _unpermute_backward_kernel[(n,)](
            dy, out_sorted, w_sorted.contiguous(), token_of.contiguous(), d_out, d_w, hidden,
            BLOCK=_block(hidden, block), num_warps=NUM_WARPS,
        )
    return d_out, d_w
