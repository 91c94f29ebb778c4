"""The Triton side of trireme.ops.pdl (imported only where the kernels run: it needs Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def enter(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one (its writes visible), then let the next
    one launch. Without it nothing (the interpreter has no griddepcontrol)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
