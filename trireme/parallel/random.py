"""Random numbers for dropout under tensor and sequence parallelism.

Dropout must agree with the layout of the tensor it drops from:

- where an activation is replicated over the tensor-parallel ranks (the residual stream without
  sequence parallelism), every rank must draw the same mask, else the replicas drift apart. That
  is the default generator: it is seeded with train.seed on every rank, and all ranks draw from it
  in the same order.
- where an activation is split (attention heads under TP; the residual stream's sequence shards
  under SP), each rank must draw its own mask, else every shard repeats one pattern. That dropout
  runs inside `TensorParallelRNG.fork()`, which swaps in a second stream seeded per TP rank.

At tensor = 1 nothing is forked and the numbers are the single-process ones.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def name_seed(seed: int, name: str) -> int:
    """A 64-bit generator seed derived from (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TensorParallelRNG:
    """A random stream of its own for each tensor-parallel rank, a function of (seed, rank)."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        generator = torch.Generator(device=self.device)
        generator.manual_seed(name_seed(seed, f"dropout/tensor-parallel-rank/{tp_rank}"))
        self.state = generator.get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block with this stream as the device's default generator."""
        outer = _get_state(self.device)
        _set_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(self.device, outer)


def fork_rng(
    rng: TensorParallelRNG | None, active: bool = True
) -> contextlib.AbstractContextManager:
    """`rng.fork()`, or nothing when there is no tensor parallelism or nothing random to draw."""
    if rng is None or not active:
        return contextlib.nullcontext()
    return rng.fork()


class ShardedDropout(nn.Module):
    """Dropout on a tensor split across the tensor-parallel ranks: each rank draws its own mask."""

    def __init__(self, p: float, rng: TensorParallelRNG) -> None:
        super().__init__()
        self.p = p
        self.rng = rng  # a plain attribute: no parameters, no state dict entries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork():
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, per tensor-parallel rank"


def dropout(p: float, rng: TensorParallelRNG | None) -> nn.Module:
    """nn.Dropout for replicated activations (rng None); ShardedDropout for split ones;
    nn.Identity at p = 0 (the default: dropout of 0 returns its input and draws no random
    numbers, but each call still cost an eager step a module call and an aten op, ~2-3 per
    layer: serving's eager prompt steps are bound by such host work)."""
    if p == 0.0:
        return nn.Identity()
    return nn.Dropout(p) if rng is None else ShardedDropout(p, rng)
