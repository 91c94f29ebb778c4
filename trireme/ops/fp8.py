"""FP8 linear layers with per-tensor current scaling (Hopper / Ada tensor cores).

A linear layer y = x W^T (+ b) computed from fp8 copies of x and W:

    s_t   = fp8_max / amax(|t|)                     per tensor, fp32, on the device
    q(t)  = fp8(clamp(t * s_t, -fp8_max, fp8_max))   e4m3 for x and W (forward)
    y     = (q(x) q(W)^T) / (s_x s_W)                torch._scaled_mm, bf16 out

and in backward, with the incoming gradient g = dL/dy quantized to e5m2:

    dx = (q5(g) q(W)) / (s_g s_W)                    [M, N] @ [N, K]
    dW = (q5(g)^T q(x)) / (s_g s_x)                  [N, M] @ [M, K]

Why e5m2 for g: gradients span a wider range than activations and weights, and with one scale
per tensor only the largest value is pinned to fp8_max; e5m2 spans about 2^32 from its largest to
its smallest (subnormal) value, e4m3 about 2^18, at the cost of one mantissa bit. That is the usual
"hybrid" recipe (Transformer Engine's and torchao's default).

The forward matmul uses Hopper's fast accumulation; the two gradient matmuls accumulate in fp32.
The saved q(x) and q(W) are reused in backward (quantization is elementwise, so the transpose of
q(t) is q of the transpose); only their memory layout is changed where `_scaled_mm` needs it: its
first operand row-major, its second column-major, every dimension a multiple of 16.

"current" scaling (model.fp8_scaling = "current"; the default "auto" is delayed, below): the scale
of each tensor is computed from that tensor in the same step, so nothing is carried between steps.
That needs amax(|t|) before the cast can start: one more pass over t that torch.compile cannot
fuse into the kernel that produces t.
Delayed scaling (model.fp8_scaling "delayed", the default) and the conversion of a model's
linears live in trireme.ops.fp8_training.

`emulate=True` is the plain reference: the same quantize -> dequantize in fp32 and a normal matmul,
on any device. It agrees with `_scaled_mm` up to the fp32 accumulation order and the final
rounding to the output dtype; tests check the two against each other and against a plain linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trireme.errors import ConfigError

E4M3 = torch.float8_e4m3fn  # forward: x and W; max 448
E5M2 = torch.float8_e5m2  # backward: dL/dy; max 57344
AMAX_EPS = 1e-12  # amax is clamped to this, so an all-zero tensor gets a finite scale
ALIGN = 16  # _scaled_mm needs every matrix dimension to be a multiple of this
AMAX_HISTORY = 16  # delayed scaling: steps of amax kept per tensor (model.fp8_amax_history)
SCALINGS = ("current", "delayed")  # model.fp8_scaling

# The transformer blocks' linears that can run in fp8 (model.fp8_layers names them by their last
# part); the embedding stays bf16, the output layer too unless fp8_layers resolves to "output"
# (its default "auto" does where the fused loss runs; trireme.ops.fp8_head).
FP8_LINEARS = ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")


def fp8_targets(layers: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The module-name suffixes of the block linears named in `layers` (model.fp8_layers)."""
    return tuple(t for t in FP8_LINEARS if t.rpartition(".")[2] in layers)


def amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as an fp32 scalar on t's device, in one reduction (no |t| temporary in eager)."""
    return torch.linalg.vector_norm(t.detach(), float("inf"), dtype=torch.float32)


def amax_by_rows(t: torch.Tensor) -> torch.Tensor:
    """amax(t) as max over rows of each row's max |t| (the same number): written this way the
    row part is a reduction over the last dim, the one a norm or a row-wise producer already
    runs, so torch.compile can fuse it into that kernel; only an [M] vector is left to reduce."""
    return torch.linalg.vector_norm(t.detach(), float("inf"), dim=-1, dtype=torch.float32).max()


def fp8_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s = fp8_max / amax(|t|): an fp32 scalar on t's device (amax clamped to AMAX_EPS)."""
    return scale_from_amax(amax(t), dtype)


