"""Copy a model state (name -> tensor) into a module: all or nothing, every problem in one error."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from trireme.checkpoint.format import tensor_identity
from trireme.errors import CheckpointError


class LoadResult(NamedTuple):
    """Keys skipped by a non-strict `load_model_state`."""

    missing: list[str]
    unexpected: list[str]


def _listing(label: str, items: list[str], limit: int = 8) -> str:
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"{label}: {', '.join(items[:limit])}{more}"


def load_model_state(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> LoadResult:
    """Copy `state` into the model's parameters and persistent buffers by name.

    Values are converted to each parameter's dtype and device. Nothing is copied unless everything
    fits: shape mismatches always raise, and with `strict` so do missing and unexpected keys, all
    listed in one CheckpointError. Tied parameters (one tensor under several names) are satisfied by
    any of their names; if the state holds several of them, they must agree.
    """
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, Tensor)}
    groups: dict[int, list[str]] = {}  # one entry per distinct tensor: all its names
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    missing: list[str] = []
    mismatched: list[str] = []
    conflicting: list[str] = []
    copies: list[tuple[Tensor, Tensor]] = []
    for names in groups.values():
        present = [n for n in names if n in state]
        if not present:
            missing.extend(names)
            continue
        target = targets[names[0]]
        shapes_fit = True
        for n in present:
            value = state[n]
            if not isinstance(value, Tensor):
                raise CheckpointError(
                    f"model state {n!r} is a {type(value).__qualname__}, not a tensor"
                )
            if tuple(value.shape) != tuple(target.shape):
                shapes_fit = False
                mismatched.append(
                    f"{n}: checkpoint {tuple(value.shape)} vs model {tuple(target.shape)}"
                )
        first = state[present[0]]
        if shapes_fit and any(tensor_identity(state[n]) != tensor_identity(first)
                              and not torch.equal(state[n], first) for n in present[1:]):
            conflicting.append("=".join(present))
        copies.append((target, first))
    unexpected = [n for n in state if n not in targets]
    problems = []
    if strict and missing:
        problems.append(_listing("missing keys", missing))
    if strict and unexpected:
        problems.append(_listing("unexpected keys", unexpected))
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    if conflicting:
        problems.append(_listing("tied in the model but different in the checkpoint", conflicting))
    if problems:
        raise CheckpointError(
            "checkpoint does not fit the model: " + "; ".join(problems)
            + " (was it saved with a different model config? compare its config.toml)"
        )
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value)
    return LoadResult(missing=missing, unexpected=unexpected)
