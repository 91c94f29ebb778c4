"""SwiGLU, y = silu(gate) * up with h = [gate; up], and its backward as one pass over memory.

    gate, up = h[..., :F], h[..., F:]                  [..., F] each
    y        = silu(gate) * up,  silu(g) = g * s,      s = sigmoid(g)
    d gate   = dy * up * s * (1 + gate * (1 - s))      (d silu(g) / dg = s * (1 + g * (1 - s)))
    d up     = dy * gate * s                           (= dy * silu(gate))
    dh       = [d gate; d up]                          [..., 2F]

`swiglu(h)` is the plain reference: autograd differentiates the chunk, silu and product.
`fused_swiglu(h)` computes the same forward with the same torch ops (torch.compile fuses it as
before), keeps only h, and its backward is the formula above, in fp32 and rounded once to h's
dtype, through the custom op `trireme::swiglu_backward`:

- on CUDA one Triton kernel (trireme.ops.swiglu_triton) reads gate, up and dy once and writes
  both halves of dh. torch.compile's own backward of the plain path ("cat" of the two halves)
  computes every output element separately and so reads gate, up and dy twice;
- elsewhere (or where Triton is missing) the same formula in plain torch.

The custom op is opaque to torch.compile (a compiled block calls it as one op, no graph break);
its fake implementation gives the output's shape for tracing. Under tensor parallelism each rank's
h is its own [gate_local; up_local], so the same code applies per rank.

Memory: eagerly, the plain path keeps gate, up and silu(gate) for its backward (h plus [..., F]);
the fused one keeps h only, as much as recomputing the activation (train.recompute = "selective")
keeps. In a compiled block torch.compile's partitioner already recomputes silu(gate) in the
backward, so there the two keep the same tensors and the gain is speed only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from trireme.ops.optional import optional_kernel

__all__ = ["swiglu", "fused_swiglu", "swiglu_backward", "swiglu_backward_reference"]


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., F] silu(gate) * up of h = [gate; up] ([..., 2F]): the reference, plain autograd."""
    gate, up = h.chunk(2, dim=-1)  # [..., F] each
    return F.silu(gate) * up


def swiglu_backward_reference(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dh = [d gate; d up] ([..., 2F], h's dtype) for h = [gate; up] and dy = dL/dy ([..., F]):
    the formula in fp32, rounded once."""
    gate, up = h.float().chunk(2, dim=-1)  # [..., F] each
    dy = dy.float()
    s = torch.sigmoid(gate)
    d_gate = dy * up * s * (1 + gate * (1 - s))
    d_up = dy * gate * s
    return torch.cat([d_gate, d_up], dim=-1).to(h.dtype)


@torch.library.custom_op(
    "trireme::swiglu_backward", mutates_args=(), schema="(Tensor h, Tensor dy) -> Tensor"
)  # the schema spelled out: the annotations are strings here (from __future__ import annotations)
def swiglu_backward(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dh ([..., 2F], contiguous, h's dtype) of SwiGLU: one Triton kernel on CUDA (this is the
    implementation for the other devices: the plain formula)."""
    return swiglu_backward_reference(h, dy).contiguous()


@swiglu_backward.register_fake
def _(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return h.new_empty(h.shape)  # contiguous, as the real implementations return it


@optional_kernel("model.fused_swiglu's SwiGLU backward runs as plain torch ops")
def _triton_launcher():
    """trireme.ops.swiglu_triton.swiglu_backward, or None (with a warning) without Triton."""
    from trireme.ops.swiglu_triton import swiglu_backward as launch
    return launch


@swiglu_backward.register_kernel("cuda")
def _(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    launch = _triton_launcher()
    if launch is None:
        return swiglu_backward_reference(h, dy).contiguous()
    with torch.cuda.device(h.device):  # Triton launches on the current device
        return launch(h, dy)


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return swiglu(h)

    @staticmethod
    @once_differentiable  # the custom op has no autograd formula: no double backward
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, dy)


def fused_swiglu(h: torch.Tensor) -> torch.Tensor:
    """swiglu(h), keeping only h; the backward is one `trireme::swiglu_backward` call."""
    return _FusedSwiGLU.apply(h)
