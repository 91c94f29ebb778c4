"""Linear layers for few rows (a decode step's batch): y = x W^T split over K, on CUDA one Triton
kernel (trireme.ops.skinny_gemm_triton), elsewhere and as the reference the same sums in torch.

    part[s] = x[:, chunk s] W[:, chunk s]^T     fp32, s = 0 .. splits - 1 (equal chunks of K)
    y       = sum_s part[s]                      in that order, rounded once to x's dtype

`skinny_linear(x, weight, bias)` takes this path when x has at most MAX_ROWS rows, is on CUDA in
bf16 / fp16 and the shape has a plan (`plan`: a measured shape, or K at least DEEP x N; N a
multiple of the tile, K of splits x tile, the weight at most MAX_WEIGHT elements); otherwise it
is F.linear. `SkinnyLinear` is an nn.Linear whose forward is skinny_linear, and
`use_skinny_linears(model)` turns a model's plain nn.Linear layers into it (the same module
objects: state dicts and checkpoints do not change), or back: the serving engine does one or
the other by EngineSettings.decode_gemm ("triton" / "cublas") and `unavailable` (the
kernels' plans are for sm_90). A SkinnyLinear launches as its `kernels` (the engine's
KernelSettings: PDL and early reads, trireme.ops.pdl) say.

`SkinnyLinear.swiglu(x)` is SwiGLU's first layer and activation as one kernel (GLU_TILES: the
shapes measured to gain; else F.linear, then silu(gate) * up), which the MLP calls when its fc1
is a SkinnyLinear. The kernels have no backward: they run only outside autograd.

The split count is a function of (N, K) only, so a compiled graph traced at one batch size
serves every batch size (the op's output shape [splits, M, N] does not depend on M); the tile
shape (rows per program, kernel variant) is picked at launch from the rows present. The plans
come from the H200 sweep in bench/skinny_gemm.py (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelSettings
from trireme.ops.optional import optional_kernel
from trireme.ops.swiglu import swiglu

MAX_ROWS = 64  # more rows: cuBLAS (the H200 sweep: the kernel loses at 256)
MAX_WEIGHT = 64 << 20  # elements; the output layer (128256 x 2048) already runs near the bandwidth
MIN_CAPABILITY = (9, 0)  # the plans' tiles: sm_90's shared memory (H100 / H200)
TARGET_PROGRAMS = 256  # programs the split aims at: about two per SM of an H100 / H200 (132)


@dataclass(frozen=True)
class Tile:
    """How one launch tiles the product (trireme.ops.skinny_gemm_triton.skinny_mm)."""

    block_n: int = 64
    block_k: int = 128
    swap: bool = False
    num_warps: int = 4
    num_stages: int = 4


# (N, K) -> splits, from the H200 sweep (bench/skinny_gemm.py; bench/RESULTS.md): cuBLAS runs
# llama3-1b's qkv and gate_up as fast at 1-64 rows (a GEMM kernel's fixed cost, whoever writes
# it), but 4 splits measured faster for its down projection (K = 4 N; the partial sums added
# by the caller) and for its out projection (2048 x 2048; the sums fold into the next add +
# norm; in the whole decode step at batch 64 the out projection's gain is within what machines
# differ by); other shapes with K >= DEEP * N: default_splits, others: cuBLAS
SPLITS: dict[tuple[int, int], int] = {(2048, 8192): 4, (2048, 2048): 4}
DEEP = 4
# (N, K, splits) -> Tile for rows <= 16 and <= MAX_ROWS; other shapes: Tile()
TILES: dict[tuple[int, int, int], tuple[Tile, Tile]] = {
    (2048, 8192, 4): (Tile(64, 128, True, 4, 5), Tile(64, 128, False, 4, 5))}


# SwiGLU's first layer [W_gate; W_up] (2F, K) -> the tile of its fused kernel (GLU: one split,
# silu(gate) * up written, trireme.ops.skinny_gemm_triton) for rows <= 16 and <= MAX_ROWS;
# a shape not here runs F.linear, then the activation. From the H200 sweep (bench/skinny_gemm.py
# --glu; bench/RESULTS.md): llama3-1b's 16384 x 2048, fused, measured faster at 1-64 rows than
# cuBLAS + the compiled activation.
GLU_TILES: dict[tuple[int, int], tuple[Tile, Tile]] = {
    (16384, 2048): (Tile(64, 128, False, 4, 4), Tile(64, 128, False, 4, 4))}


def default_splits(n: int, k: int, tile: Tile = Tile()) -> int:
    """The fewest splits (a power of two) that give TARGET_PROGRAMS programs, at most as many
    as K has tiles."""
    splits, tiles_n, tiles_k = 1, max(n // tile.block_n, 1), max(k // tile.block_k, 1)
    while tiles_n * splits < TARGET_PROGRAMS and splits * 2 <= tiles_k:
        splits *= 2
    return splits


def plan(n: int, k: int) -> int | None:
    """Splits for a weight [n, k], or None when the shape does not tile (or is too large to
    gain: MAX_WEIGHT). SPLITS names shapes (to measure another shape's plan: bench/skinny_gemm.py
    times the kernel at each split count); others take default_splits when K >= DEEP x N.
    Not cached: torch.compile traces it inside the compiled decode step (and warns about a
    cache wrapper, which it ignores)."""
    if n * k > MAX_WEIGHT or ((n, k) not in SPLITS and k < DEEP * n):
        return None
    splits = SPLITS.get((n, k)) or default_splits(n, k)
    tiles = TILES.get((n, k, splits), (Tile(),) * 2)
    if any(n % t.block_n or k % (splits * t.block_k) for t in tiles):
        return None
    return splits


def tile_for(rows: int, n: int, k: int, splits: int) -> tuple[Tile, int]:
    """(tile, rows per program) for a launch with `rows` rows."""
    return _by_rows(TILES.get((n, k, splits), (Tile(),) * 2), rows)


def _by_rows(tiles: tuple[Tile, Tile], rows: int) -> tuple[Tile, int]:
    """The (small, large) pair's tile for `rows` rows and its rows per program."""
    return (tiles[0], 16) if rows <= 16 else (tiles[1], 64)


