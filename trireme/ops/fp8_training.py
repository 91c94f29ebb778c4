"""FP8 training with delayed scaling, and the conversion of a model's linears to fp8.

The fp8 matmul itself (quantize, `_scaled_mm`, the emulated reference, current scaling, where
each tensor's scale comes from its own amax) is trireme.ops.fp8. This file adds delayed scaling,
the weights cast once per optimizer step, and `to_fp8_training` / `convert_to_float8`.

"delayed" scaling (DelayedFloat8Linear, model.fp8_scaling) takes each scale from the past:

    s_t(step n) = fp8_max / max(history_t)       history_t: amax(|t|) of the last H steps
    amax_t(step n) = max over step n's micro batches of amax(|t|)   recorded while casting

so the scale is known before t exists and the cast fuses into t's producer; the amax is a side
output of the same pass. Values past the history's max saturate at +-fp8_max (the clamp). Per
layer, a [3, H] fp32 history (x, W, g) and a [3] running max of the step (`amax_pending`) live
on the device; `start_step()` (once per optimizer step, outside any compiled region) rolls the
pending amaxes into the history and recomputes the scales. Nothing reads them on the host.

- The amaxes of a micro batch (x's and W's computed in the forward and kept, g's in the
  backward) leave the backward as the gradient of a small leaf tensor, whose hook takes their
  max into the pending amaxes: once per forward-backward pair, so a recomputed forward
  (train.recompute) records nothing twice, and no compiled graph writes a buffer. Gradient
  accumulation: the max over the step's micro batches. Evaluation (no backward) records nothing.
- The first step (no history yet: a new model, or one just loaded from a checkpoint) runs with
  current scaling and records its amaxes, so the history starts from real values. The history
  is not saved in checkpoints (buffers with persistent=False): a resumed run starts it afresh
  that way, with a one-step current-scaled warm-up and never an empty (inf) scale.
- A non-finite amax (a step with inf / NaN gradients, which the optimizer skips) enters the
  history as 0, and a tensor whose whole history is 0 keeps its last scale.
- Under torch.compile the switch from the first step's current scaling to delayed scaling is
  a Python attribute, so it compiles twice (once per mode), then never again.
- W is cast once per optimizer step, not in every micro batch (DelayedFloat8Linear's docstring).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from weakref import ref

import torch
from torch import nn

from trireme.errors import ConfigError
from trireme.ops.fp8 import (
    ALIGN,
    AMAX_EPS,
    AMAX_HISTORY,
    E4M3,
    E5M2,
    FP8_LINEARS,
    SCALINGS,
    Float8Linear,
    amax,
    amax_by_rows,
    check_fp8_device,
    fp8_linear,
    quantize,
    scale_from_amax,
    scaled_matmul,
)


class DelayedFloat8Matmul(torch.autograd.Function):
    """Float8Matmul with the scales of x, W and g given ([3] fp32, delayed scaling) or, when
    `scales` is None (the first step), computed from the tensors themselves.

    The three amaxes leave through the backward as the "gradient" of `amax_sink` ([3], a leaf
    that requires grad): the layer's hook on it takes their max into the step's pending amaxes.
    So nothing is written inside the forward or backward graphs (no in-place update of a tensor
    that compiled graphs save, which micro batches in flight would trip over), and the record is
    made once per backward, whether or not the forward was recomputed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                amax_sink: torch.Tensor, emulate: bool, w_cast: torch.Tensor | None = None,
                w_cast_t: torch.Tensor | None = None,
                w_stats: torch.Tensor | None = None) -> torch.Tensor:
        x_amax = amax_by_rows(x)  # recorded, a side output of the cast
        x_scale = scale_from_amax(x_amax, E4M3) if scales is None else scales[0]
        if w_cast is None:  # W cast here, every micro batch
            w_amax = amax(weight)
            w_scale = scale_from_amax(w_amax, E4M3) if scales is None else scales[1]
            w_q, _ = quantize(weight, E4M3, w_scale)
            w_back = w_q  # backward makes its column-major copy
        else:  # cast once this step (cast_weight): q(W), q(W)^T and [amax, scale]
            w_q, w_back, w_amax, w_scale = w_cast, w_cast_t, w_stats[0], w_stats[1]
        x_q, _ = quantize(x, E4M3, x_scale)
        ctx.save_for_backward(x_q, x_scale, w_back, w_scale, x_amax, w_amax, scales)
        ctx.emulate, ctx.x_dtype, ctx.w_dtype = emulate, x.dtype, weight.dtype
        ctx.transposed = w_cast is not None
        return scaled_matmul(x_q, x_scale, w_q.t(), w_scale, x.dtype, emulate,
                             fast_accum=True)  # [M, N]

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x_q, x_scale, w_back, w_scale, x_amax, w_amax, scales = ctx.saved_tensors
        w_q = w_back.t() if ctx.transposed else w_back  # [N, K], column-major when cast once
        g_amax = amax_by_rows(grad_y)
        g_scale = scale_from_amax(g_amax, E5M2) if scales is None else scales[2]
        g_q, _ = quantize(grad_y, E5M2, g_scale)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dL/dx = g W: [M, N] @ [N, K]
            grad_x = scaled_matmul(g_q, g_scale, w_q, w_scale, ctx.x_dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:  # dL/dW = g^T x: [N, M] @ [M, K]
            grad_w = scaled_matmul(g_q.t(), g_scale, x_q, x_scale, ctx.w_dtype, ctx.emulate)
        amaxes = torch.stack([x_amax, w_amax, g_amax])
        return grad_x, grad_w, None, amaxes, None, None, None, None


def cast_weight(weight: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor,
                out_t: torch.Tensor, stats: torch.Tensor) -> None:
    """W's e4m3 cast, once per optimizer step, into `out` ([N, K]), `out_t` (its transpose,
    contiguous [K, N]: the column-major operand of the backward's dx = g W) and `stats`
    ([amax(W), s]); s = `scale`, or from the amax when None (current scaling). The same
    numbers as DelayedFloat8Matmul's cast of W in its forward (the plain path)."""
    w_amax = amax(weight)
    s = scale_from_amax(w_amax, E4M3) if scale is None else scale
    q, _ = quantize(weight, E4M3, s)
    out.copy_(q)
    out_t.copy_(q.t())
    stats.copy_(torch.stack([w_amax, s]))


CAST_BUFFERS = ("weight_fp8", "weight_fp8_t", "weight_fp8_stats")


@functools.cache
def compiled_cast_weight() -> Callable:
    """cast_weight through torch.compile (on a GPU: W read for its amax, then once more to write
    q(W) and its transpose; shapes dynamic, so one graph serves every linear, plus one for the
    first step's current scaling)."""
    return torch.compile(cast_weight, dynamic=True, fullgraph=True)


class DelayedFloat8Linear(Float8Linear):
    """Float8Linear with delayed scaling (module docstring): an amax history per tensor.

    Buffers (fp32, on the weight's device, not in the state dict): `amax_history` [3, H] (rows
    x, W, g; column 0 the newest step), `amax_pending` [3] (this step's running max) and
    `scales` [3] (fp8_max / the history's max, what the casts use). `delayed_ready` is False
    until the first `start_step()` after a recorded step: until then the layer scales currently.

    W is cast in every forward (the plain path, the default), or with `cache_weight` once per
    optimizer step (`start_step`) into `weight_fp8`, its transpose `weight_fp8_t` and
    `weight_fp8_stats` ([amax, scale]), which every training micro batch of the step then reads:
    W does not change within a step, so these are the numbers the plain path computes, in the
    same ops (compiled with `compile_cast`). Whoever changes W calls `end_fp8_step` first (the
    step runner does, before the optimizer step). As a guard for loops that do not, evaluation
    (eval mode or no grad) always casts in its forward, and a training forward drops the cast
    when W was replaced or its version counter moved (an eager forward, or the converted model's
    forward pre-hook, looks; a fused optimizer or a write through `.data` does not move it).
    """

    # True: W cast once per step. Off: on an H100, llama3-1b at two micro batches per step, the
    # plain path measured faster (three alternated fresh runs each, bench/RESULTS.md)
    # and keeps no q(W) between steps (2 bytes per
    # weight). The planner follows this switch (trireme.plan.activations.fp8_cast_once).
    cache_weight = False
    compile_cast = False  # the step's cast through torch.compile on a GPU (model.compile)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, emulate: bool = False, history: int = AMAX_HISTORY) -> None:
        super().__init__(in_features, out_features, bias, device, dtype, emulate=emulate)
        self._add_buffers(history, device)

    def _add_buffers(self, history: int, device) -> None:
        if history < 1:
            raise ConfigError(f"model.fp8_amax_history = {history} must be at least 1")
        fp32 = dict(device=device, dtype=torch.float32)
        self.register_buffer("amax_history", torch.zeros(3, history, **fp32), persistent=False)
        self.register_buffer("amax_pending", torch.zeros(3, **fp32), persistent=False)
        self.register_buffer("scales", torch.ones(3, **fp32), persistent=False)
        maxes = [torch.finfo(E4M3).max, torch.finfo(E4M3).max, torch.finfo(E5M2).max]
        self.register_buffer("fp8_max", torch.tensor(maxes, **fp32), persistent=False)
        self._new_sink(device)
        self.delayed_ready = False  # scales from the history (else: current scaling)
        self.recorded = False  # a step has started since the buffers were made
        for name in CAST_BUFFERS:  # made by the first cast_weight
            self.register_buffer(name, None, persistent=False)
        self.cast_ready = False  # weight_fp8 ... hold this step's W
        self.cast_version = -1  # W's version counter when it was cast
        self.cast_of = None  # a weak reference to the W cast

    @classmethod
    def from_linear(cls, linear: nn.Linear, emulate: bool = False,
                    history: int = AMAX_HISTORY) -> DelayedFloat8Linear:
        new = super().from_linear(linear, emulate)  # meta buffers: made again on the device
        new._add_buffers(history, linear.weight.device)
        return new

    def _new_sink(self, device) -> None:
        # the amaxes arrive as this leaf's gradient, once per backward (DelayedFloat8Matmul)
        sink = torch.zeros(3, device=device, dtype=torch.float32, requires_grad=True)
        sink.register_post_accumulate_grad_hook(self._record)
        self.register_buffer("amax_sink", sink, persistent=False)

    def _apply(self, fn, recurse=True):
        """.to(), .cuda(), .bfloat16() ...: the amax state stays fp32, the sink a leaf with its
        hook (a dtype change would make it a plain tensor)."""
        super()._apply(fn, recurse)
        for name in ("amax_history", "amax_pending", "scales", "fp8_max"):
            self._buffers[name] = self._buffers[name].float()
        sink = self._buffers["amax_sink"]
        if not sink.requires_grad or sink.dtype != torch.float32:
            self._new_sink(sink.device)
        for name in CAST_BUFFERS:  # made again (fp8, on the new device) by the next cast
            self._buffers[name] = None
        self.cast_ready = False
        return self

    @torch.no_grad()
    def _record(self, sink: torch.Tensor) -> None:
        """After a backward: pending = max(pending, this micro batch's (x, W, g) amaxes)."""
        torch.maximum(self.amax_pending, sink.grad, out=self.amax_pending)
        sink.grad = None

    @torch.no_grad()
    def start_step(self) -> None:
        """Before each optimizer step: the last step's amaxes become the newest history column,
        the scales follow the history; from the second step on the layer scales with them."""
        if self.recorded:
            # a step with inf / NaN values (skipped by the optimizer) records nothing
            pending = torch.where(self.amax_pending.isfinite(), self.amax_pending, 0.0)
            history = torch.cat([pending[:, None], self.amax_history[:, :-1]], dim=1)  # [3, H]
            self.amax_history.copy_(history)
            self.amax_pending.zero_()
            top = self.amax_history.amax(dim=1)  # [3]; 0: nothing seen, keep the last scales
            new_scales = self.fp8_max / top.clamp(min=AMAX_EPS)
            self.scales.copy_(torch.where(top > 0, new_scales, self.scales))
            self.delayed_ready = True
        self.recorded = True
        self._cast_weight()

    def _cast_weight(self) -> None:
        """W's e4m3 cast for this step's micro batches (class docstring), with the scale they
        would use: the history's, or W's own amax on the first step."""
        weight = self.weight
        if not self.cache_weight or weight.is_meta:
            self.cast_ready = False
            return
        if self.weight_fp8 is None or self.weight_fp8.shape != weight.shape:
            n, k = weight.shape
            self.weight_fp8 = torch.empty(n, k, dtype=E4M3, device=weight.device)
            self.weight_fp8_t = torch.empty(k, n, dtype=E4M3, device=weight.device)
            self.weight_fp8_stats = torch.empty(2, dtype=torch.float32, device=weight.device)
        cast = compiled_cast_weight() if self.compile_cast and weight.is_cuda else cast_weight
        cast(weight.detach(), self.scales[1] if self.delayed_ready else None, self.weight_fp8,
             self.weight_fp8_t, self.weight_fp8_stats)
        self.cast_version, self.cast_of, self.cast_ready = weight._version, ref(weight), True

    def drop_cast(self) -> None:
        """W is about to change (the optimizer step): forwards cast it themselves until the
        next start_step."""
        self.cast_ready = False

    def check_cast(self) -> None:
        """Drop the cast if W was replaced or changed in place (its version counter moved)."""
        if self.cast_ready and (self.cast_of() is not self.weight
                                or self.weight._version != self.cast_version):
            self.cast_ready = False

    def _matmul(self, x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scales = self.scales if self.delayed_ready else None
        if self.cast_ready and self.training and torch.is_grad_enabled():  # (guarded on)
            return DelayedFloat8Matmul.apply(x2d, weight, scales, self.amax_sink, self.emulate,
                                             self.weight_fp8, self.weight_fp8_t,
                                             self.weight_fp8_stats)
        return DelayedFloat8Matmul.apply(x2d, weight, scales, self.amax_sink, self.emulate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # (compiled: the model's pre-hook has looked)
            self.check_cast()
        return fp8_linear(x, self.weight, self.bias, self.emulate, self._matmul)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", delayed scaling (history {self.amax_history.shape[1]})"


def start_fp8_step(model: nn.Module) -> None:
    """Roll every delayed-scaling layer's amax history and cast its weight (once per optimizer
    step, before the step's first forward)."""
    for module in model.modules():
        if isinstance(module, DelayedFloat8Linear):
            module.start_step()


def end_fp8_step(model: nn.Module) -> None:
    """Drop every delayed-scaling layer's weight cast (before the optimizer step changes W)."""
    for module in model.modules():
        if isinstance(module, DelayedFloat8Linear):
            module.drop_cast()


@torch.compiler.disable  # (reads version counters: not traceable)
def check_weight_casts(model: nn.Module, args) -> None:
    """A forward pre-hook of a converted model: drop the weight casts of layers whose W changed
    since (a loop that steps its optimizer without end_fp8_step; the compiled blocks cannot
    read a version counter themselves)."""
    for module in model.modules():
        if isinstance(module, DelayedFloat8Linear):
            module.check_cast()


def to_fp8_training(model: nn.Module, device: torch.device | str, emulate: bool = False,
                    backend: str = "trireme",
                    targets: tuple[str, ...] = FP8_LINEARS, scaling: str = "current",
                    history: int = AMAX_HISTORY, compile_cast: bool = False) -> list[str]:
    """What `model.precision = "fp8"` does to a built model: check the device, then swap the
    transformer blocks' linears named by `targets` (default all of FP8_LINEARS) for fp8 ones from
    `backend` ("trireme": this file; "torchao": torchao.float8, tensorwise current scaling).
    `scaling` "delayed" (trireme only) gives DelayedFloat8Linear with `history` steps of amax,
    casting its weight once a step through torch.compile with `compile_cast` (on a GPU).
    Returns the names swapped."""
    check_fp8_device(device, emulate)
    if scaling not in SCALINGS:
        raise ConfigError(f"model.fp8_scaling = {scaling!r} is not one of {list(SCALINGS)}")
    if backend == "torchao":
        if scaling != "current":
            raise ConfigError("model.fp8_scaling = 'delayed' needs model.fp8_backend = "
                              "'trireme' (torchao's is current scaling)")
        return convert_with_torchao(model, emulate, targets)
    return convert_to_float8(model, emulate, targets, scaling, history, compile_cast)


def _fp8_candidate(name: str, module: nn.Module, targets: tuple[str, ...]) -> bool:
    """`name` ends with one of `targets` (whole name parts) and is not converted yet."""
    matches = any(f".{name}".endswith(f".{t}") for t in targets)
    return matches and not isinstance(module, Float8Linear)


def convert_with_torchao(model: nn.Module, emulate: bool = False,
                         targets: tuple[str, ...] = FP8_LINEARS) -> list[str]:
    """convert_to_float8_training from torchao (an optional dependency) on the same layers as
    convert_to_float8: its defaults are the same recipe (e4m3 forward, e5m2 gradients, one
    current scale per tensor). Parameter names stay as they are."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError("model.fp8_backend = 'torchao' needs the torchao package (pip install "
                          "torchao); or use model.fp8_backend = 'trireme'") from e
    swapped = []

    def wanted(module: nn.Module, name: str) -> bool:
        if not _fp8_candidate(name, module, targets) or type(module) is not nn.Linear:
            return False
        if module.in_features % ALIGN or module.out_features % ALIGN:
            return False
        swapped.append(name)
        return True

    convert_to_float8_training(model, module_filter_fn=wanted,
                               config=Float8LinearConfig(emulate=emulate))
    return swapped


def convert_to_float8(model: nn.Module, emulate: bool = False,
                      targets: tuple[str, ...] = FP8_LINEARS, scaling: str = "current",
                      history: int = AMAX_HISTORY, compile_cast: bool = False) -> list[str]:
    """Swap the linears whose names end with one of `targets` for Float8Linear (scaling
    "current") or DelayedFloat8Linear ("delayed", `history` steps, `compile_cast`), in place.

    Returns the names swapped. A layer with in or out features not a multiple of 16 stays as it
    is (bf16). Raises ConfigError on a tensor-parallel layer (not supported yet).
    """
    swapped = []
    for name, module in list(model.named_modules()):
        if not _fp8_candidate(name, module, targets):
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(
                f"model.precision = 'fp8' with tensor parallelism is not supported yet ({name} "
                f"is a {type(module).__name__}); use parallel.tensor = 1 or model.precision = "
                "'bf16'"
            )
        if module.in_features % ALIGN or module.out_features % ALIGN:
            continue
        parent_name, _, attr = name.rpartition(".")
        if scaling == "delayed":
            new = DelayedFloat8Linear.from_linear(module, emulate, history)
            new.compile_cast = compile_cast
        else:
            new = Float8Linear.from_linear(module, emulate)
        setattr(model.get_submodule(parent_name), attr, new)
        swapped.append(name)
    if scaling == "delayed" and swapped:
        model.register_forward_pre_hook(check_weight_casts)
    return swapped
