"""Fused kernels for one block of ring attention: SDPA's flash kernels, which return each query's
log-sum-exp with the output and, in their backward, take the final (out, lse) of the whole
attention, so that a block's backward yields exactly that block's share of the gradient (the
identity trireme/ops/attention_lse.py writes out in plain PyTorch).

A block reaches a kernel only when its mask is one a kernel knows: "full" (every query sees every
key) or "causal" (a square block whose mask is the lower triangle: a rank's own zigzag block,
whose positions rise in local order). Any other mask takes the plain path of attention_lse.

- CUDA, bf16 / fp16, head dim a multiple of 8 up to 256: cuDNN's kernel on Hopper and later
  (measured faster than FlashAttention-2 there), else the flash kernel (FlashAttention-2).
- CPU, any float dtype: PyTorch's CPU flash kernel, which is also how the tests check this path.
- Otherwise (CUDA fp32, odd head dims) `choose_kernel` says "plain" and attention_lse runs.

GQA: the flash kernels read key/value head h // (H / H_kv) for query head h and return dK, dV with
H_kv heads; cuDNN gets the key/value heads repeated (a copy far cheaper than the block's
attention) and its dK, dV are summed back over each group.

Shapes: q [b, H, s_q, d], k and v [b, H_kv, s_k, d]; lse [b, H, s_q] fp32 (natural log).
"""

from __future__ import annotations

import torch
from torch import Tensor

KINDS = ("full", "causal")  # the block masks a kernel can run
KERNELS = ("auto", "cudnn", "flash", "plain")  # "plain": attention_lse's reference path
aten = torch.ops.aten


def choose_kernel(kernel: str, q: Tensor) -> str:
    """The kernel that runs a block of q: "auto" takes cuDNN on Hopper and later (the fastest
    SDPA kernel there, bench/RESULTS.md), flash elsewhere on CUDA, the CPU flash kernel on the
    CPU; "plain" when no kernel takes q's device, dtype or head dim."""
    if kernel not in KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "plain" or q.device.type == "cpu":
        return "plain" if kernel == "plain" or not q.dtype.is_floating_point else "cpu"
    fits = (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
    if not fits:
        return "plain"
    if kernel == "auto":
        hopper = torch.cuda.get_device_capability(q.device) >= (9, 0)
        return "cudnn" if hopper and torch.backends.cudnn.is_available() else "flash"
    return kernel


def _expand(x: Tensor, heads: int) -> Tensor:
    """[b, H_kv, s, d] -> [b, H, s, d], each key/value head repeated for its query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(dx: Tensor, kv_heads: int) -> Tensor:
    """The gradient of _expand: [b, H, s, d] -> [b, H_kv, s, d], summed over each group."""
    b, h, s, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def fused_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, kernel: str
                        ) -> tuple[Tensor, Tensor, tuple]:
    """(out [b, H, s_q, d] in q's dtype, lse [b, H, s_q] fp32, aux) on `kernel` (cpu, flash or
    cudnn, from choose_kernel): `aux` is what the CUDA kernels' backward needs back from a
    forward (sequence offsets, RNG state and the LSE's shape, the same for every dense block
    of a kind, so one forward's serves every block)."""
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.float(), ()
    if kernel == "flash":
        out, lse, cum_q, cum_k, _, _, rng, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, rng, unused)
    # cuDNN: GQA as repeated key/value heads
    k, v = _expand(k, q.shape[1]).contiguous(), _expand(v, q.shape[1]).contiguous()
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k, v, None, True, 0.0, causal)
    return out, lse.reshape(q.shape[:3]).float(), (cum_q, cum_k, seed, offset, lse.shape[3:])


def fused_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         causal: bool, aux: tuple, kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """The block's (dq, dk, dv) given the whole attention's final `out` (q's dtype) and `lse`
    (fp32, contiguous) and its output gradient `dout`."""
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if kernel == "flash":
        cum_q, cum_k, rng, unused = aux
        grads = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng,
            unused)
        return grads[0], grads[1], grads[2]
    cum_q, cum_k, seed, offset, lse_tail = aux
    kv_heads = k.shape[1]
    k, v = _expand(k, q.shape[1]).contiguous(), _expand(v, q.shape[1]).contiguous()
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q.contiguous(), k, v, out.contiguous(),
        lse.reshape(*lse.shape, *lse_tail), seed, offset, None, cum_q, cum_k, q.shape[2],
        k.shape[2], 0.0, causal)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