def scale_from_amax(t_amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_max / amax, the amax clamped to AMAX_EPS (so an all-zero tensor's scale is finite)."""
    return torch.finfo(dtype).max / t_amax.clamp(min=AMAX_EPS)


def quantize(t: torch.Tensor, dtype: torch.dtype,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q(t), s): t * s saturated to +-fp8_max, cast to `dtype`; s = fp8_scale(t) by default."""
    if scale is None:
        scale = fp8_scale(t, dtype)
    fp8_max = torch.finfo(dtype).max
    # (t * s).clamp(-max, max) in fp32, in place on one fp32 copy (torch.compile fuses it all)
    scaled = t.detach().to(torch.float32, copy=True).mul_(scale).clamp_(-fp8_max, fp8_max)
    return scaled.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q / s in fp32."""
    return q.float() / scale


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()  # no copy when it already is


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()  # no copy when it already is


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype, emulate: bool, fast_accum: bool = False) -> torch.Tensor:
    """(a / s_a) @ (b / s_b) for fp8 `a` [m, k] and `b` [k, n], accumulated in fp32.

    `fast_accum` lets Hopper keep the running sum in the tensor cores' own (lower) precision
    instead of promoting it to fp32 every few steps of k: faster, slightly less exact. The
    emulation always sums in fp32.
    """
    if emulate:
        return (dequantize(a, a_scale) @ dequantize(b, b_scale)).to(out_dtype)
    return torch._scaled_mm(_row_major(a), _column_major(b), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class Float8Matmul(torch.autograd.Function):
    """x [M, K] @ W[N, K]^T in fp8 (e4m3 forward, e5m2 gradient), see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, emulate: bool) -> torch.Tensor:
        x_q, x_scale = quantize(x, E4M3)
        w_q, w_scale = quantize(weight, E4M3)
        ctx.save_for_backward(x_q, x_scale, w_q, w_scale)
        ctx.emulate, ctx.x_dtype, ctx.w_dtype = emulate, x.dtype, weight.dtype
        # fast accumulation in the forward only (as torchao does): gradients sum in fp32
        return scaled_matmul(x_q, x_scale, w_q.t(), w_scale, x.dtype, emulate,
                             fast_accum=True)  # [M, N]

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x_q, x_scale, w_q, w_scale = ctx.saved_tensors
        g_q, g_scale = quantize(grad_y, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dL/dx = g W: [M, N] @ [N, K]
            grad_x = scaled_matmul(g_q, g_scale, w_q, w_scale, ctx.x_dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:  # dL/dW = g^T x: [N, M] @ [M, K]
            grad_w = scaled_matmul(g_q.t(), g_scale, x_q, x_scale, ctx.w_dtype, ctx.emulate)
        return grad_x, grad_w, None



def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               emulate: bool = False, matmul: Callable | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmul in fp8; x is [..., K], weight [N, K].

    `matmul(x2d, weight)` -> [M, N] is the fp8 matmul (default Float8Matmul, current scaling).
    A call whose token count (the product of x's leading dims) is not a multiple of 16 runs as a
    plain F.linear (e.g. one token at a time in generation): `_scaled_mm` cannot take it.
    """
    k = x.shape[-1]
    x2d = x.reshape(-1, k)  # [M, K]
    if not emulate and x2d.shape[0] % ALIGN:
        return F.linear(x, weight, bias)
    if matmul is None:
        y = Float8Matmul.apply(x2d, weight, emulate)
    else:
        y = matmul(x2d, weight)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class Float8Linear(nn.Linear):
    """nn.Linear whose matmul runs in fp8 (fp8_linear); the same parameters and names, so
    checkpoints, initialization and the optimizer see an ordinary linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, emulate: bool = False) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.emulate = emulate

    @classmethod
    def from_linear(cls, linear: nn.Linear, emulate: bool = False) -> Float8Linear:
        """A Float8Linear holding `linear`'s own parameter objects (nothing copied)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                      emulate=emulate)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.emulate)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fp8 emulated" if self.emulate else ", fp8")


def check_fp8_device(device: torch.device | str, emulate: bool) -> None:
    """Raise a ConfigError unless `device` has fp8 matmuls (CUDA, compute capability >= 8.9).
    With `emulate` any device will do: the fp32 reference emulation runs instead."""
    device = torch.device(device)
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"model.precision = 'fp8' needs a CUDA GPU with fp8 tensor cores (H100 / H200, L40 "
            f"or newer); on {device.type} set model.fp8_emulate = true to run the fp32 "
            "emulation of the fp8 matmuls (slow; for tests), or use model.precision = 'bf16'"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(
            f"model.precision = 'fp8' needs compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; use "
            "model.precision = 'bf16'"
        )
