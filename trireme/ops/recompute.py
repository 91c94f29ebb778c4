"""Activation recomputation: run a function again in the backward instead of keeping its insides.

`recompute(fn, *args)` is torch.utils.checkpoint's non-reentrant checkpoint: the forward keeps
only `args` (and what fn's result is kept for by the layers after it); the backward runs `fn`
again to rebuild the tensors its gradient needs. The recomputation must draw the same dropout
masks as the forward:

- the default generator (CPU and the devices of the tensor arguments): checkpoint saves its state
  before the forward and restores it for the recomputation (`random=True`);
- the tensor-parallel streams (trireme.parallel.random.TensorParallelRNG, a state held in Python
  and swapped in by `fork()`): checkpoint does not know them, and by the time of the backward they
  have moved on (other layers and micro batches drew from them). `rngs` names the streams fn
  draws from; their states at the forward are put back for the recomputation, and the streams are
  left as they were before it.

The GPT blocks use this in two ways (train.recompute): "full" recomputes a whole block (only its
input is kept); "selective" recomputes two cheap parts that keep a lot: the attention core (RoPE,
QK-norm and the attention kernel, from the QKV projection to the output projection's input) and
the MLP activation (silu(gate) * up, or gelu; not with model.fused_swiglu, whose backward keeps
only fc1's output anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:  # annotations only: ops sit below parallel
    from trireme.parallel.random import TensorParallelRNG


MODES = ("none", "selective", "full")


def _replaying(fn: Callable, rngs: Sequence[TensorParallelRNG]) -> Callable:
    """fn that records the streams' states on its first call (the forward) and replays them on
    every later call (recomputations), leaving the streams as it found them."""
    saved: list[torch.Tensor] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if not saved:
            saved.extend(rng.state for rng in rngs)
            return fn(*args, **kwargs)
        current = [rng.state for rng in rngs]
        for rng, state in zip(rngs, saved):
            rng.state = state
        try:
            return fn(*args, **kwargs)
        finally:
            for rng, state in zip(rngs, current):
                rng.state = state

    return run


def recompute(
    fn: Callable,
    *args: Any,
    random: bool = False,
    rngs: Sequence[TensorParallelRNG | None] = (),
    **kwargs: Any,
) -> Any:
    """fn(*args, **kwargs), its intermediate tensors recomputed in the backward.

    `random`: fn draws random numbers (dropout), so the default generator's state is saved for
    the recomputation; `rngs`: the tensor-parallel streams fn may draw from (None entries and
    duplicates are ignored; only used with `random`)."""
    streams = list({id(r): r for r in rngs if r is not None}.values()) if random else []
    if streams:
        fn = _replaying(fn, streams)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=random, **kwargs)
