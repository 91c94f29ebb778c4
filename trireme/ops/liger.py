"""Optional Triton kernels from the liger-kernel package, each named in `model.kernels`:

    liger_rmsnorm        y = x / sqrt(mean(x^2) + eps) * w          (trireme.ops.norms.RMSNorm)
    liger_swiglu         y = silu(gate) * up,  h = [gate; up]       (trireme.models.mlp.MLP)
    liger_cross_entropy  loss = mean over counted tokens of lse(x W^T) - (x W^T)[label]
                         (the output layer + loss, in place of trireme.ops.fused_cross_entropy)

Each runs on CUDA tensors only; trireme's own op runs elsewhere and stays the reference the
tests hold these to. The package is optional (`pip install 'trireme[liger]'`): a model that names
a kernel here builds only where liger imports, else a one-line ConfigError says how to get it.

Numerics against trireme's ops:
- RMSNorm in liger's "gemma" casting mode (offset 0): x, w and the product in fp32, rounded once
  to x's dtype, as F.rms_norm does; never in place (the output gradient is left as it is).
- SwiGLU: liger's kernels take contiguous gate and up, so the two halves of h are copied first
  (one more read and write of h than trireme's fused_swiglu, which reads h in place); the
  backward recomputes silu(gate) from the saved halves, as fused_swiglu does.
- Cross-entropy: liger's fused linear cross-entropy with the weight gradient accumulated in fp32
  (as trireme's chunked loss). Liger weighs every counted token alike: a 0/1 loss_mask becomes
  ignored labels (-100); a mask of other weights, or a batch where no token counts (liger's
  mean would be 0 / 0), keeps trireme's loss (`liger_loss_applies`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trireme.errors import ConfigError

INSTALL_HINT = "pip install 'trireme[liger]' (liger-kernel, Triton, CUDA)"


@functools.cache
def _load() -> ModuleType | str:
    """liger_kernel.transformers.functional, or the reason it does not import (a string)."""
    try:
        from liger_kernel.transformers import functional
    except Exception as e:  # not installed, or built for another torch / Triton
        return f"{type(e).__name__}: {e}"
    return functional


def liger_available() -> bool:
    return isinstance(_load(), ModuleType)


def require_liger(kernel: str) -> ModuleType:
    """liger's functional module, or a one-line ConfigError naming `kernel` and the fix."""
    found = _load()
    if isinstance(found, str):
        raise ConfigError(f"model.kernels names {kernel!r}, which needs liger-kernel; it does not "
                          f"import ({found[:200]}); {INSTALL_HINT}; or take {kernel!r} out of "
                          "model.kernels")
    return found


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., h] RMSNorm of x with weight [h], through liger's kernel."""
    return require_liger("liger_rmsnorm").liger_rms_norm(x, weight, eps, 0.0, "gemma", False)


def liger_swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., F] silu(gate) * up of h = [gate; up] ([..., 2F]), through liger's kernel."""
    gate, up = h.chunk(2, dim=-1)  # [..., F] each: strided views, made contiguous by liger
    return require_liger("liger_swiglu").liger_swiglu(gate, up)


def liger_loss_applies(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> bool:
    """Whether liger's loss gives trireme's here: loss_mask only counts tokens in or out (None,
    bool, or all 0 / 1), and at least one token counts (liger's mean would be 0 / 0). Reads
    labels and mask on the host once (liger's own forward syncs too)."""
    counted = labels != -100
    if loss_mask is not None:
        if loss_mask.dtype != torch.bool and not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
            return False
        counted = counted & (loss_mask.reshape(counted.shape) != 0)
    return bool(counted.any())


def liger_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean cross-entropy (fp32 scalar) of logits = x @ weight^T over the tokens whose label
    is not -100 and whose loss_mask (0/1, see liger_loss_applies) is 1, without the full logits.

    x [..., h], weight [vocab, h] (already cut to the real vocabulary), labels [...]."""
    labels = labels.reshape(-1)  # [N]
    if loss_mask is not None:
        labels = labels.masked_fill(loss_mask.reshape(-1) == 0, -100)
    functional = require_liger("liger_cross_entropy")
    loss = functional.liger_fused_linear_cross_entropy(
        x.reshape(-1, x.shape[-1]), weight, labels, ignore_index=-100, reduction="mean",
        accum_dtype=torch.float32)
    return loss.float()
