"""Programmatic dependent launch (PDL, sm_90 and later): a kernel launched with it may start
while the kernel before it in the stream is finishing (its programs scheduled, its setup done),
and waits (griddepcontrol.wait) for that kernel to complete, its writes visible, before it
touches memory. In a decode step of ~140 short kernels this hides part of each launch.

The Triton kernels that take it (skinny GEMM, paged decode attention, greedy ids) call
trireme.ops.pdl_triton.enter first when their PDL constexpr is set: wait, then let the next
kernel launch. Every write comes after the wait, so no kernel overwrites what an earlier one
still reads, and every such kernel waits, so "this kernel completed" still implies "every kernel
before it completed" for the one after it. `launch_pdl(t, kernels)` says whether to launch with
it: t on a CUDA device of capability >= 9, unless the engine's KernelSettings.pdl is off
(`trireme serve --pdl off`; trireme.ops.kernel_settings). On the H200 it took the serving
engine's decode step at batch 64 from 1.50-1.51 to 1.44-1.46 ms, and the same greedy tokens
came out with and without it (bench/pdl_check.py; bench/RESULTS.md). Inductor's own
PDL (TORCHINDUCTOR_ENABLE_PDL=1, for the compiled step's elementwise kernels) measured no gain
there and stays off.

Early reads (`early_reads`, on with PDL unless KernelSettings.early_reads is off:
`--early-reads off`): before its wait a kernel may ask the L2 for lines it will read
(prefetch.global.L2: a hint, no registers held, and the L2 is coherent across SMs, so a
prefetch only has to stay inside the tensor), and may load into registers what no kernel after
the one two places before it writes. Every PDL kernel here
waits before it lets the next one launch (enter: wait, then launch_dependents), and a kernel
launched without PDL starts only after the one before it completed; so when kernel N + 1 starts,
kernel N - 1 and all before it have completed. The paged kernel loads the step's lengths and
block tables early: they are copied in before the step's graph replays (or built before its
forward). On an H100 they made the decode step at batch 64 measurably faster (four
alternated fresh runs each) with the same greedy tokens (bench/RESULTS.md).
"""

from __future__ import annotations

import functools

import torch

from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelSettings


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_pdl(t: torch.Tensor, kernels: KernelSettings = DEFAULT_KERNELS) -> bool:
    """Whether a kernel reading t launches with PDL (module docstring)."""
    return t.is_cuda and kernels.pdl and _capable(t.device.index or 0)


def early_reads(t: torch.Tensor, kernels: KernelSettings = DEFAULT_KERNELS) -> bool:
    """Whether a kernel launched with PDL for input t issues, before its wait, the first reads
    of what no kernel of the step writes (unless kernels.early_reads is off): the
    split-K GEMMs their first weight tile (weights are never written while serving), the paged
    kernel its first tile of earlier steps' keys and values (and the step's lengths and block
    tables, set before its first layer). Those reads then overlap the kernel before it."""
    return launch_pdl(t, kernels) and kernels.early_reads
