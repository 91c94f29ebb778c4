"""Decode attention over a paged KV pool (the serving engine's cache, trireme.models.paged).

    q [r, n_heads, d], pools [num_blocks, block_size, n_kv, d], tables [r, W], lengths [r]
    -> [r, n_heads, d]: request i's query heads over its first lengths[i] keys, which sit in
       blocks tables[i, 0], tables[i, 1], ... (position p at offset p % block_size)

On CUDA with Triton (and power-of-two head and block sizes) one kernel reads the blocks in place
(trireme.ops.paged_attention_triton; KernelSettings.paged_kernel, the engine's `--paged-kernel`,
picks its variant and launch settings); elsewhere, and as the reference, the blocks are gathered
into a padded [r, n_kv, W * block_size, d] copy (one index_select per pool) and attended with one
masked SDPA call (trireme.ops.attention.padded_attention).

With `new` = (k_new, v_new [r, n_kv, d], slots [r]), this decode step's keys and values, the call
also stores them: request i's key at position lengths[i] - 1 is k_new[i], and afterwards the
pools hold k_new[i], v_new[i] at row slots[i] (block * block_size + offset of that position, in
the [num_blocks * block_size, n_kv, d] view), exactly as

    store_new(k_pool, v_pool, new)   # two index_copy_ launches
    paged_decode_attention(q, k_pool, v_pool, tables, lengths)

which is what the gather path does. The kernel does both in its one launch (how, and why it
cannot race with itself: trireme.ops.paged_attention_triton).

If the kernel fails (a Triton compile error) the call warns and takes the gather path, and the
`failures` it was handed (the serving engine's KernelFailures) remember it: that engine does not
try the kernel again; a call without one tries it each time.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from trireme.errors import ConfigError
from trireme.ops.attention import padded_attention
from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelFailures, KernelSettings
from trireme.ops.optional import optional_kernel

NewKeys = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # k_new, v_new [r, n_kv, d], slots [r]


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[r, n_kv, W * block_size, d]: the blocks `tables` [r, W] names, as one padded view."""
    r, width = tables.shape
    blocks = pool.index_select(0, tables.reshape(-1))  # [r * W, bs, n_kv, d]
    return blocks.view(r, width * pool.shape[1], *pool.shape[2:]).transpose(1, 2)


def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor,
                           backend: str = "auto") -> torch.Tensor:
    keys, values = gather_blocks(k_pool, tables), gather_blocks(v_pool, tables)
    y = padded_attention(q.unsqueeze(2), keys, values, lengths, backend)  # [r, H, 1, d]
    return y.squeeze(2)


@optional_kernel("paged decode attention gathers the KV blocks and runs SDPA")
def _kernel():
    """trireme.ops.paged_attention_triton's launcher, or None (with a warning) without Triton."""
    from trireme.ops.paged_attention_triton import paged_decode_attention as launch
    return launch


KERNEL = "paged_attention"  # its name in KernelFailures


def kernel_available(failures: KernelFailures | None = None) -> bool:
    """Whether the Triton kernel can run here (Triton imports, and it has not failed for the
    owner of `failures`)."""
    return _kernel() is not None and KERNEL not in (failures or ())


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fits_kernel(q: torch.Tensor, k_pool: torch.Tensor, backend: str) -> bool:
    """Whether the Triton kernel is the one to try: CUDA, backend "auto", power-of-two head and
    block sizes."""
    return (q.is_cuda and backend == "auto" and _power_of_two(q.shape[-1])
            and _power_of_two(k_pool.shape[1]))


def store_new(k_pool: torch.Tensor, v_pool: torch.Tensor, new: NewKeys) -> None:
    """k_new, v_new [r, n_kv, d] into the pools' rows slots [r] (block * block_size + offset),
    in place: the reference's half of `new` (module docstring)."""
    k_new, v_new, slots = new
    block = k_pool.shape[1]
    at = (slots // block, slots % block)  # any pool strides (a head-major pool's view too)
    k_pool.index_put_(at, k_new)
    v_pool.index_put_(at, v_new)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor,
                           backend: str = "auto", new: NewKeys | None = None,
                           kernels: KernelSettings = DEFAULT_KERNELS,
                           failures: KernelFailures | None = None) -> torch.Tensor:
    """The module docstring's attention; `backend` "reference" (or any forced SDPA kernel)
    takes the gather path. With `new` = (k_new, v_new, slots) this step's keys are stored
    first (the kernel: as it attends; elsewhere store_new, then the gather path). `kernels`:
    the kernel's variant and launch (the engine's); `failures`: the engine's record of failed
    kernels (module docstring)."""
    if _fits_kernel(q, k_pool, backend) and KERNEL not in (failures or ()):
        launch = _kernel()
        if launch is not None:
            try:
                with torch.cuda.device(q.device):
                    return launch(q, k_pool, v_pool, tables, lengths, new=new, kernels=kernels)
            except ConfigError:  # a bad kernels.paged_kernel: say so, do not fall back
                raise
            except Exception as e:  # a Triton compile error: keep serving on the plain path
                if torch.cuda.is_current_stream_capturing():
                    raise  # a CUDA graph capture gives up on its own (trireme.serving.graphs)
                warnings.warn(f"the paged decode kernel failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); gathering the KV blocks instead", stacklevel=2)
                if failures is not None:
                    failures.record(KERNEL, e)
    if new is not None:
        store_new(k_pool, v_pool, new)
    return paged_decode_reference(q, k_pool, v_pool, tables, lengths, backend)


WARM_SPLITS = (1, 2, 4, 8, 16)  # every split count default_splits can pick


def warm_up(k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int, width: int,
            store: bool, kernels: KernelSettings = DEFAULT_KERNELS) -> None:
    """Compile now the kernels a serving engine's eager steps may launch on these pools: one
    query over a table of `width` blocks, at every split count (the count a step gets depends
    on its batch and its longest context, so a step could otherwise meet a new one, and its
    Triton compile, a stall in the middle of serving), without and, if `store`, with the
    fused store (writing zeros into row 0 of block 0, the padding block no request owns).
    Nothing on the CPU, without Triton, or where the kernel is not the one that runs."""
    d = k_pool.shape[-1]
    q = k_pool.new_zeros(1, n_heads, d)
    if not _fits_kernel(q, k_pool, "auto") or _kernel() is None:
        return
    tables = torch.zeros(1, width, dtype=torch.long, device=q.device)
    lengths = torch.ones(1, dtype=torch.long, device=q.device)
    kv = k_pool.new_zeros(1, k_pool.shape[2], d)
    slots = torch.zeros(1, dtype=torch.long, device=q.device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        for splits in WARM_SPLITS:
            for new in [None, (kv, kv, slots)][: 2 if store else 1]:
                _kernel()(q, k_pool, v_pool, tables, lengths, splits=splits, new=new,
                          kernels=kernels)
