"""The output layer's three matmuls in fp8, for the chunked fused cross-entropy (model.fp8_layers
"output"; trireme.ops.fused_cross_entropy).

Per micro batch, x [N, h] (the final norm's output) and W [vocab, h] are cast to e4m3 once, with
current per-tensor scales (one amax pass over each: x is small next to the logits, and W is cast
once per micro batch, not once per chunk). Per chunk of c tokens (q: quantized, s: its scale):

    logits  = (q(x_c) q(W)^T) / (s_x s_W)                  [c, vocab]  bf16 out, fast accumulation
    g       = dlogits = w * (softmax(logits) - onehot)     [c, vocab]  cast to e5m2 with s_g
    dx_c    = (q5(g) q(W)) / (s_g s_W)                     [c, h]
    dW     += (q5(g)^T q(x_c)) / (s_g s_x)                 [vocab, h]  summed in fp32

The gradient of the logits needs no amax pass: |softmax - onehot| <= 1, so |g| <= max(w) (the token
weights, 0/1 or the loss mask), and s_g = e5m2_max / max |w| is known before g exists; the cast is
then part of the softmax kernel, which writes q5(g) (1 byte an element) and never g:
trireme.ops.cross_entropy_triton's kernel with an e5m2 output (model.fused_cross_entropy_kernel
"triton", on CUDA) or the compiled torch version (`_loss_and_grad_e5m2` in
trireme.ops.fused_cross_entropy, the reference; both round to nearest even; eagerly, without
compile, g is rounded to the input dtype first, then cast). The true amax of a chunk is close to
that bound (1 - p of a badly predicted target), and e5m2 reaches 2^-16 of e5m2_max below it, so the
probabilities that are lost (flushed to zero) are those under about 3e-10 of the bound.

The loss itself (logsumexp and the target logit) is fp32 on the bf16 logits, as in the bf16 head.
The embedding lookup (tied or not) and evaluation (no gradient: trireme.ops.fused_cross_entropy's
loss-only path) stay bf16. A chunk whose token count is not a multiple of 16 (the last one, at
most) runs the bf16 matmuls; so does every chunk when vocab or h is not (`Float8Head.fits`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from trireme.ops.fp8 import (
    ALIGN,
    E4M3,
    E5M2,
    quantize,
    scale_from_amax,
    scaled_matmul,
)


def _transpose(t: torch.Tensor) -> torch.Tensor:
    """t^T, contiguous: [a, b] -> [b, a]."""
    return t.t().contiguous()


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


class Float8Head:
    """The fp8 operands of one micro batch's output layer and its three matmuls (chunk by chunk).

    x [N, h] and w [vocab, h] in the input dtype; token_w [N] fp32 token weights. `compile`:
    the casts and the transposing copies run as torch.compile'd kernels (on a GPU PyTorch's own
    copy kernel transposes 1-byte tensors slowly, and the eager cast is several passes)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, token_w: torch.Tensor,
                 emulate: bool, compile: bool = False) -> None:
        self.emulate, self.dtype = emulate, x.dtype
        cast = _compiled(quantize) if compile else quantize
        self.transpose = _compiled(_transpose) if compile else _transpose
        self.x_q, self.x_scale = cast(x, E4M3)  # [N, h]
        self.w_q, self.w_scale = cast(w, E4M3)  # [vocab, h], row-major: logits' operand
        self.w_q_cols = self.transpose(self.w_q).t()  # [vocab, h], column-major: dx's operand
        # |dlogits| <= max |token weight|: the e5m2 scale without looking at dlogits
        self.g_scale = scale_from_amax(token_w.abs().max().float(), E5M2)

    @staticmethod
    def fits(w: torch.Tensor, emulate: bool) -> bool:
        """Whether `_scaled_mm` takes W [vocab, h] (the emulation takes any shape)."""
        return emulate or (w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0)

    def takes(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` tokens runs in fp8."""
        return self.emulate or tokens % ALIGN == 0

    def logits(self, start: int, end: int) -> torch.Tensor:
        """[c, vocab] in the input dtype: x_c @ W^T from the fp8 copies."""
        return scaled_matmul(self.x_q[start:end], self.x_scale, self.w_q.t(), self.w_scale,
                             self.dtype, self.emulate, fast_accum=True)

    def grad_x(self, g_q: torch.Tensor, out: torch.Tensor) -> None:
        """out [c, h] = dlogits @ W, from q5(dlogits) [c, vocab]."""
        out.copy_(scaled_matmul(g_q, self.g_scale, self.w_q_cols, self.w_scale, self.dtype,
                                self.emulate))

    def add_grad_w(self, acc: torch.Tensor, g_q: torch.Tensor, start: int, end: int) -> None:
        """acc [vocab, h] fp32 += dlogits^T @ x_c, from q5(dlogits) [c, vocab]."""
        g_t = self.transpose(g_q)  # [vocab, c] row-major (_scaled_mm's first operand)
        x_c = self.transpose(self.x_q[start:end]).t()  # [c, h] column-major
        acc.add_(scaled_matmul(g_t, self.g_scale, x_c, self.x_scale, torch.float32,
                               self.emulate))
