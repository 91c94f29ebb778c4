"""A decode step's greedy token ids and per-row "logits are finite" flags, from one read of the
logits (the serving engine's sampler, trireme.serving.sampling / engine).

    logits [n, V] -> [2, n] int64:
        row 0: ids[i]    = argmax_j logits[i, j]    the first index among ties; NaN counts as
                                                    the largest value (torch.argmax's rule)
        row 1: finite[i] = 1 if all_j isfinite(logits[i, j]) else 0

On CUDA with Triton one split reduction reads the logits once (trireme.ops.argmax_triton: about
n * V * itemsize bytes, e.g. 16 MB at [64, 128256] bf16, with enough programs to fill the GPU
at small n); elsewhere, and as the reference, torch's argmax and isfinite(...).all (an argmax
reduce with one program per row, and an isfinite / all chain of several passes).
"""

from __future__ import annotations

import warnings

import torch

from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelFailures, KernelSettings
from trireme.ops.optional import optional_kernel


def greedy_and_finite_reference(logits: torch.Tensor) -> torch.Tensor:
    """The module docstring's [2, n] int64 by plain torch ops."""
    return torch.stack([logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()])


@optional_kernel("the greedy ids and finite flags use torch's argmax and isfinite")
def _kernel():
    """trireme.ops.argmax_triton's launcher, or None (with a warning) without Triton."""
    from trireme.ops.argmax_triton import greedy_and_finite as launch
    return launch


KERNEL = "argmax"  # its name in KernelFailures


def kernel_available(failures: KernelFailures | None = None) -> bool:
    """Whether the Triton kernel can run here (Triton imports, and it has not failed for the
    owner of `failures`)."""
    return _kernel() is not None and KERNEL not in (failures or ())


def greedy_and_finite(logits: torch.Tensor, kernel: bool | None = None,
                      kernels: KernelSettings = DEFAULT_KERNELS,
                      failures: KernelFailures | None = None) -> torch.Tensor:
    """[2, n] int64 for logits [n, V] (bf16 / fp16 / fp32): row 0 the argmax ids, row 1 the
    finite flags (module docstring). The Triton kernel on CUDA (`kernel` True: also elsewhere,
    e.g. CPU tensors under Triton's interpreter; False: never), launched as `kernels` says
    (PDL: trireme.ops.pdl); torch's ops on the CPU, without Triton, or once the kernel failed
    (a warning, then the plain path; inside a CUDA graph capture the error is raised): recorded
    in `failures` (a serving engine's), it is not tried again by their owner."""
    usable = (logits.dim() == 2 and 0 < logits.shape[1] < 2**31 - 1
              and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))
    wanted = logits.is_cuda if kernel is None else kernel
    if usable and wanted and KERNEL not in (failures or ()):
        launch = _kernel()
        if launch is not None:
            try:
                return launch(logits, kernels=kernels)
            except Exception as e:  # a Triton compile error: keep serving on the plain path
                if logits.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise  # a CUDA graph capture gives up on its own (trireme.serving.graphs)
                warnings.warn(f"the greedy / finite kernel failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); using torch's argmax and isfinite instead",
                              stacklevel=2)
                if failures is not None:
                    failures.record(KERNEL, e)
    return greedy_and_finite_reference(logits)


def warm_up(vocab: int, padded: int, dtype: torch.dtype, device: torch.device,
            kernels: KernelSettings = DEFAULT_KERNELS) -> None:
    """Compile the kernel now for logits [*, vocab] of `dtype` on `device` (CUDA only), in both
    layouts a serving step hands it: a slice of [*, padded] rows (the output layer's) and
    contiguous rows (an index_select of them). Triton specializes a kernel on whether integer
    arguments divide by 16, so the two row strides may be two compiled kernels; compiling them
    during a step would stall it for the compile."""
    if device.type != "cuda":
        return
    wide = torch.zeros(1, max(padded, vocab), dtype=dtype, device=device)
    greedy_and_finite(wide[:, :vocab], kernels=kernels)
    greedy_and_finite(wide[:, :vocab].contiguous(), kernels=kernels)