def skinny_mm_reference(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """The module docstring's part [splits, M, N] fp32 (or y [1, M, N] in x's dtype at splits
    == 1) by torch matmuls in fp32."""
    chunks = zip(x.float().chunk(splits, dim=1), weight.float().chunk(splits, dim=1))
    part = torch.stack([a @ b.t() for a, b in chunks])  # [splits, M, N]
    return part if splits > 1 else part.to(x.dtype)


@torch.library.custom_op("trireme::skinny_mm", mutates_args=(),
                         schema="(Tensor x, Tensor weight, int splits, bool pdl=True, "
                                "bool early_reads=True) -> Tensor")
def skinny_mm(x: torch.Tensor, weight: torch.Tensor, splits: int, pdl: bool = True,
              early_reads: bool = True) -> torch.Tensor:
    """part [splits, M, N] (module docstring) for x [M, K], weight [N, K]: the Triton kernel on
    CUDA, launched with KernelSettings(pdl, early_reads) (this is the implementation for the
    other devices: the reference)."""
    return skinny_mm_reference(x, weight, splits)


def skinny_swiglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [M, F] for weight [W_gate; W_up] [2F, K], in fp32,
    rounded once to x's dtype (the fused kernel's math)."""
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@skinny_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, splits: int, pdl: bool = True,
      early_reads: bool = True) -> torch.Tensor:
    dtype = torch.float32 if splits > 1 else x.dtype
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=dtype)


@optional_kernel("the decode steps' linear layers run through F.linear")
def _launcher():
    """trireme.ops.skinny_gemm_triton.skinny_mm, or None (with a warning) without Triton."""
    from trireme.ops.skinny_gemm_triton import skinny_mm as launch
    return launch


@skinny_mm.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, splits: int, pdl: bool = True,
      early_reads: bool = True) -> torch.Tensor:
    launch = _launcher()
    if launch is None:
        return skinny_mm_reference(x, weight, splits)
    tile, block_m = tile_for(x.shape[0], weight.shape[0], weight.shape[1], splits)
    return launch(x, weight, splits, tile.block_n, tile.block_k, block_m, tile.swap,
                  tile.num_warps, tile.num_stages,
                  kernels=KernelSettings(pdl=pdl, early_reads=early_reads))


@torch.library.custom_op("trireme::skinny_swiglu", mutates_args=(),
                         schema="(Tensor x, Tensor weight, bool pdl=True, "
                                "bool early_reads=True) -> Tensor")
def skinny_swiglu(x: torch.Tensor, weight: torch.Tensor, pdl: bool = True,
                  early_reads: bool = True) -> torch.Tensor:
    """silu(gate) * up [M, F] for x [M, K], weight [W_gate; W_up] [2F, K]: the fused Triton
    kernel on CUDA (this is the implementation for the other devices: the reference)."""
    return skinny_swiglu_reference(x, weight)


@skinny_swiglu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, pdl: bool = True,
      early_reads: bool = True) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@skinny_swiglu.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, pdl: bool = True,
      early_reads: bool = True) -> torch.Tensor:
    launch = _launcher()
    tiles = GLU_TILES.get(tuple(weight.shape))
    if launch is None or tiles is None:
        return skinny_swiglu_reference(x, weight)
    tile, block_m = _by_rows(tiles, x.shape[0])
    return launch(x, weight, 1, tile.block_n, tile.block_k, block_m, tile.swap, tile.num_warps,
                  tile.num_stages, glu=True,
                  kernels=KernelSettings(pdl=pdl, early_reads=early_reads))[0]


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device`, or None: they need CUDA, a GPU of the
    architecture their plans were measured on (sm_90: the H100 / H200; their tiles need more
    shared memory than sm_80-89 parts have) and Triton."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"its tiles are for sm_90 (H100 / H200), this GPU is sm_{major}{minor}"
    return None if _launcher() is not None else "Triton does not import"


def _small_inference_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [..., K] is a CUDA bf16 / fp16 input of at most MAX_ROWS rows outside autograd (the
    kernels have no backward) against a contiguous weight of its dtype. (Whether the kernels
    run on this GPU at all is `unavailable`'s, asked once by whoever swaps the layers.)"""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.is_contiguous() and 0 < rows <= MAX_ROWS and not torch.is_grad_enabled())


