"""The `-` sublayer: SwiGLU, fc2(silu(gate) * up) with fc1 = [gate; up], GeLU, fc2(gelu(fc1(x))),
or squared ReLU (Nemotron-H), fc2(relu(fc1(x))^2).

SwiGLU's `fc1.weight` is [2 * ffn, h]: rows [gate; up]; GeLU's and squared ReLU's are
[ffn, h]. Under tensor parallelism fc1 is column-parallel (gate and up split alike, so
silu(gate_r) * up_r needs no communication) and fc2 row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trireme.config import ModelConfig
from trireme.models.init import InitRule
from trireme.models.sublayer import Params, Shape, Sublayer, linear_input_bytes, norm_bytes
from trireme.ops.liger import liger_swiglu, require_liger
from trireme.ops.recompute import recompute
from trireme.ops.skinny_gemm import SkinnyLinear
from trireme.ops.swiglu import fused_swiglu, swiglu
from trireme.parallel.context import ParallelContext
from trireme.parallel.random import dropout
from trireme.parallel.tensor import column_linear, row_linear


def mlp_params(cfg: ModelConfig, tensor: int, ffn: int, gated: bool) -> Params:
    """An MLP of width `ffn` on one of `tensor` ranks: fc1 (gate and up when `gated`), fc2."""
    h, f = cfg.hidden_size, ffn // tensor
    fc1 = h * f * (2 if gated else 1) + (f * (2 if gated else 1) if cfg.bias else 0)
    return Params(dense=fc1 + f * h + (h if cfg.bias else 0), largest=h * f * (2 if gated else 1))


class MLP(Sublayer):
    """The feed-forward sublayer (module docstring). Not a mixer: each position on its own."""

    kind = "mlp"
    symbol = "-"
    mixes = False

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.relu2 = cfg.activation == "relu2"
        self.fused_swiglu = self.swiglu and cfg.fused_swiglu  # trireme.ops.swiglu
        self.liger_swiglu = self.swiglu and "liger_swiglu" in cfg.kernels  # on CUDA tensors
        if self.liger_swiglu:
            require_liger("liger_swiglu")  # the one-line ConfigError now, not at the first step
        fc1_parts = [(cfg.ffn_size, 1)] * (2 if self.swiglu else 1)  # gate and up split alike
        self.fc1_parts = (("gate", cfg.ffn_size), ("up", cfg.ffn_size)) if self.swiglu else ()
        self.fc1 = column_linear(cfg.hidden_size, fc1_parts, cfg.bias, ctx.tensor)
        self.fc2 = row_linear(cfg.ffn_size, cfg.hidden_size, cfg.bias, ctx.tensor)
        self.resid_dropout = dropout(cfg.dropout, ctx.residual_rng)
        self.recompute_activation = False  # selective recomputation: see set_recompute

    def init_rules(self) -> dict[str, InitRule]:
        return {"fc1.weight": InitRule(parts=self.fc1_parts),
                "fc2.weight": InitRule(residual_output=True)}

    # What the rest of trireme asks of the kind (trireme.models.sublayer)

    @classmethod
    def flops(cls, cfg: ModelConfig, seq_length: int | None = None) -> float:
        """h ffn x 3 (SwiGLU: gate, up, down) or x 2."""
        return cfg.hidden_size * cfg.ffn_size * (3 if cfg.activation == "swiglu" else 2)

    @classmethod
    def rank_flops(cls, cfg: ModelConfig, tensor: int) -> tuple[float, float]:
        return cls.flops(cfg) / tensor, 0.0

    @classmethod
    def params(cls, cfg: ModelConfig, tensor: int, expert: int) -> Params:
        return mlp_params(cfg, tensor, cfg.ffn_size, cfg.activation == "swiglu")

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, s: Shape, mode: str) -> float:
        """norm + fc1's input h + fc1 (2F SwiGLU, F otherwise) + fc2's input (F), and SwiGLU's
        silu(gate) (F) unless recomputed (selective, the fused SwiGLU, a compiled block)."""
        lin = linear_input_bytes(s)
        if not s.swiglu:
            return norm_bytes(s) + lin * s.h + s.e * s.ffn + lin * s.ffn
        silu = 0 if mode == "selective" or s.activation_recomputed else s.e * s.ffn
        return norm_bytes(s) + lin * s.h + s.e * 2 * s.ffn + silu + lin * s.ffn

    @classmethod
    def fp8_linears(cls, s: Shape) -> dict[str, tuple[int, int]]:
        return {"fc1": (s.h, s.ffn * (2 if s.swiglu else 1)), "fc2": (s.ffn, s.h)}

    @classmethod
    def hf_names(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """SwiGLU's fc1 is the gate and up projections stacked; an ungated fc1 is up alone."""
        up = ("gate_proj.weight", "up_proj.weight") if cfg.activation == "swiglu" else (
            "up_proj.weight",)
        return {"fc1.weight": up, "fc2.weight": ("down_proj.weight",)}

    def set_recompute(self, selective: bool) -> None:
        """Selective recomputation reruns SwiGLU's activation in the backward instead of keeping
        silu(gate) ([b, s, ffn]). GeLU's backward needs only its input, which fc1's output is
        anyway, and the fused SwiGLU keeps only h (liger's its two halves): nothing to save there.
        Squared ReLU reruns relu(h) instead of keeping it."""
        plain_swiglu = self.swiglu and not (self.fused_swiglu or self.liger_swiglu)
        self.recompute_activation = selective and (plain_swiglu or self.relu2)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> None:
        return None  # nothing carries over between positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu and isinstance(self.fc1, SkinnyLinear) and not torch.is_grad_enabled():
            return self.resid_dropout(self.fc2(self.fc1.swiglu(x)))  # the serving engine's
        h = self.fc1(x)  # [b, s, 2 * ffn] (SwiGLU) or [b, s, ffn]
        if self.recompute_activation and torch.is_grad_enabled():
            h = recompute(self.activation, h)
        else:
            h = self.activation(h)
        return self.resid_dropout(self.fc2(h))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.liger_swiglu and h.is_cuda:  # liger-kernel's SwiGLU (model.kernels)
            return liger_swiglu(h)
        if self.fused_swiglu:  # the same forward; the backward as one kernel on CUDA
            return fused_swiglu(h)
        if self.swiglu:
            return swiglu(h)  # silu(gate) * up, gate and up [b, s, ffn] halves of h
        if self.relu2:
            return torch.square(F.relu(h))
        return F.gelu(h, approximate="tanh")
