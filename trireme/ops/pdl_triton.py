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


@triton.jit
def l2_prefetch(at):
    """prefetch.global.L2 of each address in `at`: a hint that holds no registers (its result
    is a dummy, kept: not pure). For what a kernel may read before its PDL wait (reads of what
    no earlier kernel of the step writes: trireme.ops.pdl.early_reads)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [at],
                              dtype=tl.int32, is_pure=False, pack=1)
