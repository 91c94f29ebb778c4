"""Normalization layers over the last dimension: RMSNorm (Llama) and LayerNorm (GPT-2).

Both call torch's functional kernels, which accumulate in fp32 for bf16/fp16 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    is_norm = True  # initialized to weight 1, bias 0 (trireme.models.init)

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


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


def build_norm(kind: str, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """`kind` is "rmsnorm" or "layernorm" (model.normalization); `bias` only for layernorm."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias)
    raise ValueError(f"unknown normalization {kind!r}")
