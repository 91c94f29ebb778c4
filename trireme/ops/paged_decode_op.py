"""A decode-only paged attention step as one opaque op, so that torch.compile can trace a whole
transformer block's decode forward around it (trireme.inference.compiled_decode).

    write_and_attend(q, k, v, k_pool, v_pool, slots, tables, lengths) -> y
        k_pool.view(-1, n_kv, d)[slots[i]] = k[i]        (likewise v: the step's keys go in)
        y[i] = paged_decode_attention(q[i] over its request's first lengths[i] keys)
    q [n, H, d], k, v [n, n_kv, d], pools [num_blocks, block_size, n_kv, d], slots [n],
    tables [n, W], lengths [n] -> y [n, H, d] (contiguous, q's dtype)

Eagerly it is plain Python (trireme.models.paged calls `write_and_attend` itself); under
torch.compile the block calls `torch.ops.trireme.paged_decode_step`, a torch.library custom op
that declares the two pools it writes, with a fake (meta) implementation that only makes y's
shape. Dynamo then sees one node it does not look into (the Triton kernel or the gather path,
trireme.ops.paged_attention) and Inductor fuses the elementwise work around it.
"""

from __future__ import annotations

import torch

from trireme.ops.paged_attention import paged_decode_attention


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The module docstring's step: store k, v at `slots`, then attend (y [n, H, d])."""
    n_kv, d = k_pool.shape[2], k_pool.shape[3]
    k_pool.view(-1, n_kv, d).index_copy_(0, slots, k)  # [num_blocks * bs, n_kv, d]
    v_pool.view(-1, n_kv, d).index_copy_(0, slots, v)
    y = paged_decode_attention(q, k_pool, v_pool, tables, lengths, backend)
    return y.contiguous()


@torch.library.custom_op("trireme::paged_decode_step", mutates_args=("k_pool", "v_pool"))
def paged_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, backend: str) -> torch.Tensor:
    """`write_and_attend` as an op torch.compile keeps whole (module docstring)."""
    return write_and_attend(q, k, v, k_pool, v_pool, slots, tables, lengths, backend)


@paged_decode_step.register_fake
def _(q, k, v, k_pool, v_pool, slots, tables, lengths, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)  # [n, H, d]
