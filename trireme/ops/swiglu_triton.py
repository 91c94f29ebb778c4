"""The SwiGLU backward as one Triton kernel (imported only when it runs: it needs Triton).

h = [gate; up] is [rows, 2F] (leading dims flattened), dy is [rows, F]. Each program takes a tile
of BLOCK_ROWS rows x BLOCK_COLS columns j of F, loads gate[:, j], up[:, j] and dy[:, j] once,
and stores

    dh[:, j]     = dy * up * s * (1 + gate * (1 - s))     s = sigmoid(gate), all in fp32
    dh[:, F + j] = dy * gate * s

rounded to h's dtype. Tiles past the last row or column are masked, so any rows and any F work.
trireme.ops.swiglu has the formula's derivation and the plain torch version it is tested against
(tests/test_swiglu.py runs this kernel on the CPU through Triton's interpreter, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of each of gate, up and dy per program: 8 KiB each in bf16
NUM_WARPS = 8  # 16 elements (two 16-byte vectors in bf16) per thread and tensor


@triton.jit
def _swiglu_backward_kernel(
    h_ptr, dy_ptr, dh_ptr, num_rows, ffn,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)  # [C]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < ffn)  # [R, C]
    rows = rows.to(tl.int64)  # rows * 2F can pass 2^31
    h_offsets = rows[:, None] * (2 * ffn) + cols[None, :]  # gate[rows, cols] in h (and dh)
    dy_offsets = rows[:, None] * ffn + cols[None, :]
    gate = tl.load(h_ptr + h_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + h_offsets + ffn, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + dy_offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dy * up * s * (1.0 + gate * (1.0 - s))
    d_up = dy * gate * s
    tl.store(dh_ptr + h_offsets, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + h_offsets + ffn, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


def swiglu_backward(
    h: torch.Tensor,
    dy: torch.Tensor,
    block_cols: int | None = None,
    block_rows: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """dh = [d gate; d up] ([..., 2F], contiguous, h's dtype) for h [..., 2F] and dy [..., F].

    The tile is block_rows x block_cols (powers of two; by default up to 1024 columns and TILE
    elements in all)."""
    ffn = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * ffn).contiguous()  # [rows, 2F]
    dy2 = dy.reshape(-1, ffn).contiguous()  # [rows, F]
    num_rows = h2.shape[0]
    dh = torch.empty_like(h2)
    if block_cols is None:
        block_cols = min(1024, triton.next_power_of_2(ffn))
    if block_rows is None:
        block_rows = max(1, TILE // block_cols)
    if num_rows > 0 and ffn > 0:
        grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(ffn, block_cols))
        _swiglu_backward_kernel[grid](
            h2, dy2, dh, num_rows, ffn,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        )
    return dh.view(h.shape)
