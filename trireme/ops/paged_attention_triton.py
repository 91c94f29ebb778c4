"""Decode attention straight from a paged KV pool, as one Triton kernel (imported only when it
runs: it needs Triton).

q is [r, n_heads, d] (one query per request), the pools [num_blocks, block_size, n_kv, d],
tables [r, W] the block ids of each request, lengths [r] its number of keys. Program (b, h)
serves request b's kv head h and the `groups` query heads that share it (padded to 16 rows, the
smallest tl.dot): it walks the request's keys TILE at a time (a tile spans TILE / block_size
blocks, gathered through the table), with the online softmax

    m' = max(m, max_j s_j)     l' = l e^(m - m') + sum_j e^(s_j - m')
    acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j          out = acc / l

in fp32, s_j = q . k_j / sqrt(d) (the products through tl.dot on fp32 operands: tf32 tensor
cores on the GPU; the kernel is bound by reading the keys, not by these products). Keys are read
once, in place: no gathered copy, and no work past each request's own length (the table's padding
is never read).
trireme.ops.paged_attention has the plain torch version it is tested against (through Triton's
CPU interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr, stride_or, stride_oh,
    scale,
    GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths_ptr + b)
    g = tl.arange(0, GROUPS_POW2)  # the query heads of kv head h
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    g_mask = g < GROUPS
    q_rows = h * GROUPS + g
    q = tl.load(q_ptr + b * stride_qr + q_rows[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # [G, D]
    q = q.to(tl.float32) * scale
    m = tl.full([GROUPS_POW2], float("-inf"), tl.float32)
    denom = tl.zeros([GROUPS_POW2], tl.float32)
    acc = tl.zeros([GROUPS_POW2, D], tl.float32)
    for start in range(0, length, TILE):
        pos = start + t  # [TILE] key positions
        valid = pos < length
        block = tl.load(tables_ptr + b * stride_tr + pos // BLOCK, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_kb + (pos % BLOCK) * stride_ks + h * stride_kh
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)))  # [G, TILE] in fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))  # [G, D]
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + b * stride_or + q_rows[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[r, n_heads, d]: each request's query heads over its first lengths[r] keys."""
    r, n_heads, d = q.shape
    n_kv = k_pool.shape[2]
    block = k_pool.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    groups = n_heads // n_kv
    tile = max(64, block)  # several blocks per iteration: more loads in flight
    _paged_decode_kernel[(r, n_kv)](
        q, k_pool, v_pool, tables, lengths, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        tables.stride(0), out.stride(0), out.stride(1), 1.0 / math.sqrt(d),
        GROUPS=groups, GROUPS_POW2=max(16, triton.next_power_of_2(groups)), D=d, BLOCK=block,
        TILE=tile,
        num_warps=4,
    )
    return out
