"""Rotary position embeddings (RoPE), with Llama-3.1's frequency scaling.

Pairing convention: "rotate half" (GPT-NeoX, HF Llama). Dimension i of a head is rotated together
with dimension i + d/2, by the angle position * inv_freq[i]. HF Llama checkpoints use the same
layout, so their q/k weights load without a permutation.

    rotate_half([x1, x2]) = [-x2, x1]          x1 = x[..., :d/2], x2 = x[..., d/2:]
    rope(x, p) = x * cos(p * f) + rotate_half(x) * sin(p * f)     f = [inv_freq, inv_freq]
"""

from __future__ import annotations

import math

import torch
from torch import nn


def llama3_scale(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> torch.Tensor:
    """Llama-3.1's piecewise scaling of rotary frequencies for long context.

    Wavelengths shorter than original_max_position / high_freq_factor keep their frequency; those
    longer than original_max_position / low_freq_factor are slowed down by `factor`; in between
    the two are blended linearly in original_max_position / wavelength.
    """
    wavelength = 2 * math.pi / inv_freq
    short_limit = original_max_position / high_freq_factor  # below: high frequencies, unchanged
    long_limit = original_max_position / low_freq_factor  # above: low frequencies, / factor
    smooth = (original_max_position / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelength < short_limit,
        inv_freq,
        torch.where(wavelength > long_limit, inv_freq / factor, blended),
    )


def rope_frequencies(
    head_size: int,
    theta: float = 10000.0,
    scaling: str = "none",
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i / head_size) for i < head_size / 2, fp64, optionally scaled."""
    # always on CPU (also when the model is built under a meta-device context); moved on use
    exponents = torch.arange(0, head_size, 2, dtype=torch.float64, device="cpu") / head_size
    inv_freq = 1.0 / (theta**exponents)  # [head_size / 2]
    if scaling == "llama3":
        inv_freq = llama3_scale(
            inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position
        )
    elif scaling != "none":
        raise ValueError(f"unknown rope scaling {scaling!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds inv_freq and a lazily built fp32 cos/sin table; hands out the rows for positions.

    The table is a plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round it,
    and it is rebuilt on the device of the first call (and when a longer range is asked for).
    """

    def __init__(self, head_size: int, max_positions: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.head_size = head_size
        self.max_positions = max_positions
        self.inv_freq = inv_freq.to(torch.float64)  # [d/2]
        self._cos: torch.Tensor | None = None  # [max_positions, d], fp32
        self._sin: torch.Tensor | None = None

    def _build(self, length: int, device: torch.device) -> None:
        positions = torch.arange(length, dtype=torch.float64)
        angles = torch.outer(positions, self.inv_freq)  # [length, d/2], fp64 for long contexts
        angles = torch.cat([angles, angles], dim=-1)  # [length, d]: dims i and i + d/2 share
        self._cos = angles.cos().float().to(device)
        self._sin = angles.sin().float().to(device)

    def forward(
        self,
        device: torch.device,
        *,
        offset: int = 0,
        length: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions offset..offset+length-1 ([length, d]) or for position_ids
        ([b, s] -> [b, s, d])."""
        needed = offset + length if position_ids is None else int(position_ids.max()) + 1
        if self._cos is None or self._cos.device != device or self._cos.shape[0] < needed:
            self._build(max(needed, self.max_positions), device)
        assert self._cos is not None and self._sin is not None
        if position_ids is not None:
            return self._cos[position_ids], self._sin[position_ids]
        return self._cos[offset : offset + length], self._sin[offset : offset + length]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope(x, p) = x cos + rotate_half(x) sin in fp32 (cos, sin already broadcastable to x),
    cast back to x's dtype: the one formula the three layouts below share."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, d] by cos/sin [s, d] (or [b, s, d] for per-sample positions).

    Computed in fp32 and cast back to x's dtype.
    """
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, d]: shared by the heads
    return _rotated(x, cos, sin)


def apply_rotary_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary for token-major x [b, s, heads, d] (the qkv projection's layout): cos/sin
    [s, d] (or [b, s, d] for per-sample positions) broadcast over the heads."""
    return _rotated(x, cos.unsqueeze(-2), sin.unsqueeze(-2))  # [s, 1, d] or [b, s, 1, d]


def apply_rotary_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary for token-major x [s, heads, d] (a token's heads side by side, as a fused
    qkv projection lays out q and k): cos/sin [s, d] (or [1, s, d]) broadcast over the heads."""
    cos, sin = (t.reshape(-1, 1, t.shape[-1]) for t in (cos, sin))  # [s, 1, d]
    return _rotated(x, cos, sin)