def usable(x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """Splits when skinny_linear takes the kernel for x [..., K] and weight [N, K], else None."""
    return plan(*weight.shape) if _small_inference_input(x, weight) else None


def glu_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_swiglu_linear takes the fused kernel (a GLU_TILES shape that tiles)."""
    tiles = GLU_TILES.get(tuple(weight.shape))
    if tiles is None or not _small_inference_input(x, weight):
        return False
    half, k = weight.shape[0] // 2, weight.shape[1]
    return not any(half % t.block_n or k % t.block_k for t in tiles)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  splits: int | None = None,
                  kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K]; through `trireme::skinny_mm` when `usable`
    (or always, with `splits` given: tests run it on the CPU), launched as `kernels` say."""
    splits = splits or usable(x, weight)
    if splits is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    part = skinny_mm(rows, weight, splits, kernels.pdl, kernels.early_reads)  # [splits, M, N]
    y = part[0]
    for s in range(1, splits):  # additions, not a sum(0) reduction: Inductor fuses them into
        y = y + part[s]  # the next kernel (the residual add and norm)
    if splits > 1:  # fp32 sums: the bias too, then one rounding
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    elif bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], -1)


def skinny_swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         fused: bool | None = None,
                         kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """silu(gate) * up of h = F.linear(x, weight, bias) = [gate; up], x [..., K] -> [..., F]:
    one `trireme::skinny_swiglu` when `glu_usable` (`fused` True: always, e.g. the reference on
    the CPU in tests; no bias), launched as `kernels` say, else F.linear and the activation."""
    if fused if fused is not None else (bias is None and glu_usable(x, weight)):
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        return skinny_swiglu(rows, weight, kernels.pdl, kernels.early_reads).view(
            *x.shape[:-1], -1)
    return swiglu(F.linear(x, weight, bias))


class SkinnyLinear(nn.Linear):
    """nn.Linear whose forward is skinny_linear (module docstring); `swiglu(x)` is SwiGLU's
    activation of its output, fused into the kernel where it has a plan. `kernels`: how its
    kernels launch (use_skinny_linears sets the engine's)."""

    kernels: KernelSettings = DEFAULT_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, kernels=self.kernels)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_swiglu_linear(x, self.weight, self.bias, kernels=self.kernels)


def use_skinny_linears(model: nn.Module, on: bool = True,
                       kernels: KernelSettings = DEFAULT_KERNELS) -> int:
    """Turn every plain nn.Linear of `model` into a SkinnyLinear launching as `kernels` say (or,
    with `on` False, every SkinnyLinear back into an nn.Linear), in place: the same module
    objects, their class changed; the number turned."""
    before, after = (nn.Linear, SkinnyLinear) if on else (SkinnyLinear, nn.Linear)
    turned = 0
    for module in model.modules():
        # exactly the class (no subclass, parametrized or FSDP-wrapped layer) and not compiled
        # on its own (module.compile() keeps the old forward's graph)
        if type(module) is before and getattr(module, "_compiled_call_impl", None) is None:
            module.__class__ = after  # the same object: parameters, hooks, references
            turned += 1
            if not on:
                module.__dict__.pop("kernels", None)
        if on and type(module) is SkinnyLinear:  # turned now or by an earlier engine
            module.kernels = kernels
    return turned


@torch.no_grad()
def warm_up(model: nn.Module) -> None:
    """Compile now the kernels the SkinnyLinears of `model` (swapped in, on a GPU where they
    run) launch: every planned shape at both tiles (rows <= 16 and more). A step meeting an
    uncompiled one would stall for its compile in the middle of serving. Once per weight shape, and
    only the shapes that take a kernel."""
    layers = {(tuple(m.weight.shape), m.kernels): m.weight for m in model.modules()
              if isinstance(m, SkinnyLinear)}
    for (shape, kernels), w in layers.items():
        for rows in (1, MAX_ROWS):
            x = w.new_zeros(rows, w.shape[1])
            if plan(*shape) is not None:
                skinny_linear(x, w, kernels=kernels)
            if GLU_TILES.get(shape) is not None:
                skinny_swiglu_linear(x, w, kernels=kernels)
