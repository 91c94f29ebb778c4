"""The `M` sublayer: Mamba-2's mixer (the state-space scan of trireme.ops.ssd between projections).

    z, xBC, dt = split(x W_in)             [b, s, d_in], [b, s, d_in + 2 g n], [b, s, heads]
    xBC = silu(causal_conv1d(xBC))          depthwise, width model.mamba_conv_kernel
    x, B, C = split(xBC)                    [b, s, heads, p], [b, s, g, n] twice
    y = SSD(x, softplus(dt + dt_bias) clamped, A = -exp(A_log), B, C) + D x
    out = gated_rms_norm(y, z) W_out        the norm per group of d_in / g channels

d_in = heads * p (model.mamba_num_heads, mamba_head_dim), g = mamba_num_groups, n =
mamba_state_dim. `in_proj.weight` is [2 d_in + 2 g n + heads, h]: rows [z; x; B; C; dt], each
head-major (group-major for B and C), the layout of Hugging Face's Mamba2 and of mamba_ssm;
`conv1d.weight` [d_in + 2 g n, 1, w] covers [x; B; C].

Initialization (trireme.models.init, by (seed, name) only), as the reference implementation:
A_log = log(U[a_init_min, a_init_max]); dt_bias = softplus^-1(dt) for dt log-uniform in
[dt_min, dt_max] (floored at dt_init_floor); D = 1; the convolution U(+-1/sqrt(w)), its bias 0;
the norm 1; in_proj Normal(0, init_std) per part, out_proj the scaled residual init.

Tensor parallelism: each rank holds heads / T heads and g / T groups (the pattern requires T to
divide the groups, so a group and the heads that read its B and C stay on one rank): in_proj is
column-parallel over the five parts, the convolution, A_log, D, dt_bias and the norm hold this
rank's channels, out_proj is row-parallel. Nothing in between needs communication.

Kernels (model.mamba_kernels): the plain chunked scan, its within-chunk part as trireme's Triton
kernels ("triton", CUDA), or mamba_ssm's scan and causal_conv1d's convolution ("mamba_ssm", or
"auto" where they import); all compute the same numbers up to rounding.

Decoding keeps a `MambaState` per sublayer (the convolution's last w - 1 inputs and the scan's
[heads, p, n] state) instead of keys and values: one token costs the same at any position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from trireme.config import ModelConfig
from trireme.errors import TriremeError
from trireme.models.init import InitRule
from trireme.models.paged import SlotState
from trireme.models.sublayer import Sublayer
from trireme.ops.recompute import recompute
from trireme.ops.ssd import (
    FastKernels,
    GatedRMSNorm,
    causal_conv1d,
    discretize_dt,
    fast_ssd_kernels,
    ssd_scan,
    ssd_step,
)
from trireme.parallel.context import ParallelContext
from trireme.parallel.random import dropout, name_seed
from trireme.parallel.sharding import Sharding, even_sharding
from trireme.parallel.tensor import column_linear, row_linear


@dataclass
class MambaState:
    """One Mamba sublayer's decoding state for a batch of sequences (row i: sequence i).

    conv: [batch, conv channels, w - 1], the last inputs of the convolution (model dtype);
    ssm: [batch, heads, p, n], the scan's state (fp32; fp64 for an fp64 model). A serving
    engine can give each request its own rows."""

    conv: Tensor
    ssm: Tensor


def _uniform(seed: int, name: str, shape: tuple[int, ...], device: torch.device,
             low: float, high: float) -> Tensor:
    generator = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    return torch.empty(shape, device=device).uniform_(low, high, generator=generator)


def draw_a_log(seed: int, name: str, shape: tuple[int, ...], device: torch.device,
               low: float, high: float) -> Tensor:
    """log(-A) for -A uniform in [low, high]."""
    return torch.log(_uniform(seed, name, shape, device, low, high))


def draw_dt_bias(seed: int, name: str, shape: tuple[int, ...], device: torch.device,
                 dt_min: float, dt_max: float, floor: float) -> Tensor:
    """softplus^-1(dt) for dt = exp(U[log dt_min, log dt_max]) floored: softplus(dt_bias) is
    then the initial step size."""
    u = _uniform(seed, name, shape, device, 0.0, 1.0)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


def draw_uniform(seed: int, name: str, shape: tuple[int, ...], device: torch.device,
                 bound: float) -> Tensor:
    return _uniform(seed, name, shape, device, -bound, bound)


def draw_ones(seed: int, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.ones(shape, device=device)


MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")  # its weights, conv1d.bias aside


class Mamba(Sublayer):
    """The Mamba-2 mixer (module docstring). A mixer: it sees positions and keeps a state, one
    row per sequence, which the serving engine hands over per request (slot_states)."""

    slot_states = True

    kind = "mamba"
    symbol = "M"
    mixes = True

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.cfg = cfg
        tp = ctx.tensor
        size = tp.size if tp is not None else 1
        heads, p = cfg.mamba_heads, cfg.mamba_head_dim
        g, n, w = cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.mamba_conv_kernel
        self.heads, self.groups, self.head_dim, self.state_dim = heads // size, g // size, p, n
        self.inner = self.heads * p  # this rank's d_in
        self.conv_channels = self.inner + 2 * self.groups * n
        self.in_parts = [(heads, p), (heads, p), (g, n), (g, n), (heads, 1)]  # z x B C dt
        self.in_proj = column_linear(cfg.hidden_size, self.in_parts, cfg.bias, tp)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, w,
                                groups=self.conv_channels, bias=cfg.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(self.inner, cfg.mamba_inner_size // g, cfg.norm_eps)
        self.out_proj = row_linear(cfg.mamba_inner_size, cfg.hidden_size, cfg.bias, tp)
        self.dt_limit = (cfg.mamba_dt_limit_min, cfg.mamba_dt_limit_max or float("inf"))
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.resid_dropout = dropout(cfg.dropout, ctx.residual_rng)
        self.recompute_core = False  # selective recomputation: see set_recompute
        self.kernels = cfg.mamba_kernels  # auto, torch, triton or mamba_ssm (model.mamba_kernels)

    # What the rest of trireme asks of the kind (trireme.models.sublayer). The planner does not
    # count its parameters and activations yet, nor split its FLOPs over tensor parallelism.

    @classmethod
    def flops(cls, cfg: ModelConfig, seq_length: int | None = None) -> float:
        """Megatron's estimate: in_proj, the scan (7 d_in n / 2), out_proj."""
        h, d_in, heads = cfg.hidden_size, cfg.mamba_inner_size, cfg.mamba_heads
        in_proj = h * (2 * d_in + 2 * cfg.mamba_num_groups * cfg.mamba_state_dim + heads)
        return in_proj + 3.5 * d_in * cfg.mamba_state_dim + d_in * h

    @classmethod
    def hf_names(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """The same names on both sides (Mamba-2's and Nemotron-H's mixer)."""
        names = [*MIXER_TENSORS, *(("conv1d.bias",) if cfg.mamba_conv_bias else ())]
        return {name: (name,) for name in names}

    def init_rules(self) -> dict[str, InitRule]:
        cfg, d_in = self.cfg, self.cfg.mamba_inner_size
        gn = cfg.mamba_num_groups * cfg.mamba_state_dim  # rows of B (and of C), all groups
        return {
            "in_proj.weight": InitRule(parts=(("z", d_in), ("x", d_in), ("B", gn), ("C", gn),
                                              ("dt", self.cfg.mamba_heads))),
            "out_proj.weight": InitRule(residual_output=True),
            "conv1d.weight": InitRule(draw=partial(
                draw_uniform, bound=1.0 / math.sqrt(cfg.mamba_conv_kernel))),
            "A_log": InitRule(draw=partial(draw_a_log, low=cfg.mamba_a_init_min,
                                           high=cfg.mamba_a_init_max)),
            "dt_bias": InitRule(draw=partial(draw_dt_bias, dt_min=cfg.mamba_dt_min,
                                             dt_max=cfg.mamba_dt_max,
                                             floor=cfg.mamba_dt_init_floor)),
            "D": InitRule(draw=draw_ones),
        }

    def param_shardings(self) -> dict[str, Sharding]:
        """Under TP: this rank's channels of the convolution and norm, its heads' A_log, D,
        dt_bias (in_proj and out_proj declare their own)."""
        if self.tp_size == 1:
            return {}
        r, t = self.tp_rank, self.tp_size
        heads = even_sharding(0, self.heads * t, r, t)
        conv = Sharding(0, tuple(self.in_parts[1:4]), r, t)  # x, B, C
        out = {"A_log": heads, "D": heads, "dt_bias": heads, "conv1d.weight": conv,
               "norm.weight": Sharding(0, (self.in_parts[0],), r, t)}
        if self.conv1d.bias is not None:
            out["conv1d.bias"] = conv
        return out

    def set_recompute(self, selective: bool) -> None:
        """Selective recomputation keeps only in_proj's output: the convolution, the scan's
        chunk matrices and the norm are rebuilt in the backward."""
        self.recompute_core = selective

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> MambaState:
        """A zeroed state for `batch_size` sequences (its size does not depend on max_len)."""
        w = self.conv1d.weight.shape[-1]
        return MambaState(
            torch.zeros(batch_size, self.conv_channels, w - 1, device=device, dtype=dtype),
            torch.zeros(batch_size, self.heads, self.head_dim, self.state_dim, device=device,
                        dtype=torch.promote_types(dtype, torch.float32)))

    def forward(
        self,
        x: Tensor,
        rope: object = None,
        cache: SlotState | None = None,
        document_ids: Tensor | None = None,
        context: object = None,
    ) -> Tensor:
        if document_ids is not None or context is not None:
            raise TriremeError("Mamba-2 layers do not support packed documents or context "
                               "parallelism yet")
        zxbcdt = self.in_proj(x)  # [b, s, 2 d_in + 2 g n + heads] (this rank's)
        if isinstance(cache, SlotState):  # the serving engine's ragged step
            return self.resid_dropout(self.out_proj(self._slots(zxbcdt, cache)))
        if self.recompute_core and torch.is_grad_enabled():
            y = recompute(self.core, zxbcdt)
        else:
            y = self.core(zxbcdt)
        return self.resid_dropout(self.out_proj(y))

    def _slots(self, zxbcdt: Tensor, cache: SlotState) -> Tensor:
        """A serving step ([1, T, ...]: every request's new tokens, one after another): each
        request's tokens continue from its own rows of the state (its slot; fresh at start
        position 0), one request at a time."""
        state, pieces = cache.state, []
        for first, count, slot, start in cache.step.requests:
            rows = MambaState(state.conv[slot:slot + 1], state.ssm[slot:slot + 1])  # views
            pieces.append(self.core(zxbcdt[:, first:first + count], rows, start))
        return torch.cat(pieces, dim=1)  # [1, T, d_in]

    def core(self, zxbcdt: Tensor, cache: MambaState | None = None,
             start_pos: int = 0) -> Tensor:
        """[b, s, d_in]: convolution, scan and gated norm of the projected input; with `cache`,
        continuing from its state (fresh at start_pos 0) and leaving the new one in it."""
        b, s, _ = zxbcdt.shape
        g, n = self.groups, self.state_dim
        z, xbc, dt = zxbcdt.split([self.inner, self.conv_channels, self.heads], dim=-1)
        fast = self._fast_kernels(zxbcdt.device) if cache is None else None
        if fast is not None:
            return self._fast_core(fast, z, xbc, dt)
        fresh = cache is None or start_pos == 0
        conv_state = None if fresh else cache.conv[:b]
        xbc, conv_state = causal_conv1d(xbc, self.conv1d.weight[:, 0], self.conv1d.bias,
                                        conv_state)
        xs, B, C = xbc.split([self.inner, g * n, g * n], dim=-1)
        xs = xs.reshape(b, s, self.heads, self.head_dim)  # [b, s, heads, p]
        B, C = B.reshape(b, s, g, n), C.reshape(b, s, g, n)
        dt = discretize_dt(dt, self.dt_bias, True, self.dt_limit)  # [b, s, heads] fp32
        A = -torch.exp(self.A_log.to(dt.dtype))  # [heads]
        ssm_state = None if fresh else cache.ssm[:b]
        if ssm_state is not None and s == 1:  # decoding: one step of the recurrence
            y, ssm_state = ssd_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], ssm_state, self.D)
            y = y.unsqueeze(1).to(xs.dtype)
        else:
            triton = self.kernels == "triton" and xs.is_cuda and cache is None
            y, ssm_state = ssd_scan(xs, dt, A, B, C, self.cfg.mamba_chunk_size, self.D,
                                    initial_state=ssm_state, triton=triton)
        if cache is not None:
            cache.conv[:b].copy_(conv_state)
            cache.ssm[:b].copy_(ssm_state)
        return self.norm(y.reshape(b, s, self.inner), z)  # [b, s, d_in]

    def _fast_kernels(self, device: torch.device) -> FastKernels | None:
        if self.kernels in ("torch", "triton"):
            return None
        fast = fast_ssd_kernels(device)
        if fast is None and self.kernels == "mamba_ssm":
            raise TriremeError("model.mamba_kernels = 'mamba_ssm' but mamba_ssm does not import "
                               f"(or the model is on {device.type}, not CUDA); pip install "
                               "mamba-ssm causal-conv1d, or use 'auto' / 'torch'")
        return fast

    def _fast_core(self, fast: FastKernels, z: Tensor, xbc: Tensor, dt: Tensor) -> Tensor:
        """`core` through mamba_ssm's scan (dt's bias, softplus and limits inside the kernel)
        and causal_conv1d's convolution when it imports; the same numbers up to rounding."""
        b, s, _ = z.shape
        g, n = self.groups, self.state_dim
        weight = self.conv1d.weight[:, 0]  # [channels, w]
        if fast.conv is not None:
            xbc = fast.conv(xbc.transpose(1, 2), weight, self.conv1d.bias,
                            activation="silu").transpose(1, 2)
        else:
            xbc = causal_conv1d(xbc, weight, self.conv1d.bias)[0]
        xs, B, C = xbc.split([self.inner, g * n, g * n], dim=-1)
        y = fast.scan(xs.reshape(b, s, self.heads, self.head_dim), dt, -torch.exp(
            self.A_log.float()), B.reshape(b, s, g, n), C.reshape(b, s, g, n),
            self.cfg.mamba_chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
            dt_limit=self.dt_limit)
        return self.norm(y.reshape(b, s, self.inner), z)
