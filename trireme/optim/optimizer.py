"""AdamW with low-precision parameters, fp32 master weights and fp32 main gradients.

With `precision="fp32"` this is torch's AdamW plus global-norm clipping and a skip on a non-finite
gradient. With bf16 / fp16 (and fp8, whose parameters are bf16) the model's parameters are low
precision (the caller casts the model) and the optimizer keeps, on the same device:

    master  one flat fp32 buffer; each trainable parameter owns an aligned slice of it (a view)
    grads   one flat fp32 buffer with the same layout; `param.main_grad` is the parameter's view

A hook that runs after autograd has accumulated a parameter's gradient adds it (in fp32) into
`param.main_grad` and frees `param.grad`, so accumulation over micro batches happens in fp32 and a
low-precision gradient lives only until its hook runs. torch's AdamW updates the master views, whose
`.grad` are the main-grad views; the updated masters are then cast back into the model's parameters.
Data parallelism reduces the flat gradient buffer in buckets (`trireme.step.data_parallel`); the
distributed optimizer (`trireme.optim.distributed`) shards the masters and AdamW's moments.

One training step:

    optimizer.zero_grad()
    for micro_batch in micro_batches:
        optimizer.scale_loss(loss_fn(model, micro_batch) / len(micro_batches)).backward()
    stats = optimizer.step(lr)   # {"grad_norm", "skipped", "loss_scale"}: tensors, no host sync

fp16 adds dynamic loss scaling: the loss is multiplied by a scale before backward, the gradients are
divided by it in `step`; an overflow (a non-finite gradient norm) skips the update and halves the
scale, and `loss_scale_window` good steps in a row double it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from trireme.config import OptimizerConfig
from trireme.errors import CheckpointError
from trireme.ops.accumulate import accumulate
from trireme.optim.layout import GradLayout, grad_layout

Precision = Literal["fp32", "bf16", "fp16", "fp8"]  # fp8: bf16 parameters
# (name, gradient) of every optimized parameter -> the global L2 norm (a device scalar)
GradNormFn = Callable[[list[tuple[str, torch.Tensor]]], torch.Tensor]
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state tensors

def is_no_decay(name: str, kinds: Sequence[str]) -> bool:
    """Whether the parameter `name` is excluded from weight decay by the kinds in `kinds`."""
    return (
        ("norm" in kinds and "norm" in name)
        or ("bias" in kinds and (name == "bias" or name.endswith(".bias")))
        or ("embedding" in kinds and "embedding" in name)
        or ("ssm" in kinds and name.endswith((".A_log", ".D", ".dt_bias")))  # Mamba-2's
    )


def named_trainable_parameters(
    model: nn.Module | Iterable[nn.Module],
) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, each shared parameter once.

    `model` may also be a list of model chunks (virtual pipeline stages); their parameter names are
    global (`layers.17...`), so they must not collide.
    """
    modules = [model] if isinstance(model, nn.Module) else list(model)
    seen: set[int] = set()
    names: set[str] = set()
    out: list[tuple[str, nn.Parameter]] = []
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            if name in names:
                raise ValueError(f"two model chunks both have a parameter named {name!r}")
            seen.add(id(p))
            names.add(name)
            out.append((name, p))
    return out


def _accumulate_main_grad(param: torch.Tensor) -> None:
    # Runs after autograd accumulated this micro batch's gradient into param.grad.
    accumulate(param.main_grad, param.grad)  # bf16/fp16 -> fp32, in one kernel
    param.grad = None


