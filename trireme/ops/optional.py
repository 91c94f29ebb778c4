"""Loading an optional Triton kernel: every op with one (accumulate, swiglu, moe_permute,
fused_cross_entropy, paged_attention, skinny_gemm, argmax) imports its `*_triton` module through
a function decorated with `optional_kernel`, which turns a failed import (Triton missing, or
installed but broken: no compiler, a wrong version) into None and one warning, and the op then
runs its plain torch path.

    @optional_kernel("the greedy ids and finite flags use torch's argmax and isfinite")
    def _kernel():
        from trireme.ops.argmax_triton import greedy_and_finite
        return greedy_and_finite

The import is tried once per process (as Python's own imports are)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def optional_kernel(instead: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """A decorator for `load` (no arguments: imports a Triton module, returns its launcher):
    the decorated function returns load()'s result, or None with the warning "Triton is
    unavailable (why); <instead>" (`instead`: what runs in its place) when load raises.
    Cached: load runs once."""

    def wrap(load: Callable[[], Any]) -> Callable[[], Any]:
        @functools.cache
        @functools.wraps(load)
        def loaded() -> Any:
            try:
                return load()
            except Exception as e:  # missing, or installed but broken
                warnings.warn(f"Triton is unavailable ({e}); {instead}", stacklevel=2)
                return None

        return loaded

    return wrap
