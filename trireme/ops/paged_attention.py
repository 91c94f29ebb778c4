"""Decode attention over a paged KV pool (the serving engine's cache, trireme.models.paged).

    q [r, n_heads, d], pools [num_blocks, block_size, n_kv, d], tables [r, W], lengths [r]
    -> [r, n_heads, d]: request i's query heads over its first lengths[i] keys, which sit in
       blocks tables[i, 0], tables[i, 1], ... (position p at offset p % block_size)

On CUDA with Triton (and power-of-two head and block sizes) one kernel reads the blocks in place
(trireme.ops.paged_attention_triton; $TRIREME_PAGED_KERNEL=v2 picks its opt-in second
variant); elsewhere, and as the reference, the blocks are gathered into a padded
[r, n_kv, W * block_size, d] copy (one index_select per pool) and attended with one masked SDPA
call (trireme.ops.attention.padded_attention).
"""

from __future__ import annotations

import functools
import warnings

import torch

from trireme.errors import ConfigError
from trireme.ops.attention import padded_attention


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


@functools.cache
def _kernel():
    """trireme.ops.paged_attention_triton's launcher, or None (with a warning) without Triton."""
    try:
        from trireme.ops.paged_attention_triton import paged_decode_attention as launch
    except Exception as e:  # missing, or installed but broken
        warnings.warn(f"Triton is unavailable ({e}); paged decode attention gathers the KV "
                      "blocks and runs SDPA", stacklevel=2)
        return None
    return launch


def kernel_available() -> bool:
    """Whether the Triton kernel can run here (Triton imports, and it has not failed)."""
    return _kernel() is not None and not _FAILED


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor,
                           backend: str = "auto") -> torch.Tensor:
    """The module docstring's attention; `backend` "reference" (or any forced SDPA kernel)
    takes the gather path."""
    if (q.is_cuda and backend == "auto" and _power_of_two(q.shape[-1])
            and _power_of_two(k_pool.shape[1]) and not _FAILED):
        launch = _kernel()
        if launch is not None:
            try:
                with torch.cuda.device(q.device):
                    return launch(q, k_pool, v_pool, tables, lengths)
            except ConfigError:  # a bad $TRIREME_PAGED_KERNEL: say so, do not fall back
                raise
            except Exception as e:  # a Triton compile error: keep serving on the plain path
                if torch.cuda.is_current_stream_capturing():
                    raise  # a CUDA graph capture gives up on its own (trireme.inference.graphs)
                warnings.warn(f"the paged decode kernel failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); gathering the KV blocks instead", stacklevel=2)
                _FAILED.append(e)
    return paged_decode_reference(q, k_pool, v_pool, tables, lengths, backend)


_FAILED: list[Exception] = []  # the kernel failed once in this process: not tried again
