"""A save refuses a model or optimizer state that holds NaN or Inf.

A checkpoint of a diverged run would be resumed from (it becomes `latest`) and would hide the
last good one behind it under `checkpoint.keep_last`; so each format checks what it is about to
write, before anything is on disk, and names the first tensor that is not finite.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from trireme.errors import CheckpointError


def first_nonfinite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf, or None. One host sync
    per device: the per-tensor flags are stacked before they are read."""
    names: dict[torch.device, list[str]] = {}
    flags: dict[torch.device, list[Tensor]] = {}
    for name, t in named:
        if t.is_floating_point() and t.numel():
            names.setdefault(t.device, []).append(name)
            flags.setdefault(t.device, []).append(torch.isfinite(t.detach()).all())
    bad = [n for dev in names for n, ok in zip(names[dev], torch.stack(flags[dev]).tolist())
           if not ok]
    return bad[0] if bad else None


def describe_key(key: str) -> str:
    """'model/layers.0.w' -> 'model tensor layers.0.w'; 'exp_avg/w' -> 'optimizer tensor ...'."""
    kind, _, name = key.partition("/")
    if kind == "model":
        return f"model tensor {name}"
    if kind == "optimizer":
        return f"optimizer tensor {name}"
    return f"tensor {key}"


def nonfinite_error(what: str, step: int) -> CheckpointError:
    return CheckpointError(
        f"checkpoint not saved: {what} holds NaN/Inf at step {step}; training has diverged, so "
        "nothing was written (resume from an earlier checkpoint, e.g. with a lower optimizer.lr)")
