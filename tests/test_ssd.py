"""Mamba-2's scan (trireme.ops.ssd): the chunked scan against the step-by-step recurrence,
forward and backward, the Triton within-chunk kernels against the plain code (CPU interpreter),
and the convolution and gated norm against their definitions."""

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_in_interpreter

from trireme.ops.ssd import (
    causal_conv1d,
    discretize_dt,
    gated_rms_norm,
    ssd_recurrence,
    ssd_scan,
)


def _inputs(b, length, h, p, g, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x = rand(b, length, h, p)
    dt = discretize_dt(rand(b, length, h), rand(h), True, (0.0, float("inf"))).to(dtype)
    A = -torch.exp(rand(h, scale=0.5))
    B, C = rand(b, length, g, n), rand(b, length, g, n)
    D = rand(h)
    state = rand(b, h, p, n)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, state)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("sizes", [
    # b, l, h, p, g, n, chunk
    (2, 13, 4, 3, 2, 5, 4),   # l not a multiple of the chunk
    (1, 16, 6, 2, 1, 3, 8),   # one group for all heads
    (3, 7, 2, 4, 2, 2, 16),   # one chunk, shorter than the chunk size
    (1, 9, 3, 2, 3, 4, 1),    # chunks of one position
])
def test_chunked_scan_equals_the_recurrence_forward_and_backward(sizes, dtype, tol):
    b, length, h, p, g, n, chunk = sizes
    inputs = _inputs(b, length, h, p, g, n, dtype, seed=sum(sizes))
    x, dt, A, B, C, D, state = inputs
    y_ref, s_ref = ssd_recurrence(x, dt, A, B, C, D, initial_state=state)
    y, s = ssd_scan(x, dt, A, B, C, chunk, D, initial_state=state)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)
    probe_y, probe_s = torch.randn_like(y), torch.randn_like(s)
    grads_ref = torch.autograd.grad((y_ref * probe_y).sum() + (s_ref * probe_s).sum(), inputs)
    grads = torch.autograd.grad((y * probe_y).sum() + (s * probe_s).sum(), inputs)
    for name, got, want in zip("x dt A B C D state".split(), grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * 10, msg=name)


def test_a_scan_split_in_two_continues_from_its_state():
    """Running the first part, then the rest from the state it left, is the whole scan (what
    decoding relies on); the default initial state is zero."""
    x, dt, A, B, C, D, _ = (t.detach() for t in _inputs(2, 11, 4, 2, 2, 3, torch.float64))
    y, s = ssd_scan(x, dt, A, B, C, 4, D)
    y1, s1 = ssd_scan(x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], 4, D)
    y2, s2 = ssd_scan(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], 4, D, initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(s2, s)


def test_dt_is_softplus_of_raw_plus_bias_clamped():
    raw, bias = torch.tensor([[[-3.0, 0.0, 5.0]]]), torch.tensor([0.5, 0.0, -1.0])
    dt = discretize_dt(raw, bias, True, (0.1, 2.0))
    assert torch.allclose(dt, F.softplus(raw + bias).clamp(0.1, 2.0))
    assert dt.min() == 0.1 and dt.max() == 2.0
    assert torch.equal(discretize_dt(raw, None, False, (0.0, float("inf"))), raw)


def test_causal_conv1d_is_causal_and_continues_from_its_state():
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 9, 5), torch.randn(5, 4), torch.randn(5)
    out, state = causal_conv1d(x, w, bias)
    # by definition: out_t = silu(bias + sum_j w[:, j] x_{t - 3 + j}), x before 0 is zero
    padded = F.pad(x, (0, 0, 3, 0))
    want = torch.stack([F.silu(bias + (w.t() * padded[:, t:t + 4]).sum(1)) for t in range(9)], 1)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))
    a, st = causal_conv1d(x[:, :4], w, bias)
    rest, _ = causal_conv1d(x[:, 4:], w, bias, st)
    torch.testing.assert_close(torch.cat([a, rest], 1), out)


def test_gated_rms_norm_normalizes_each_group():
    torch.manual_seed(0)
    x, z, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    out = gated_rms_norm(x, z, w, group_size=4, eps=1e-6)
    u = x * F.silu(z)
    for grp in (slice(0, 4), slice(4, 8)):
        want = u[:, grp] / u[:, grp].square().mean(-1, keepdim=True).add(1e-6).sqrt() * w[grp]
        torch.testing.assert_close(out[:, grp], want)


INTERPRETED = """
import torch
from trireme.ops.ssd import discretize_dt, intra_chunk, ssd_recurrence, ssd_scan
from trireme.ops.ssd_triton import intra_chunk_triton
torch.manual_seed(0)
for N, Q, g, n, h, p in [(1, 32, 2, 16, 4, 16), (1, 24, 1, 20, 2, 12)]:  # ragged n, p, Q
    C, B, x = torch.randn(N, Q, g, n), torch.randn(N, Q, g, n), torch.randn(N, Q, h, p)
    cs = torch.cumsum(-torch.rand(N, Q, h) * 0.3, 1)
    plain = [t.clone().requires_grad_() for t in (C, B, cs, x)]
    fused = [t.clone().requires_grad_() for t in (C, B, cs, x)]
    y, y_fused = intra_chunk(*plain), intra_chunk_triton(*fused)
    dy = torch.randn_like(y)
    torch.testing.assert_close(y_fused, y, rtol=1e-4, atol=1e-4)
    for name, got, want in zip("C B cs x".split(), torch.autograd.grad(y_fused, fused, dy),
                               torch.autograd.grad(y, plain, dy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, msg=name)
# the whole scan with the kernels against the step-by-step recurrence
b, L, h, p, g, n = 1, 37, 2, 16, 1, 16
x, B, C = torch.randn(b, L, h, p), torch.randn(b, L, g, n), torch.randn(b, L, g, n)
dt = discretize_dt(torch.randn(b, L, h), torch.randn(h), True, (0.0, float("inf")))
A, D, s0 = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(b, h, p, n)
inputs = [t.requires_grad_() for t in (x, dt, A, B, C)]
y, s = ssd_scan(*inputs, 16, D, initial_state=s0, triton=True)
y_ref, s_ref = ssd_recurrence(*inputs, D, initial_state=s0)
torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
probe = torch.randn_like(y)
for got, want in zip(torch.autograd.grad((y * probe).sum(), inputs),
                     torch.autograd.grad((y_ref * probe).sum(), inputs)):
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
print("ok")
"""


def test_triton_within_chunk_kernels_equal_the_reference():
    """trireme.ops.ssd_triton's forward and both backward kernels against the plain within-chunk
    part, and the scan with them against the recurrence, through Triton's CPU interpreter."""
    pytest.importorskip("triton", reason="the SSD kernels need Triton")
    assert run_in_interpreter(INTERPRETED) == "ok"
