"""A compiled decode forward for the serving engine (EngineSettings.compile_decode).

A decode step of a 1B model spends about as much GPU time in small elementwise kernels (norms,
RoPE's cat, residual adds, silu * up, casts, the KV writes) as in its GEMMs. torch.compile fuses
them: each block's decode forward

    x -> x + attention(norm(x)) -> x + mlp(norm(x))      (qkv, RoPE, paged step, out, fc1, fc2)

is traced whole (fullgraph), the paged decode kernel being one opaque custom op
(trireme.ops.paged_decode_op), and Inductor makes one kernel of each run of elementwise work
between the GEMMs (the step's KV writes go into the kernel that applies RoPE to k).

- One compiled function serves every block (they differ only in their weights, which are graph
  inputs), so a model's 16 layers share one graph per batch size.
- The first batch size compiles with static shapes (the CUDA graphs capture the largest bucket
  first, trireme.inference.graphs); the next one makes dynamo recompile with the batch dimension
  dynamic, which serves the other buckets (batch 1 gets one of its own). The block tables' width
  is dynamic from the start. All this happens in the graphs' warm-up; the recompile limit is
  raised around these calls only (RECOMPILE_LIMIT), not for the process.
- Only decode-only steps run compiled (PagedCache.forward_layer); prefill and mixed steps stay
  eager, and the eager forward stays the reference the tests hold this one to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from trireme.models.paged import PagedCache, PagedStep

RECOMPILE_LIMIT = 64  # graphs compiled per process: batch buckets x dtypes x models


def _decode_layer(block: torch.nn.Module, x: torch.Tensor, rope: Any,
                  state: dict[str, Any]) -> torch.Tensor:
    """One block's decode forward, x [1, T, h] -> [1, T, h] (what torch.compile traces)."""
    return block.layer(x, rope, state, 0)


def _limit_key() -> str:
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@functools.cache
def compiled_layer(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """The compiled `_decode_layer` (one per backend per process: its compilations are shared
    by every engine and layer)."""
    compiled = torch.compile(_decode_layer, backend=backend, fullgraph=True)

    def run(block: torch.nn.Module, x: torch.Tensor, rope: Any, state: dict[str, Any],
            step: PagedStep) -> torch.Tensor:
        # the tables' width changes with the longest context (eager steps) or is the graphs'
        # fixed width: nothing in the graph depends on it, so it never asks for a recompile
        torch._dynamo.maybe_mark_dynamic(step.decode_tables, 1)
        with torch._dynamo.config.patch(**{_limit_key(): RECOMPILE_LIMIT}):
            return compiled(block, x, rope, state)

    return run


def compile_decode(cache: PagedCache, backend: str = "inductor") -> None:
    """Run `cache`'s decode-only steps through the compiled blocks."""
    cache.compiled_layer = compiled_layer(backend)
