"""Mamba-2's state-space scan (SSD, "state space duality"), in plain PyTorch, and its pieces.

Per head (h heads of p channels; B and C shared by the heads of a group, g groups of n states):

    dt_t  = clamp(softplus(dt_raw_t + dt_bias), dt_min, dt_max)          [b, l, h]
    S_t   = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T                          [b, h, p, n]
    y_t   = S_t C_t + D x_t                                               [b, l, h, p]

with A = -exp(A_log) < 0, so exp(dt A) in (0, 1] is how much of the state survives a step.

`ssd_recurrence` runs that loop one position at a time (the reference). `ssd_scan` computes the
same numbers by chunks of Q positions (the Mamba-2 paper's block decomposition): with
a_t = dt_t A and its running sum cs_t inside a chunk, the decay from position j to i >= j is
exp(cs_i - cs_j), and

    y_i = sum_{j <= i in chunk} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j     (within the chunk: [Q, Q])
        + exp(cs_i) S_prev C_i                                           (the state entering it)
    S_end = exp(cs_Q) S_prev + sum_j exp(cs_Q - cs_j) dt_j x_j B_j^T     (the state leaving it)

The within-chunk part is a masked [Q, Q] matrix product per chunk and head (memory b * l * h * Q,
linear in the sequence); the states pass from chunk to chunk through one masked [l/Q + 1, l/Q]
decay matrix per head (a few numbers next to the [b, l/Q, h, p, n] states). A sequence that is
not a multiple of Q is padded with dt = 0 (no decay, no input), which changes neither the outputs
nor the final state.

`ssd_step` is one position of the recurrence (decoding). `causal_conv1d` is the depthwise causal
convolution before the scan, `gated_rms_norm` the norm after it (both per channel / group, so a
tensor-parallel rank runs them on its own heads).

The fast GPU path is optional: `fast_ssd_kernels(device)` gives mamba_ssm's Triton chunked scan
(and causal_conv1d's convolution, when that imports too) on CUDA when the packages are installed
(`pip install mamba-ssm causal-conv1d`, the `mamba` extra), else None and the code above runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def discretize_dt(dt: Tensor, dt_bias: Tensor | None, softplus: bool,
                  limit: tuple[float, float]) -> Tensor:
    """[b, l, h] step sizes in fp32: softplus(dt + dt_bias), clamped to `limit` (min, max)."""
    dt = _wide(dt)
    if dt_bias is not None:
        dt = dt + dt_bias
    if softplus:
        dt = F.softplus(dt)
    lo, hi = limit
    if lo > 0.0 or hi < float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _wide(t: Tensor) -> Tensor:
    """t in fp32, or fp64 if it is fp64 (the tests' exact reference)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _heads_per_group(x: Tensor, groups: Tensor) -> int:
    heads, g = x.shape[2], groups.shape[2]
    if heads % g:
        raise ValueError(f"{heads} heads cannot share {g} groups of B and C")
    return heads // g


def ssd_recurrence(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The reference: the recurrence one position at a time. x [b, l, h, p], dt [b, l, h]
    (already discretized), A [h], B and C [b, l, g, n], D [h]. Returns y [b, l, h, p] and the
    final state [b, h, p, n] (fp32 math, fp64 for fp64 inputs; y in x's dtype)."""
    b, length, h, p = x.shape
    k = _heads_per_group(x, B)
    state = (_wide(initial_state) if initial_state is not None
             else _wide(x).new_zeros(b, h, p, B.shape[-1]))
    ys = []
    for t in range(length):
        y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D, k)
        ys.append(y)
    return torch.stack(ys, dim=1).to(x.dtype), state


def ssd_step(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor,
    D: Tensor | None = None, heads_per_group: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One position: x [b, h, p], dt [b, h], B and C [b, g, n], state [b, h, p, n] (fp32).
    Returns y [b, h, p] (fp32 or fp64) and the new state."""
    k = heads_per_group or x.shape[1] // B.shape[1]
    Bh = _wide(B).repeat_interleave(k, dim=1)  # [b, h, n]
    Ch = _wide(C).repeat_interleave(k, dim=1)
    decay = torch.exp(_wide(dt) * _wide(A))  # [b, h]
    xdt = _wide(x) * _wide(dt).unsqueeze(-1)  # [b, h, p]
    state = state * decay[..., None, None] + xdt.unsqueeze(-1) * Bh.unsqueeze(-2)
    y = (state * Ch.unsqueeze(-2)).sum(-1)  # [b, h, p]
    if D is not None:
        y = y + _wide(D)[:, None] * _wide(x)
    return y, state


def intra_chunk(C: Tensor, B: Tensor, cs: Tensor, xdt: Tensor) -> Tensor:
    """The within-chunk part of the scan, for N chunks of Q positions: C, B [N, Q, g, n], cs
    [N, Q, h] (the running log decay), xdt [N, Q, h, p] -> y [N, Q, h, p] with
    y_i = sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) xdt_j. Holds [N, h, Q, Q] matrices; the Triton
    kernels of trireme.ops.ssd_triton compute the same without them."""
    N, Q, g, n = C.shape
    h, p = xdt.shape[2], xdt.shape[3]
    k = h // g
    scores = torch.einsum("zign,zjgn->zgij", C, B)  # [N, g, Q, Q]
    csh = cs.view(N, Q, g, k).permute(0, 2, 3, 1)  # [N, g, k, Q]
    diff = csh.unsqueeze(-1) - csh.unsqueeze(-2)  # [N, g, k, Q(i), Q(j)]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=C.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    y = torch.einsum("zgkij,zjgkp->zigkp", decay * scores.unsqueeze(2), xdt.view(N, Q, g, k, p))
    return y.reshape(N, Q, h, p)


def ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
    D: Tensor | None = None, initial_state: Tensor | None = None, triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """The chunked scan (module docstring); the same arguments and results as `ssd_recurrence`.
    Math in fp32; y in x's dtype. `triton`: the within-chunk part by trireme.ops.ssd_triton's
    kernels (CUDA, or Triton's CPU interpreter)."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    k = _heads_per_group(x, B)
    Q = chunk_size
    pad = (-length) % Q
    xf, Bf, Cf, dtf = _wide(x), _wide(B), _wide(C), _wide(dt)
    if pad:  # dt = 0 on the padding: no decay and no input, so nothing after it changes
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
    c = (length + pad) // Q
    xc = xf.view(b, c, Q, g, k, p)  # heads as (group, head in group)
    Bc, Cc = Bf.view(b, c, Q, g, n), Cf.view(b, c, Q, g, n)
    dtc = dtf.view(b, c, Q, g, k)
    cs = torch.cumsum(dtc * _wide(A).view(g, k), dim=2)  # [b, c, Q, g, k]: log decay so far
    xdt = xc * dtc.unsqueeze(-1)  # [b, c, Q, g, k, p]

    # within each chunk: sum_j (C_i . B_j) exp(cs_i - cs_j) dt_j x_j for j <= i
    intra = intra_chunk
    if triton:  # the same numbers without the [Q, Q] matrices in memory
        from trireme.ops.ssd_triton import intra_chunk_triton as intra
    y = intra(Cc.reshape(b * c, Q, g, n), Bc.reshape(b * c, Q, g, n), cs.reshape(b * c, Q, h),
              xdt.reshape(b * c, Q, h, p)).view(b, c, Q, g, k, p)

    # each chunk's own contribution to the state at its end: [b, c, g, k, p, n]
    to_end = torch.exp(cs[:, :, -1:] - cs)  # [b, c, Q, g, k]
    chunk_states = torch.einsum("bcjgk,bcjgkp,bcjgn->bcgkpn", to_end, xdt, Bc)

    # pass the states from chunk to chunk: with T_i the log decay of chunks 0..i-1, the state
    # entering chunk i is exp(T_i) S_0 + sum_{j<i} exp(T_i - T_{j+1}) chunk_states_j, one
    # masked [c + 1, c] matrix per head (tiny next to the states) instead of a loop of c steps
    T = F.pad(torch.cumsum(cs[:, :, -1], dim=1), (0, 0, 0, 0, 1, 0))  # [b, c + 1, g, k]
    gap = T.unsqueeze(2) - T[:, 1:].unsqueeze(1)  # [b, c + 1 (i), c (j), g, k]: T_i - T_{j+1}
    before = torch.ones(c + 1, c, dtype=torch.bool, device=x.device).tril(-1)  # j < i
    passing = torch.exp(gap.masked_fill(~before[:, :, None, None], float("-inf")))
    states = torch.einsum("bijgk,bjgkpn->bigkpn", passing, chunk_states)  # [b, c + 1, ...]
    if initial_state is not None:
        start = _wide(initial_state).view(b, 1, g, k, p, n)
        states = states + torch.exp(T)[..., None, None] * start
    state, states = states[:, -1], states[:, :-1]  # the final state; those entering each chunk

    # the entering state's part of each output, decayed to position i
    y = y + torch.einsum("bcign,bcgkpn,bcigk->bcigkp", Cc, states, torch.exp(cs))
    y = y.reshape(b, c * Q, h, p)[:, :length]
    if D is not None:
        y = y + _wide(D)[:, None] * xf[:, :length]
    return y.to(x.dtype), state.reshape(b, h, p, n)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution along the sequence, then SiLU.

    x [b, l, d]; weight [d, w]; `state` [b, d, w - 1]: the w - 1 inputs before x (zeros at the
    start of a sequence). out_t = silu(bias + sum_{j<w} weight[:, j] * in_{t - (w - 1) + j}).
    Returns the output [b, l, d] and the last w - 1 inputs [b, d, w - 1] (the next state).
    """
    b, length, d = x.shape
    w = weight.shape[-1]
    xt = x.transpose(1, 2)  # [b, d, l]
    if state is None:
        state = xt.new_zeros(b, d, w - 1)
    full = torch.cat([state.to(xt.dtype), xt], dim=-1)  # [b, d, w - 1 + l]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=d)  # [b, d, l]
    return F.silu(out).transpose(1, 2), full[:, :, full.shape[-1] - (w - 1):]


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, group_size: int,
                   eps: float) -> Tensor:
    """Mamba-2's gated norm: u = x * silu(gate), each run of `group_size` channels divided by its
    root mean square, times `weight`. x, gate [..., d]; fp32 math, the result in x's dtype."""
    u = x.float() * F.silu(gate.float())
    shape = u.shape
    u = u.view(*shape[:-1], shape[-1] // group_size, group_size)
    u = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + eps)
    return (u.view(shape) * weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with its weight [d] (initialized to 1, trireme.models.init)."""

    is_norm = True

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={self.eps}"


class FastKernels(NamedTuple):
    """mamba_ssm's `mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=, dt_bias=,
    dt_softplus=, dt_limit=)` and causal_conv1d's `causal_conv1d_fn(x [b, d, l], weight [d, w],
    bias, activation=)` (None when only mamba_ssm imports)."""

    scan: Callable[..., Tensor]
    conv: Callable[..., Tensor] | None


@functools.cache
def _import_fast_kernels() -> FastKernels | None:
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or built for another torch / CUDA: the plain path
        return None
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception:
        causal_conv1d_fn = None
    return FastKernels(mamba_chunk_scan_combined, causal_conv1d_fn)


def fast_ssd_kernels(device: torch.device) -> FastKernels | None:
    """The optional fast kernels for tensors on `device` (CUDA only), or None."""
    return _import_fast_kernels() if device.type == "cuda" else None
