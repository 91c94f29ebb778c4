"""Triton kernels for the within-chunk part of Mamba-2's scan (trireme.ops.ssd), forward and
backward, without the [Q, Q] matrices in memory.

Per chunk (N = batch x chunks of Q positions) and head h of group g:

    M_ij = (C_i . B_j) exp(cs_i - cs_j)  for j <= i, else 0          [Q, Q], never stored
    y_i  = sum_j M_ij xdt_j                                          [Q, p]

Backward, with G_ij = (dy_i . xdt_j) M_ij:
    dxdt_j = sum_{i >= j} M_ij dy_i
    dC_i = sum_j (dy_i . xdt_j) exp(cs_i - cs_j) B_j,  dB_j = sum_i (same) C_i   (per head; the
           heads of a group are summed afterwards)
    dcs_i += sum_j G_ij,  dcs_j -= sum_i G_ij

`forward_kernel` tiles rows i (a block of BLOCK positions per program) and walks the column blocks
j <= i, like a causal attention without softmax; `rows_backward` and `cols_backward` walk the same
tiles for the row-side (dC, dcs_i) and column-side (dxdt, dB, dcs_j) gradients. The plain PyTorch
reference is trireme.ops.ssd.intra_chunk; tests compare the two through Triton's CPU interpreter.
Inputs fp32, contiguous: C, B [N, Q, g, n]; cs [N, Q, h]; xdt [N, Q, h, p]. n and p are padded to
powers of two inside the kernels (masked); offsets are 64-bit (the chunk index). On CUDA tl.dot
may use TF32. Checked through the interpreter only so far: bench/ssd_layer.py reports the GPU
path's error against the plain scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tile(C, B, cs, rows, cols, nq, grp, head, Q: tl.constexpr, G: tl.constexpr,
          H: tl.constexpr, NS: tl.constexpr, BN: tl.constexpr):
    """M for rows x cols of chunk nq, head `head`: (C_i . B_j) exp(cs_i - cs_j), causal."""
    ns = tl.arange(0, BN)
    c = tl.load(C + ((nq * Q + rows[:, None]) * G + grp) * NS + ns[None, :],
                mask=(rows[:, None] < Q) & (ns[None, :] < NS), other=0.0)
    b = tl.load(B + ((nq * Q + cols[:, None]) * G + grp) * NS + ns[None, :],
                mask=(cols[:, None] < Q) & (ns[None, :] < NS), other=0.0)
    cs_i = tl.load(cs + (nq * Q + rows) * H + head, mask=rows < Q, other=0.0)
    cs_j = tl.load(cs + (nq * Q + cols) * H + head, mask=cols < Q, other=0.0)
    keep = (rows[:, None] >= cols[None, :]) & (cols[None, :] < Q) & (rows[:, None] < Q)
    decay = tl.where(keep, tl.exp(tl.where(keep, cs_i[:, None] - cs_j[None, :], 0.0)), 0.0)
    return tl.dot(c, tl.trans(b)) * decay, decay, c, b


@triton.jit
def forward_kernel(C, B, cs, X, Y, Q: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
                   NS: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
                   BLOCK: tl.constexpr):
    nq, head, blk = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    grp = head // (H // G)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    ps = tl.arange(0, BP)
    acc = tl.zeros((BLOCK, BP), dtype=tl.float32)
    for start in range(0, (blk + 1) * BLOCK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m, _, _, _ = _tile(C, B, cs, rows, cols, nq, grp, head, Q, G, H, NS, BN)
        x = tl.load(X + ((nq * Q + cols[:, None]) * H + head) * P + ps[None, :],
                    mask=(cols[:, None] < Q) & (ps[None, :] < P), other=0.0)
        acc += tl.dot(m, x)
    tl.store(Y + ((nq * Q + rows[:, None]) * H + head) * P + ps[None, :], acc,
             mask=(rows[:, None] < Q) & (ps[None, :] < P))


@triton.jit
def rows_backward(C, B, cs, X, DY, DC, DCS, Q: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
                  NS: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
                  BLOCK: tl.constexpr):
    """dC_i (per head, [N, Q, H, NS]) and sum_j G_ij into DCS [N, Q, H]."""
    nq, head, blk = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    grp = head // (H // G)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    ps, ns = tl.arange(0, BP), tl.arange(0, BN)
    dy = tl.load(DY + ((nq * Q + rows[:, None]) * H + head) * P + ps[None, :],
                 mask=(rows[:, None] < Q) & (ps[None, :] < P), other=0.0)
    dc = tl.zeros((BLOCK, BN), dtype=tl.float32)
    dcs = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, (blk + 1) * BLOCK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m, decay, _, b = _tile(C, B, cs, rows, cols, nq, grp, head, Q, G, H, NS, BN)
        x = tl.load(X + ((nq * Q + cols[:, None]) * H + head) * P + ps[None, :],
                    mask=(cols[:, None] < Q) & (ps[None, :] < P), other=0.0)
        dm = tl.dot(dy, tl.trans(x))  # [rows, cols]: dy_i . xdt_j
        dc += tl.dot(dm * decay, b)
        dcs += tl.sum(dm * m, axis=1)
    tl.store(DC + ((nq * Q + rows[:, None]) * H + head) * NS + ns[None, :], dc,
             mask=(rows[:, None] < Q) & (ns[None, :] < NS))
    tl.store(DCS + (nq * Q + rows) * H + head, dcs, mask=rows < Q)


@triton.jit
def cols_backward(C, B, cs, X, DY, DX, DB, DCS, Q: tl.constexpr, G: tl.constexpr,
                  H: tl.constexpr, NS: tl.constexpr, P: tl.constexpr, BN: tl.constexpr,
                  BP: tl.constexpr, BLOCK: tl.constexpr):
    """dxdt_j, dB_j (per head) and -sum_i G_ij added into DCS."""
    nq, head, blk = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    grp = head // (H // G)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ps, ns = tl.arange(0, BP), tl.arange(0, BN)
    x = tl.load(X + ((nq * Q + cols[:, None]) * H + head) * P + ps[None, :],
                mask=(cols[:, None] < Q) & (ps[None, :] < P), other=0.0)
    dx = tl.zeros((BLOCK, BP), dtype=tl.float32)
    db = tl.zeros((BLOCK, BN), dtype=tl.float32)
    dcs = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(blk * BLOCK, Q, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        m, decay, c, _ = _tile(C, B, cs, rows, cols, nq, grp, head, Q, G, H, NS, BN)
        dy = tl.load(DY + ((nq * Q + rows[:, None]) * H + head) * P + ps[None, :],
                     mask=(rows[:, None] < Q) & (ps[None, :] < P), other=0.0)
        dx += tl.dot(tl.trans(m), dy)
        dm = tl.dot(dy, tl.trans(x))  # [rows, cols]
        db += tl.dot(tl.trans(dm * decay), c)
        dcs -= tl.sum(dm * m, axis=0)
    out = (nq * Q + cols) * H + head
    tl.store(DX + out[:, None] * P + ps[None, :], dx, mask=(cols[:, None] < Q) & (ps[None, :] < P))
    tl.store(DB + out[:, None] * NS + ns[None, :], db,
             mask=(cols[:, None] < Q) & (ns[None, :] < NS))
    old = tl.load(DCS + out, mask=cols < Q, other=0.0)
    tl.store(DCS + out, old + dcs, mask=cols < Q)


def _sizes(C: Tensor, xdt: Tensor) -> dict:
    _, Q, G, NS = C.shape
    H, P = xdt.shape[2], xdt.shape[3]
    block = min(64, max(16, triton.next_power_of_2(Q)))
    return dict(Q=Q, G=G, H=H, NS=NS, P=P, BN=max(16, triton.next_power_of_2(NS)),
                BP=max(16, triton.next_power_of_2(P)), BLOCK=block)


class IntraChunk(torch.autograd.Function):
    """y [N, Q, H, P] from C, B [N, Q, G, NS], cs [N, Q, H], xdt [N, Q, H, P] (fp32)."""

    @staticmethod
    def forward(ctx, C: Tensor, B: Tensor, cs: Tensor, xdt: Tensor) -> Tensor:
        C, B, cs, xdt = (t.contiguous() for t in (C, B, cs, xdt))
        k = _sizes(C, xdt)
        y = torch.empty_like(xdt)
        grid = (C.shape[0], k["H"], triton.cdiv(k["Q"], k["BLOCK"]))
        forward_kernel[grid](C, B, cs, xdt, y, **k)
        ctx.save_for_backward(C, B, cs, xdt)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        C, B, cs, xdt = ctx.saved_tensors
        dy = dy.contiguous().float()
        k = _sizes(C, xdt)
        N, Q, G, NS = C.shape
        H = k["H"]
        grid = (N, H, triton.cdiv(Q, k["BLOCK"]))
        dc = torch.empty(N, Q, H, NS, device=C.device, dtype=torch.float32)
        db = torch.empty_like(dc)
        dcs = torch.empty(N, Q, H, device=C.device, dtype=torch.float32)
        dx = torch.empty_like(xdt)
        rows_backward[grid](C, B, cs, xdt, dy, dc, dcs, **k)
        cols_backward[grid](C, B, cs, xdt, dy, dx, db, dcs, **k)
        per_group = lambda t: t.view(N, Q, G, H // G, NS).sum(3)  # noqa: E731
        return per_group(dc), per_group(db), dcs, dx


def intra_chunk_triton(C: Tensor, B: Tensor, cs: Tensor, xdt: Tensor) -> Tensor:
    """The Triton within-chunk part (module docstring), differentiable."""
    return IntraChunk.apply(C, B, cs, xdt)