class MixedPrecisionOptimizer:
    """AdamW over fp32 master weights for fp32 / bf16 / fp16 models (see the module docstring).

    Attributes:
        names: names of the optimized parameters, in buffer order.
        params: the model's parameters, in the same order.
        masters: name -> fp32 tensor that AdamW updates (a view of the flat master buffer for
            bf16 / fp16, the model's parameter itself for fp32).
        group_names: parameter names of each param group of `inner`, in group order.
        inner: the torch.optim.AdamW doing the update.

    `grad_norm`, when given, computes the global gradient norm from (name, gradient) pairs; tensor
    parallelism passes one that counts each element of the full model once across the ranks.

    `layout` (data parallelism) places the main gradients in the flat buffer in reduction buckets;
    with it an fp32 model also gets the flat main-gradient buffer (its masters stay the
    parameters). Without it an fp32 model uses plain `.grad`, as torch does.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        opt: OptimizerConfig,
        precision: Precision,
        device: torch.device | str,
        grad_norm: GradNormFn | None = None,
        layout: GradLayout | None = None,
    ) -> None:
        if precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise ValueError(f"precision must be fp32, bf16, fp16 or fp8, got {precision!r}")
        if not named_params:
            raise ValueError("the model has no trainable parameters")
        device = torch.device(device)
        self.opt = opt
        self.precision = precision
        self.low_precision = precision != "fp32"
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._grad_norm_fn = grad_norm
        self._hooks: list[Any] = []
        self.flat_grads = self.low_precision or layout is not None
        if not self.low_precision:
            bad = [(n, p.dtype) for n, p in named_params if p.dtype != torch.float32]
            if bad:
                raise ValueError(
                    f"precision fp32 needs fp32 parameters, but {bad[0][0]!r} is {bad[0][1]}"
                )
        if self.flat_grads:
            self.layout = layout or grad_layout([p.numel() for p in self.params])
            self._build_grad_buffer(device)
        self.masters: dict[str, torch.Tensor] = self._build_masters(device)

        decay = [(n, t) for n, t in self.masters.items() if not is_no_decay(n, opt.no_decay)]
        no_decay = [(n, t) for n, t in self.masters.items() if is_no_decay(n, opt.no_decay)]
        groups, self.group_names = [], []
        for members, wd in ((decay, opt.weight_decay), (no_decay, 0.0)):
            if members:
                groups.append({"params": [t for _, t in members], "weight_decay": wd})
                self.group_names.append([n for n, _ in members])

        self.fused = opt.fused == "true" or (opt.fused == "auto" and device.type == "cuda")
        self.inner = torch.optim.AdamW(
            groups,
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            fused=self.fused,
            foreach=not self.fused,
        )
        # Loss scale and the count of good steps since the last change live on the device, so the
        # fp16 bookkeeping needs no host synchronisation.
        initial_scale = opt.initial_loss_scale if precision == "fp16" else 1.0
        self._scale = torch.tensor(initial_scale, dtype=torch.float32, device=device)
        self._good_steps = torch.zeros((), dtype=torch.int64, device=device)

    def _build_grad_buffer(self, device: torch.device) -> None:
        self._grad_flat = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
        for p, start in zip(self.params, self.layout.offsets):
            p.main_grad = self._grad_flat[start : start + p.numel()].view(p.shape)
            self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))

    def _build_masters(self, device: torch.device) -> dict[str, torch.Tensor]:
        """name -> the fp32 tensor AdamW updates, its `.grad` set where it is fixed."""
        if not self.low_precision:
            # fp32: the parameters themselves; with flat grads `.grad` is pointed at the
            # main-gradient view in `step` (not before: autograd would accumulate into it)
            self._master_list = self.params
            return dict(zip(self.names, self.params))
        self._master_flat = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
        self._master_list = []
        for p, start in zip(self.params, self.layout.offsets):
            master = self._master_flat[start : start + p.numel()].view(p.shape)
            master.copy_(p.detach())
            master.grad = p.main_grad  # AdamW reads the fp32 gradient from here
            self._master_list.append(master)
        return dict(zip(self.names, self._master_list))

    # ------------------------------------------------------------------------------------------
    # The training step

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (a device scalar; 1 unless fp16)."""
        return self._scale

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 main-gradient buffer (bf16 / fp16, or any precision with a `layout`)."""
        return self._grad_flat

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale under fp16, else unchanged."""
        return loss * self._scale if self.precision == "fp16" else loss

    def zero_grad(self) -> None:
        """Clear the gradients before the first micro batch of a step."""
        if self.flat_grads:
            self._grad_flat.zero_()
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        if self.flat_grads:
            return [self._grad_flat]  # padding is zero, so norms over the flat buffer are exact
        return [p.grad for p in self.params if p.grad is not None]

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(name, gradient) per parameter: the main-gradient views, or the .grad (0 if none)."""
        if self.flat_grads:
            return [(n, p.main_grad) for n, p in zip(self.names, self.params)]
        return [(n, p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in zip(self.names, self.params)]

    @torch.no_grad()
    def step(self, lr: float, loss: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Unscale, measure and clip the gradients, update (unless non-finite), copy back.

        Returns device scalars: `grad_norm` (global L2 norm before clipping, unscaled), `skipped`
        (1.0 if the update was skipped for a non-finite gradient norm, or a non-finite `loss`
        when one is given: it must be the same on every rank) and `loss_scale` (the scale for
        the next step). A skipped step leaves the weights and AdamW's moments as they were.
        With the fused kernel (default on CUDA) the skip happens on the device and nothing
        synchronises with the host; with the foreach kernel one `.item()` decides the skip.
        """
        grads = self._grads()
        if self.precision == "fp16":
            torch._foreach_mul_(grads, self._scale.reciprocal())
        grad_norm = self._global_grad_norm(grads)
        grad_norm = grad_norm.to(device=self._scale.device, dtype=torch.float32)
        found_inf = (~torch.isfinite(grad_norm)).float()
        if loss is not None:  # on the device: no host sync
            bad_loss = ~torch.isfinite(loss.to(device=found_inf.device, dtype=torch.float32))
            found_inf = torch.maximum(found_inf, bad_loss.float())
        if self.opt.clip_grad > 0 and grads:
            # The same arithmetic as torch.nn.utils.clip_grad_norm_, applied to our grad tensors.
            clip_coef = (self.opt.clip_grad / (grad_norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, clip_coef)

        for group in self.inner.param_groups:
            group["lr"] = lr
        if self.flat_grads and self._master_list is self.params:
            for p in self.params:  # fp32 with a flat buffer: AdamW reads the main gradients
                p.grad = p.main_grad
        if self.fused:
            self.inner.found_inf = found_inf  # the fused kernel skips the whole update if 1
            self.inner.step()
            updated = True
        else:
            updated = not found_inf.item()  # the one host sync of the foreach path
            if updated:
                self.inner.step()
        if updated:
            self.sync_params_from_master()
        if self.precision == "fp16":
            self._update_loss_scale(found_inf.bool())
        return {"grad_norm": grad_norm, "skipped": found_inf, "loss_scale": self._scale.clone()}

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's gradient (over every parallel group)."""
        if self._grad_norm_fn is not None:
            return self._grad_norm_fn(self._named_grads())
        if self.flat_grads:  # per parameter, as without the buffer: the same sums (a norm over
            grads = [p.main_grad for p in self.params]  # millions of fp32 values drifts ~1e-4)
        if grads:
            return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return torch.zeros((), device=self._scale.device)

    def _update_loss_scale(self, found_inf: torch.Tensor) -> None:
        # All on the device: halve on overflow (not below min_loss_scale); double after
        # loss_scale_window good steps in a row.
        good = torch.where(found_inf, 0, self._good_steps + 1)
        grow = good >= self.opt.loss_scale_window
        halved = (self._scale * 0.5).clamp(min=self.opt.min_loss_scale)
        scale = torch.where(found_inf, halved, torch.where(grow, self._scale * 2.0, self._scale))
        self._scale.copy_(scale)
        self._good_steps.copy_(torch.where(grow, 0, good))

    # ------------------------------------------------------------------------------------------
    # Checkpointing: plain tensors and numbers keyed by parameter name

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, independent of parameter order and layout.

        `{"exp_avg": {name: fp32}, "exp_avg_sq": {name: fp32}, "master": {name: fp32} (bf16/fp16
        only), "step": int, "loss_scale": float, "good_steps": int, "precision": str}`. The tensors
        are the live ones (master tensors are views of the flat buffer): move or clone them before
        the next step if they are written asynchronously.
        """
        exp_avg, exp_avg_sq = {}, {}
        for name in self.masters:
            moments = self.moments(name)
            if moments:
                exp_avg[name] = moments["exp_avg"]
                exp_avg_sq[name] = moments["exp_avg_sq"]
        out: dict[str, Any] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, **self.scalar_state()}
        if self.low_precision:
            out["master"] = dict(self.masters)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`, possibly saved under another precision or parameter order.

        Names in `state` that this model lacks are ignored (they belong to another pipeline stage);
        a parameter of this model missing from a non-empty state is an error. The `master` weights,
        when present, overwrite the model's parameters; without them (e.g. an fp32 checkpoint) the
        master weights are taken from the model's current parameters.
        """
        exp_avg, exp_avg_sq, step = self._check_state(state)
        self.load_moments(exp_avg, exp_avg_sq, step)
        masters = state.get("master") or {}
        for name, t in self.masters.items():
            if name in masters:
                t.copy_(masters[name])
        if self.low_precision:
            if len(masters) == 0:
                self.sync_master_from_params()
            self.sync_params_from_master()
        self.load_scalar_state(state)

    def _check_state(self, state: dict[str, Any]) -> tuple[dict, dict, int]:
        """(exp_avg, exp_avg_sq, step) of a state_dict, checked against this model."""
        try:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            step = int(state["step"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"optimizer state is malformed (missing or bad {e})") from None
        missing = [n for n in self.names if n not in exp_avg or n not in exp_avg_sq]
        if exp_avg and missing:
            raise CheckpointError(
                f"optimizer state has no entry for {len(missing)} parameter(s) of this model, e.g. "
                f"{missing[0]!r}; the checkpoint was saved from a different model"
            )
        for name, p in zip(self.names, self.params):
            for src in (exp_avg, exp_avg_sq, state.get("master", {})):
                if name in src and tuple(src[name].shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"optimizer state for {name!r} has shape {tuple(src[name].shape)}, the "
                        f"model's parameter {tuple(p.shape)}; the checkpoint is from another model"
                    )
        return exp_avg, exp_avg_sq, step

    # ------------------------------------------------------------------------------------------
    # The state interface both checkpoint formats use (trireme/checkpoint/): per-name master
    # tensors (`masters`), their AdamW moments, the optimizer's numbers, and the copies between
    # masters and parameters. No checkpoint code reads a private field.

    def master_ranges(self) -> dict[str, tuple[int, int] | None]:
        """name -> which part of the parameter `masters[name]` (and its moments) holds here: a
        range (first, last + 1) of the parameter's flattened elements, or None for all of it
        (always None here; the distributed optimizer holds ranges). In buffer order."""
        return {name: None for name in self.names}

    def moments(self, name: str) -> dict[str, torch.Tensor]:
        """AdamW's live moments of `masters[name]`, {"exp_avg": t, "exp_avg_sq": t} (fp32, the
        master's shape); {} before the first step or `load_moments`."""
        state = self.inner.state.get(self.masters[name])
        return {key: state[key] for key in MOMENTS} if state else {}

    def has_moments(self) -> bool:
        """Whether AdamW holds moments (after a step, or `load_moments`)."""
        return any(self.inner.state.get(m) for m in self.masters.values())

    def scalar_state(self) -> dict[str, Any]:
        """The optimizer's numbers: {"step": AdamW's step count, "loss_scale": float,
        "good_steps": fp16's good steps since the last scale change, "precision": str}."""
        steps = [st["step"].to(torch.float32) for st in self.inner.state.values() if "step" in st]
        return {
            "step": int(torch.stack(steps).max().item()) if steps else 0,
            "loss_scale": float(self._scale.item()),
            "good_steps": int(self._good_steps.item()),
            "precision": self.precision,
        }

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore the loss scale and good-step count of a `scalar_state()` (fp16 saved and
        loaded only; otherwise the scale stays as built)."""
        if self.precision == "fp16" and state.get("precision") == "fp16":
            self._scale.fill_(float(state["loss_scale"]))
            self._good_steps.fill_(int(state["good_steps"]))

    @torch.no_grad()
    def load_moments(self, exp_avg: dict[str, torch.Tensor], exp_avg_sq: dict[str, torch.Tensor],
                     step: int) -> None:
        """Set AdamW's state of each master named in `exp_avg` from name -> tensor of the
        master's shape (copied; the state never aliases the caller's tensors), all at `step`.
        Masters not named get no state."""
        torch_state = self.inner.state_dict()
        index = {}  # id(tensor) -> torch's integer key of the parameter
        for group_sd, group in zip(torch_state["param_groups"], self.inner.param_groups):
            index.update({id(t): i for i, t in zip(group_sd["params"], group["params"])})
        new_state = {}
        for name, t in self.masters.items():
            if name in exp_avg:
                new_state[index[id(t)]] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    # copy=True so the live state never aliases the caller's tensors
                    "exp_avg": exp_avg[name].to(t.device, torch.float32, copy=True),
                    "exp_avg_sq": exp_avg_sq[name].to(t.device, torch.float32, copy=True),
                }
        torch_state["state"] = new_state
        self.inner.load_state_dict(torch_state)

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Copy the model's parameters into the master weights (after loading model weights)."""
        if self.low_precision:
            torch._foreach_copy_(self._master_list, [p.detach() for p in self.params])

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        """Copy the master weights into the model's parameters (after each update, and after
        loading masters); fp32 -> bf16 / fp16. A no-op in fp32, where they are the same tensors."""
        if self.low_precision:
            torch._foreach_copy_(self.params, self._master_list)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this process: fp32 masters kept apart from the
        model's parameters, and AdamW's moments."""
        masters = self._master_flat.numel() * 4 if self.low_precision else 0
        moments = sum(t.numel() * t.element_size() for st in self.inner.state.values()
                      for k, t in st.items() if k != "step")
        return masters + moments

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters (ends the optimizer's use)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def build_optimizer(
    model: nn.Module | Sequence[nn.Module],
    opt: OptimizerConfig,
    precision: Precision,
    device: torch.device | str,
    grad_norm: GradNormFn | None = None,
    layout: GradLayout | None = None,
) -> MixedPrecisionOptimizer:
    """AdamW for `model` (or a list of model chunks) whose parameters are already in `precision`.

    Weight decay applies to every parameter except the kinds in `opt.no_decay`: "norm" (names
    containing "norm"), "bias" (names ending in ".bias"), "embedding" (names containing
    "embedding"), "ssm" (Mamba-2's A_log, D, dt_bias). Load the model's weights before building
    it (or call `sync_master_from_params`).
    """
    return MixedPrecisionOptimizer(
        named_trainable_parameters(model), opt, precision, device, grad_norm, layout
    )
