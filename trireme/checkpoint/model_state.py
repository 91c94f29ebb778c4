"""A model's state (name -> tensor): what `GPT(cfg)` holds, and copying a state into a model.

`expected_shapes` / `check_state` compare a state with the model a config describes (built on the
meta device: no memory, no init); `load_model_state` copies a state into a module, all or
nothing, every problem in one error; `model_from_state` builds a model straight from a state
(`trireme generate`), with no random init.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor, nn

from trireme.checkpoint.format import tensor_identity
from trireme.checkpoint.gathered import fit_vocab_rows
from trireme.config import ModelConfig
from trireme.errors import CheckpointError
from trireme.models.gpt import GPT
from trireme.parallel.context import ParallelContext
from trireme.parallel.sharding import parameter_shardings, shard_full


class LoadResult(NamedTuple):
    """Keys skipped by a non-strict `load_model_state`."""

    missing: list[str]
    unexpected: list[str]


def listing(label: str, items: list[str], limit: int = 6) -> str:
    """"label: a, b, c, ... (N more)": the first `limit` items of a list for an error message."""
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"{label}: {', '.join(items[:limit])}{more}"


def without_optional_kernels(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its optional packages' kernels off: attention_backend 'fa4' -> 'auto' and no
    model.kernels (liger). They are speed choices (the same tensors, the same function), so a
    checkpoint trained with them loads for inference or conversion without those packages."""
    backend = "auto" if cfg.attention_backend == "fa4" else cfg.attention_backend
    return dataclasses.replace(cfg, attention_backend=backend, kernels=[])


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the state of `GPT(cfg)` (built on the meta device;
    optional kernels off: the shapes are the same without them)."""
    with torch.device("meta"):
        model = GPT(without_optional_kernels(cfg), seed=None)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_state(cfg: ModelConfig, state: dict[str, Tensor], source: str) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped tensors of `state`."""
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    mismatched = [f"{n}: {tuple(t.shape)} vs {expected[n]}" for n, t in state.items()
                  if n in expected and tuple(t.shape) != expected[n]]
    problems = []
    if missing:
        problems.append(listing("missing", missing))
    if unexpected:
        problems.append(listing("unexpected", unexpected))
    if mismatched:
        problems.append(listing("shapes (got vs config)", mismatched))
    if problems:
        raise CheckpointError(f"{source} does not fit its own config: " + "; ".join(problems))


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
        problems.append(listing("missing keys", missing, 8))
    if strict and unexpected:
        problems.append(listing("unexpected keys", unexpected, 8))
    if mismatched:
        problems.append(listing("shape mismatches", mismatched, 8))
    if conflicting:
        problems.append(listing("tied in the model but different in the checkpoint", conflicting,
                                8))
    if problems:
        raise CheckpointError(
            "checkpoint does not fit the model: " + "; ".join(problems)
            + " (was it saved with a different model config? compare its config.toml)"
        )
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value)
    return LoadResult(missing=missing, unexpected=unexpected)


def model_from_state(cfg: ModelConfig, state: dict[str, Tensor], device: torch.device | str,
                     dtype: torch.dtype | None = None, ctx: ParallelContext | None = None
                     ) -> GPT:
    """`GPT(cfg)` holding `state`, built without a random init: the modules are made on the meta
    device and cast to `dtype` there (tensors a model keeps in fp32, such as MoE's selection
    bias, stay so and get the stored values exactly), their storage allocated on `device`
    (uninitialized), every tensor filled from `state` (`load_model_state`, strict: nothing is
    left uninitialized).
    With a tensor-parallel `ctx`, `state` is the full model (any checkpoint: they are stored in
    the single-process form) and this rank keeps its slice (trireme.checkpoint.gathered).

    The rotary embedding's frequencies are no parameters: `RotaryEmbedding` computes them on the
    CPU when built (under the meta device too) and its cos / sin table on first use, so they
    equal a fully initialized model's."""
    with torch.device("meta"):
        model = GPT(cfg, seed=None, ctx=ctx)
    if dtype is not None:  # before the values: tensors kept in fp32 (MoE's selection bias)
        model.to(dtype=dtype)  # then take theirs unrounded
    model.to_empty(device=device)
    if model.tp is not None:
        state = fit_vocab_rows(state, model.padded_vocab_size)  # this degree's padding
        state = shard_full(state, parameter_shardings(model))
    load_model_state(model, state)
    return model
