"""Normalization layers over the last dimension: RMSNorm (Llama) and LayerNorm (GPT-2).

Both call torch's functional kernels, which accumulate in fp32 for bf16/fp16 inputs. RMSNorm can
run liger-kernel's instead on CUDA tensors (model.kernels liger_rmsnorm, trireme.ops.liger).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trireme.ops.liger import liger_rms_norm, require_liger


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    is_norm = True  # initialized to weight 1, bias 0 (trireme.models.init)

    def __init__(self, dim: int, eps: float = 1e-5, liger: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.liger = liger  # liger-kernel's RMSNorm on CUDA tensors
        if liger:
            require_liger("liger_rmsnorm")  # the one-line ConfigError now, not at the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger and x.is_cuda:
            return liger_rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", liger" if self.liger else "")


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (bias optional)."""

    is_norm = True  # initialized to weight 1, bias 0 (trireme.models.init)

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def build_norm(kind: str, dim: int, eps: float = 1e-5, bias: bool = True,
               kernels: tuple[str, ...] | list[str] = ()) -> nn.Module:
    """`kind` is "rmsnorm" or "layernorm" (model.normalization); `bias` only for layernorm;
    `kernels` (model.kernels) may name liger_rmsnorm."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, liger="liger_rmsnorm" in kernels)
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias)
    raise ValueError(f"unknown normalization {kind!r}")
