"""Adding a low-precision gradient into an fp32 main gradient: `dst += src`.

The plain path is `dst.add_(src)`. On CUDA, for a bf16 / fp16 `src` and contiguous tensors, one
vectorized Triton kernel does it instead (trireme.ops.accumulate_triton: torch's mixed-dtype add
runs at about half the memory bandwidth); without Triton the plain path runs, with one warning.
"""

from __future__ import annotations

import torch

from trireme.ops.optional import optional_kernel


def accumulate_reference(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src (torch's add, any device and dtypes)."""
    dst.add_(src)


@optional_kernel("fp32 gradients accumulate through torch's add")
def _triton_accumulate():
    """trireme.ops.accumulate_triton.accumulate, or None (with a warning) without Triton."""
    from trireme.ops.accumulate_triton import accumulate as launch
    return launch


def fast_path_applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_cuda and dst.dtype == torch.float32
            and src.dtype in (torch.bfloat16, torch.float16) and dst.is_contiguous()
            and src.is_contiguous() and dst.numel() == src.numel())


def accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src: the Triton kernel where it applies (module docstring), else torch's add."""
    launch = _triton_accumulate() if fast_path_applies(dst, src) else None
    if launch is None:
        accumulate_reference(dst, src)
        return
    with torch.cuda.device(dst.device):  # Triton launches on the current device
        launch(dst, src)
