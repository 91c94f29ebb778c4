"""The decode-only paged attention step, in a form torch.compile can trace a whole transformer
block's decode forward around (trireme.inference.compiled_decode).

    store_kv(k_pool, v_pool, slots, k, v):   k_pool.view(-1, n_kv, d)[slots[i]] = k[i]  (and v)
    y = decode_attention(q, k_pool, v_pool, tables, lengths)   y[i]: q[i] over its request's
                                                                first lengths[i] keys
    q [n, H, d], k, v [n, n_kv, d], pools [num_blocks, block_size, n_kv, d], slots [n],
    tables [n, W], lengths [n] -> y [n, H, d] (contiguous, q's dtype)

The store is plain torch (an index_copy_), which Inductor fuses into the kernel that applies
RoPE to k (the pools are graph inputs it writes in place). The attention is
`torch.ops.trireme.paged_decode_attention`, a torch.library custom op with a fake (meta)
implementation that only makes y's shape: dynamo keeps it as one node it does not look into (the
Triton kernel or the gather path, trireme.ops.paged_attention), reading the pools after the
store. Eagerly, `write_and_attend` calls the same two pieces without the op's dispatch.
"""

from __future__ import annotations

import torch

from trireme.ops.paged_attention import paged_decode_attention


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The step's keys and values into their pool rows (block * block_size + offset)."""
    n_kv, d = k_pool.shape[2], k_pool.shape[3]
    k_pool.view(-1, n_kv, d).index_copy_(0, slots, k)  # [num_blocks * bs, n_kv, d]
    v_pool.view(-1, n_kv, d).index_copy_(0, slots, v)


@torch.library.custom_op("trireme::paged_decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     tables: torch.Tensor, lengths: torch.Tensor, backend: str) -> torch.Tensor:
    """trireme.ops.paged_attention.paged_decode_attention as an op torch.compile keeps whole."""
    return paged_decode_attention(q, k_pool, v_pool, tables, lengths, backend).contiguous()


@decode_attention.register_fake
def _(q, k_pool, v_pool, tables, lengths, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)  # [n, H, d]


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The module docstring's step (y [n, H, d]); under torch.compile through the custom op."""
    store_kv(k_pool, v_pool, slots, k, v)
    if torch.compiler.is_compiling():
        return torch.ops.trireme.paged_decode_attention(q, k_pool, v_pool, tables, lengths,
                                                        backend)
    return paged_decode_attention(q, k_pool, v_pool, tables, lengths, backend).contiguous()
