"""FlashAttention-4 (the flash-attn-4 package, CuTe DSL kernels in `flash_attn.cute`) as an
optional attention kernel: `model.attention_backend = "fa4"`.

    out = softmax(q k^T * scale + causal) v,  lse = logsumexp(q k^T * scale + causal)  per query

The package is optional (`pip install trireme[fa4]`); trireme's SDPA path stays the fallback and
the reference (tests/test_attention.py holds both to trireme.ops.attention.reference_attention).

Two custom ops carry the kernels, so a compiled block calls each as one opaque op (no graph
break, no tracing into the CuTe DSL Python):

    trireme::fa4_forward(q, k, v, causal, scale)                -> out, lse
    trireme::fa4_backward(q, k, v, out, dout, lse, causal, scale) -> dq, dk, dv

in FlashAttention's layout: q [b, s, n_heads, d], k, v [b, s, n_kv, d] (GQA: the kernel reads the
shared heads), out [b, s, n_heads, d], lse [b, n_heads, s] fp32. The forward goes through the
package's public `flash_attn_func(..., return_lse=True)`; the backward through its
`_flash_attn_bwd` (the function flash_attn_func's own autograd calls: there is no public one), so
the extra pins the versions it was written against. Causal here is FlashAttention's convention,
bottom-right aligned; `attention()` sends only s_q == s_k calls, where it equals trireme's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from trireme.errors import ConfigError

INSTALL_HINT = ("pip install 'trireme[fa4]' (flash-attn-4 with nvidia-cutlass-dsl, CUDA, "
                "compute capability 8.0 or newer)")


class FA4Kernels(NamedTuple):
    forward: Callable  # flash_attn.cute.flash_attn_func
    backward: Callable  # flash_attn.cute.interface._flash_attn_bwd


@functools.cache
def _load() -> FA4Kernels | str:
    """The kernels, or the reason they do not import (a string)."""
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.interface import _flash_attn_bwd
    except Exception as e:  # not installed, or built for another torch / CUDA
        return f"{type(e).__name__}: {e}"
    return FA4Kernels(flash_attn_func, _flash_attn_bwd)


def fa4_available() -> bool:
    """Whether flash_attn.cute imports here."""
    return isinstance(_load(), FA4Kernels)


def require_fa4() -> FA4Kernels:
    """The kernels, or a one-line ConfigError saying how to get them."""
    found = _load()
    if isinstance(found, str):
        raise ConfigError(f"model.attention_backend = 'fa4' needs flash-attn-4, which does not "
                          f"import ({found[:200]}); {INSTALL_HINT}; or use "
                          "model.attention_backend = 'auto'")
    return found


@torch.library.custom_op("trireme::fa4_forward", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale) "
                                "-> (Tensor, Tensor)")
def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out [b, s, n_heads, d], lse [b, n_heads, s] (fp32) of FlashAttention-4's forward."""
    out, lse = require_fa4().forward(q, k, v, softmax_scale=scale, causal=causal,
                                     return_lse=True)
    return out.contiguous(), lse.contiguous()


@fa4_forward.register_fake
def _(q, k, v, causal, scale):
    b, s, n, _ = q.shape
    out = q.new_empty((b, s, n, v.shape[-1]))
    return out, q.new_empty((b, n, s), dtype=torch.float32)


@torch.library.custom_op("trireme::fa4_backward", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, "
                                "Tensor lse, bool causal, float scale) -> (Tensor, Tensor, Tensor)")
def fa4_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 dout: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (contiguous, the inputs' shapes) of FlashAttention-4's backward."""
    dq, dk, dv = require_fa4().backward(q, k, v, out, dout.contiguous(), lse,
                                        softmax_scale=scale, causal=causal)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@fa4_backward.register_fake
def _(q, k, v, out, dout, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors  # lse is an internal output: its gradient is unused
    dq, dk, dv = fa4_backward(q, k, v, out, dout, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


fa4_forward.register_autograd(_backward, setup_context=_setup_context)


def fa4_head_size_ok(head_size: int) -> bool:
    """Head sizes flash_attn.cute (4.0.0b36, `_validate_head_dims`) takes for bf16 / fp16 on
    both SM90 (8..256) and SM100 (8..128, or 256): multiples of 8 (16-byte rows) up to 128, and
    256."""
    return head_size % 8 == 0 and (8 <= head_size <= 128 or head_size == 256)


@functools.cache
def _capability_ok(device: torch.device) -> bool:
    """Compute capability 9.0 or newer (Hopper, Blackwell): the GPUs FA4's kernels target."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _on_fa4_gpu(q: torch.Tensor) -> bool:
    return q.is_cuda and _capability_ok(q.device)


def fa4_applies(q: torch.Tensor, k: torch.Tensor, dropout_p: float, q_offset: int,
                has_mask: bool) -> bool:
    """Whether a call fits FlashAttention-4 as wired here: CUDA of compute capability >= 9.0,
    bf16 / fp16, a head size it takes (fa4_head_size_ok), no dropout, no explicit mask, no
    KV-cache offset, as many queries as keys."""
    return (q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0 and q_offset == 0
            and not has_mask and q.shape[2] == k.shape[2] and fa4_head_size_ok(q.shape[-1])
            and _on_fa4_gpu(q))


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool = True) -> torch.Tensor:
    """q [b, n_heads, s, d], k, v [b, n_kv, s, d] -> [b, n_heads, s, d] (views of FlashAttention's
    [b, s, heads, d]: the model's projections already lie that way, so nothing is copied)."""
    scale = q.shape[-1] ** -0.5
    out, _ = fa4_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.transpose(1, 2)  # [b, n_heads, s, d]
