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

Splitting the context (flash-decoding): with few requests, (r, n_kv) programs leave most of the
GPU idle, each walking its whole context alone. Then program (b, h, j) of SPLITS takes the j-th
of SPLITS equal chunks (whole tiles) of the request's keys and writes its unnormalised partial
(m_j, l_j, acc_j); a second kernel merges them:

    M = max_j m_j      out = sum_j e^(m_j - M) acc_j / sum_j e^(m_j - M) l_j

(an empty chunk has m = -inf, l = 0, acc = 0 and weighs nothing; chunk 0 is never empty).
`splits` defaults to enough programs for 1.5 per SM (default_splits; SPLITS = 1 at batch 64
with 8 kv heads, 2 per program); TILE, num_warps, num_stages and the grid's order can be set too
(bench/serve_profile.py --kernel-configs sweeps them).
Variant v2, the default since an H200 sweep (SHIPPED: 2 kv heads per program, TILE 64, 2
warps, 2 stages: measured faster than v1 as shipped at batch 16-256, bench/RESULTS.md; v1
stays: `--paged-kernel v1`), keeps v1's math and
partials but reads differently. Program (b, c, j) serves HEADS kv heads at once
(3-D dots [HEADS, G, D] x [HEADS, D, TILE]), so each pool row it reads is HEADS * d * 2
contiguous bytes (HEADS = n_kv: a block's whole run) and there are HEADS times fewer programs;
its products take the pool's dtype (bf16 on the GPU, sums in fp32; p is rounded to it for the
p.v product, as flash attention does) where v1 converts K, V and p to fp32 (tf32 products).
Compiled for sm_90 (Triton 3.9, no GPU needed), v1 at its defaults runs 382 PTX instructions per
warp per 64-key tile (96 warp-instructions per KiB of K and V), v2 with HEADS 1 283 (71), with
HEADS 2, TILE 32 237 (59); both loops are pipelined by Triton (cp.async, num_stages). With
`prefetch` v2 instead issues tile i+1's K, V loads (tile i+2's block ids one iteration earlier)
into registers before tile i's math: a program always has the next tile in flight, at the cost
of about twice the registers (150-170 against 71-92), so fewer programs fit on an SM
(bench/paged_kernel_static.py prints these counts).

Storing this step's keys (NEW: `new` = k_new, v_new [r, n_kv, d], slots [r]; saves the two
index_copy_ launches per layer of a decode step). Request b's new key sits at position
last = lengths[b] - 1, pool row slots[b] (block slots[b] // BLOCK, offset slots[b] % BLOCK):

- every program reads from the pool only positions < min(end, last) (its tile loop, unchanged,
  runs to that bound);
- the program whose chunk first..end-1 holds position last then takes k_new[b], v_new[b] of its
  kv heads into the online softmax as one more key (s = q . k_new / sqrt(d) in fp32, after the
  loop, so the loop compiles as without NEW: bench/paged_kernel_static.py --new counts the same
  loop instructions; registers: v1 80 either way, v2 HEADS 2 TILE 32 94 against 80);
- the program of chunk j == 0 of each (request, kv heads) stores k_new[b], v_new[b] of its heads
  at row slots[b] of the pools.

So the call equals "pools[slots] = k_new, v_new (index_copy_), then the kernel without NEW":
bitwise for the pools, and the same keys for the attention (summed in another order: equal up
to rounding). No race: the rows written are position last of request b, the writer's own kv
heads, and no program reads them: request b's programs read positions < last only, and another
request's only its own blocks (trireme.serving.blocks hands each block to one request). The
CUDA graphs' padding rows (slot 0 in block 0, length 1) write that row from several programs, as
index_copy_ with repeated indices does; they read no pool at all (only their new key), and a
real request never reads block 0. Without NEW (a constexpr) the kernels are as before.
trireme.ops.paged_attention has the plain torch version both are tested against (through
Triton's CPU interpreter).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from trireme.errors import ConfigError
from trireme.ops.kernel_settings import (
    DEFAULT_KERNELS,
    PAGED_VARIANTS,
    KernelSettings,
    parse_paged_kernel,
)
from trireme.ops.pdl import early_reads, launch_pdl
from trireme.ops.pdl_triton import enter, l2_prefetch

NewKeys = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # k_new, v_new [r, n_kv, d], slots [r]


@triton.jit
def _new_key(q, m, denom, acc, k_new_ptr, v_new_ptr, slots_ptr, k_ptr, v_ptr, b, heads, cols, j,
             first, end, length, scale, stride_knr, stride_knh, stride_vnr, stride_vnh,
             stride_kb, stride_ks, stride_kh, BLOCK: tl.constexpr):
    """This step's key and value of request b, kv heads `heads` (h, or [HEADS, 1]) at columns
    `cols` (d, or [1, D]): chunk j == 0's program stores them into the pools' row slots[b]
    (block slot // BLOCK, offset slot % BLOCK), and the program whose chunk first..end-1 holds
    position length - 1 takes them into its online softmax (q [G, D] or [HEADS, G, D], m and
    denom [G] or [HEADS, G], acc as q) as one more key, s = q . k_new * scale in fp32."""
    k = tl.load(k_new_ptr + b * stride_knr + heads * stride_knh + cols)  # [D] or [HEADS, D]
    v = tl.load(v_new_ptr + b * stride_vnr + heads * stride_vnh + cols)
    if j == 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        row = (slot // BLOCK) * stride_kb + (slot % BLOCK) * stride_ks + heads * stride_kh
        tl.store(k_ptr + row + cols, k)
        tl.store(v_ptr + row + cols, v)
    last = length - 1
    if (last >= first) & (last < end):
        s = tl.sum(q.to(tl.float32) * tl.expand_dims(k.to(tl.float32), -2), axis=-1) * scale
        m_new = tl.maximum(m, s)
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + p
        acc = (acc * tl.expand_dims(alpha, -1)
               + tl.expand_dims(p, -1) * tl.expand_dims(v.to(tl.float32), -2))
        m = m_new
    return m, denom, acc


# stride_tr (the tables' width) varies with a step's longest request: not specialized on (no
# new compile when it becomes a multiple of 16)
@triton.jit(do_not_specialize=["stride_tr"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, k_new_ptr, v_new_ptr, slots_ptr,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr, stride_or, stride_oh,
    stride_knr, stride_knh, stride_vnr, stride_vnh, scale, n_heads,
    GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, HEADS_FIRST: tl.constexpr, NEW: tl.constexpr,
):
    if HEADS_FIRST:  # neighbouring programs: one request's kv heads (adjacent in the pool)
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    j = tl.program_id(2)  # this program's chunk of the keys (SPLITS > 1)
    length = tl.load(lengths_ptr + b)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), TILE) * TILE  # whole tiles
    first = j * chunk
    end = tl.minimum(first + chunk, length)
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
    pooled = end  # the keys first..pooled-1 are read from the pool
    if NEW:  # key length - 1 is this step's, taken after the loop (module docstring)
        pooled = tl.minimum(end, length - 1)
    for start in range(first, pooled, TILE):
        pos = start + t  # [TILE] key positions
        valid = pos < pooled
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
    if NEW:
        m, denom, acc = _new_key(q, m, denom, acc, k_new_ptr, v_new_ptr, slots_ptr, k_ptr,
                                 v_ptr, b, h, d, j, first, end, length, 1.0, stride_knr,
                                 stride_knh, stride_vnr, stride_vnh, stride_kb, stride_ks,
                                 stride_kh, BLOCK)
    if SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(out_ptr + b * stride_or + q_rows[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:  # partials [r, n_heads, SPLITS] (m, l) and [r, n_heads, SPLITS, D] (acc), fp32
        row = (b * n_heads + q_rows) * SPLITS + j  # [G]
        tl.store(part_m_ptr + row, m, mask=g_mask)
        tl.store(part_l_ptr + row, denom, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_or, stride_oh,
                         D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    """out[b, head] from the SPLITS partials of program (b, head) (module docstring)."""
    enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    j = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    row = (b * n_heads + head) * SPLITS + j  # [S]
    m = tl.load(part_m_ptr + row)
    weight = tl.exp(m - tl.max(m, axis=0))  # [S]; an empty chunk (m = -inf) weighs 0
    denom = tl.sum(weight * tl.load(part_l_ptr + row), axis=0)
    acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :])  # [S, D]
    out = tl.sum(weight[:, None] * acc, axis=0) / denom
    tl.store(out_ptr + b * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _tile_rows(tables_ptr, b, stride_tr, pos, end, stride_kb, stride_ks, BLOCK: tl.constexpr):
    """[TILE] pool row offsets of key positions `pos` (0 where pos >= end: masked, never read)."""
    valid = pos < end
    block = tl.load(tables_ptr + b * stride_tr + pos // BLOCK, mask=valid, other=0)
    return block.to(tl.int64) * stride_kb + (pos % BLOCK) * stride_ks


@triton.jit
def _tile_kv(k_at, v_at, tables_ptr, b, stride_tr, pos, end, stride_kb, stride_ks,
             BLOCK: tl.constexpr):
    """K^T [HEADS, D, TILE] and V [HEADS, TILE, D] of key positions `pos` [TILE] (k_at
    [HEADS, D, 1], v_at [HEADS, 1, D] at row 0's columns), and which are live (pos < end)."""
    rows = _tile_rows(tables_ptr, b, stride_tr, pos, end, stride_kb, stride_ks, BLOCK)
    live = pos < end
    k = tl.load(k_at + rows[None, None, :], mask=live[None, None, :], other=0.0)
    v = tl.load(v_at + rows[None, :, None], mask=live[None, :, None], other=0.0)
    return k, v, live


@triton.jit
def _warm_tile(k_ptr, v_ptr, heads, tables_ptr, b, stride_tr, pos, end, stride_kb, stride_ks,
               BLOCK: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    """EARLY: ask the L2 for the K and V rows of kv heads `heads` (offsets [HEADS]) at key
    positions `pos` [TILE] (past `end`: block 0's, which always exists), LINES prefetches
    LINE elements (128 bytes) apart per row (a row of d values), no registers held: the
    loop's first loads then find them there."""
    rows = _tile_rows(tables_ptr, b, stride_tr, pos, end, stride_kb, stride_ks, BLOCK)
    lines = tl.arange(0, LINES) * LINE
    at = heads[:, None, None] + rows[None, :, None] + lines[None, None, :]  # [HEADS, TILE, L]
    l2_prefetch(k_ptr + at)
    l2_prefetch(v_ptr + at)


@triton.jit
def _tile_step(q, k, v, live, scale, m, denom, acc):
    """The online softmax over one tile: q [H, G, D], k [H, D, T], v [H, T, D], live [T]."""
    s = tl.dot(q, k) * scale  # [H, G, T] fp32
    s = tl.where(live[None, None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=2))
    p = tl.exp(s - m_new[:, :, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)  # [H, G, D]
    return m_new, denom, acc


@triton.jit
def _walk_prefetched(q, k_at, v_at, tables_ptr, b, stride_tr, first, end, stride_kb, stride_ks,
                     scale, m, denom, acc, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Keys first..end-1 tile by tile, tile i+1's K, V loads (and tile i+2's block ids) issued
    before tile i's math; k_at [H, D, 1] and v_at [H, 1, D] point at row 0's columns."""
    t = tl.arange(0, TILE)
    rows = _tile_rows(tables_ptr, b, stride_tr, first + t, end, stride_kb, stride_ks, BLOCK)
    live = first + t < end
    k = tl.load(k_at + rows[None, None, :], mask=live[None, None, :], other=0.0)
    v = tl.load(v_at + rows[None, :, None], mask=live[None, :, None], other=0.0)
    rows = _tile_rows(tables_ptr, b, stride_tr, first + TILE + t, end, stride_kb, stride_ks,
                      BLOCK)
    for start in range(first, end, TILE):
        live_next = start + TILE + t < end
        k_next = tl.load(k_at + rows[None, None, :], mask=live_next[None, None, :], other=0.0)
        v_next = tl.load(v_at + rows[None, :, None], mask=live_next[None, :, None], other=0.0)
        rows = _tile_rows(tables_ptr, b, stride_tr, start + 2 * TILE + t, end, stride_kb,
                          stride_ks, BLOCK)
        m, denom, acc = _tile_step(q, k, v, start + t < end, scale, m, denom, acc)
        k = k_next
        v = v_next
    return m, denom, acc


@triton.jit(do_not_specialize=["stride_tr"])  # as v1's
def _paged_decode_v2_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, k_new_ptr, v_new_ptr, slots_ptr,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr, stride_or, stride_oh,
    stride_knr, stride_knh, stride_vnr, stride_vnh, scale, n_heads,
    GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, PREFETCH: tl.constexpr,
    NEW: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
    LINE: tl.constexpr = 64,
):
    """v2 (module docstring): program (b, c, j) serves kv heads c * HEADS .. + HEADS of request
    b (all their query heads) over chunk j; with PREFETCH the next tile's K, V loads are in
    flight while this tile's math runs. EARLY (with PDL, not PREFETCH): the chunk's first tile
    of pooled keys and values is prefetched into the L2 before the wait (_warm_tile; LINE: a
    128-byte line's elements), after reading the step's lengths and tables (trireme.ops.pdl:
    why that read is safe there)."""
    if not EARLY:
        enter(PDL)  # first: as every PDL kernel without early reads
    b = tl.program_id(0)
    kh = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS] this program's kv heads
    j = tl.program_id(2)
    length = tl.load(lengths_ptr + b)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), TILE) * TILE  # whole tiles
    first = j * chunk
    end = tl.minimum(first + chunk, length)
    g = tl.arange(0, GROUPS_POW2)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    q_rows = kh[:, None] * GROUPS + g[None, :]  # [HEADS, G] query heads
    g_mask = (g < GROUPS)[None, :] & (kh >= 0)[:, None]  # [HEADS, G]
    k_cols = (kh * stride_kh)[:, None, None] + d[None, :, None]  # [HEADS, D, 1]: K^T tiles
    v_cols = (kh * stride_kh)[:, None, None] + d[None, None, :]  # [HEADS, 1, D]
    pooled = end  # the keys first..pooled-1 are read from the pool
    if NEW:  # key length - 1 is this step's, taken after the loop (module docstring)
        pooled = tl.minimum(end, length - 1)
    if EARLY:  # reads of the step's lengths and tables, set before its first layer
        _warm_tile(k_ptr, v_ptr, kh * stride_kh, tables_ptr, b, stride_tr, first + t, pooled,
                   stride_kb, stride_ks, BLOCK, LINE, max(D // LINE, 1))
        enter(PDL)  # nothing before this reads what an earlier kernel of the step writes
    q = tl.load(q_ptr + b * stride_qr + q_rows[:, :, None] * stride_qh + d[None, None, :],
                mask=g_mask[:, :, None], other=0.0).to(k_ptr.dtype.element_ty)  # [HEADS, G, D]
    m = tl.full([HEADS, GROUPS_POW2], float("-inf"), tl.float32)
    denom = tl.zeros([HEADS, GROUPS_POW2], tl.float32)
    acc = tl.zeros([HEADS, GROUPS_POW2, D], tl.float32)
    if PREFETCH:  # the next tile's loads in registers, issued before this tile's math
        m, denom, acc = _walk_prefetched(q, k_ptr + k_cols, v_ptr + v_cols, tables_ptr, b,
                                         stride_tr, first, pooled, stride_kb, stride_ks, scale,
                                         m, denom, acc, BLOCK, TILE)
    else:  # loads where they are used: Triton's pipeliner may overlap them (num_stages)
        for start in range(first, pooled, TILE):
            k, v, live = _tile_kv(k_ptr + k_cols, v_ptr + v_cols, tables_ptr, b, stride_tr,
                                  start + t, pooled, stride_kb, stride_ks, BLOCK)
            m, denom, acc = _tile_step(q, k, v, live, scale, m, denom, acc)
    if NEW:
        m, denom, acc = _new_key(q, m, denom, acc, k_new_ptr, v_new_ptr, slots_ptr, k_ptr,
                                 v_ptr, b, kh[:, None], d[None, :], j, first, end, length, scale,
                                 stride_knr, stride_knh, stride_vnr, stride_vnh, stride_kb,
                                 stride_ks, stride_kh, BLOCK)
    if SPLITS == 1:
        out = acc / denom[:, :, None]
        tl.store(out_ptr + b * stride_or + q_rows[:, :, None] * stride_oh + d[None, None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, :, None])
    else:  # the partials as v1's: rows (b * n_heads + query head) * SPLITS + j
        row = (b * n_heads + q_rows) * SPLITS + j  # [HEADS, G]
        tl.store(part_m_ptr + row, m, mask=g_mask)
        tl.store(part_l_ptr + row, denom, mask=g_mask)
        tl.store(part_acc_ptr + row[:, :, None] * D + d[None, None, :], acc,
                 mask=g_mask[:, :, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits(q: torch.Tensor, programs: int, keys_at_most: int, tile: int) -> int:
    """Chunks per program of one split (`programs`: requests x kv-head groups): enough programs
    for 1.5 per SM (SPLIT_COVER), at most 16 and at most one per tile of the longest possible
    context (the tables' width: no host sync). On the H200 (llama3-1b, 640 keys, v2 as shipped)
    that picks the measured best or within 2% of it at batch 1, 16, 64 and 256 (a sweep of
    bench/serve_profile.py --kernel-configs)."""
    if not q.is_cuda:
        return 1
    wanted = -(-int(SPLIT_COVER * _sm_count(q.device)) // (q.shape[0] * programs))
    return min(triton.next_power_of_2(wanted), 16, triton.next_power_of_2(-(-keys_at_most // tile)))


SPLIT_COVER = 1.5  # programs per SM default_splits aims at



# The launch each variant ships with (an H200 sweep, bench/serve_profile.py --kernel-configs:
# v2 at these settings measured faster than v1 at its own at batch 16-256, bench/RESULTS.md);
# 0 in a call or unset in KernelSettings.paged_kernel means these
SHIPPED = {"v1": {"tile": 64, "num_warps": 4, "num_stages": 0, "heads": 1},
           "v2": {"tile": 64, "num_warps": 2, "num_stages": 2, "heads": 2}}


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: torch.Tensor, lengths: torch.Tensor, *, tile: int = 0,
                           splits: int = 0, num_warps: int = 0, num_stages: int = 0,
                           heads_first: bool = False, variant: str = "",
                           heads: int = 0, prefetch: bool = False,
                           new: NewKeys | None = None,
                           kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """[r, n_heads, d] (contiguous): each request's query heads over its first lengths[r] keys
    (q [r, n_heads, d], k_new, v_new: any row and head strides, read in place when the column
    stride is 1, as the compiled decode step's views of its qkv output); with `new`
    (k_new, v_new [r, n_kv, d], slots [r]) key lengths[r] - 1 is k_new[r], stored into the
    pools' row slots[r] by the kernel too (module docstring: store, then attend). `variant`
    picks the kernel ("": kernels.paged_kernel's, with its settings: parse_paged_kernel;
    `kernels` also says whether to launch with PDL and early reads: trireme.ops.pdl). `tile` (keys
    per iteration), `splits` (a power of two; default: default_splits), num_warps, num_stages
    tune the launch (0: the variant's SHIPPED setting; the tile at least the block size);
    heads_first (the grid's order: a request's kv heads side by side) only v1's, `heads` (kv
    heads per program, a power of two dividing n_kv; 0: SHIPPED's if it divides n_kv, else 1)
    and `prefetch` (the next tile's loads issued early, in registers) only v2's."""
    kw = dict(tile=tile, splits=splits, num_warps=num_warps, num_stages=num_stages,
              heads_first=bool(heads_first), heads=heads, prefetch=bool(prefetch))
    if not variant:
        variant, settings = parse_paged_kernel(kernels.paged_kernel)
        kw.update(settings)
    if variant not in PAGED_VARIANTS:
        raise ConfigError(f"variant={variant!r} is not a paged decode kernel; use one of "
                          f"{', '.join(PAGED_VARIANTS)}")
    n_kv = k_pool.shape[2]
    shipped = SHIPPED[variant]
    for key in ("tile", "num_warps", "num_stages"):
        kw[key] = kw[key] or shipped[key]
    kw["tile"] = max(kw["tile"], k_pool.shape[1])  # whole blocks per tile
    heads = kw["heads"] if variant == "v2" else 1
    if heads == 0:
        heads = shipped["heads"] if n_kv % shipped["heads"] == 0 else 1
    if heads < 1 or n_kv % heads or heads & (heads - 1):
        raise ConfigError(f"heads={heads} kv heads per program must be a power of two dividing "
                          f"the {n_kv} kv heads; use 1")
    for key in ("tile", "splits"):
        if kw[key] & (kw[key] - 1):
            raise ConfigError(f"{key}={kw[key]} must be a power of two (or 0: the default)")
    return _launch(q, k_pool, v_pool, tables, lengths, variant, **{**kw, "heads": heads},
                   new=new_keys(new, q, k_pool, v_pool), kernels=kernels)


def new_keys(new: NewKeys | None, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
             ) -> NewKeys | None:
    """`new` checked against the pools (shape [r, n_kv, d], their dtype and device, slots [r]),
    its keys and values with unit column stride (the kernel's addressing)."""
    if new is None:
        return None
    k_new, v_new, slots = new
    want = (q.shape[0], *k_pool.shape[2:])
    for name, t, pool in (("k_new", k_new, k_pool), ("v_new", v_new, v_pool)):
        if tuple(t.shape) != want or t.dtype != pool.dtype or t.device != pool.device:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; the new keys "
                             f"must be {want} {pool.dtype} on {pool.device}, as the pools")
    if tuple(slots.shape) != (q.shape[0],):
        raise ValueError(f"slots is {tuple(slots.shape)}; it must be [{q.shape[0]}], one per "
                         "request")
    k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
    return k_new, v_new, slots


def _launch(q, k_pool, v_pool, tables, lengths, variant: str, tile: int, splits: int,
            num_warps: int, num_stages: int, heads_first: bool, heads: int,
            prefetch: bool, new: NewKeys | None = None,
            kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """paged_decode_attention's launch, its settings (and `new`: new_keys) checked."""
    r, n_heads, d = q.shape
    n_kv = k_pool.shape[2]
    block = k_pool.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()  # rows and heads by their strides
    k_new, v_new, slots = new if new is not None else (k_pool, v_pool, lengths)  # (unused)
    out = q.new_empty(r, n_heads, d)  # contiguous, whatever q's strides
    groups = n_heads // n_kv
    splits = splits or default_splits(q, n_kv // heads, tables.shape[1] * block, tile)
    parts = [q.new_empty(0, dtype=torch.float32)] * 3  # unused with one split
    if splits > 1:
        parts = [q.new_empty(r, n_heads, splits, dtype=torch.float32),
                 q.new_empty(r, n_heads, splits, dtype=torch.float32),
                 q.new_empty(r, n_heads, splits, d, dtype=torch.float32)]
    stages = {"num_stages": num_stages} if num_stages else {}
    args = (q, k_pool, v_pool, tables, lengths, out, *parts, k_new, v_new, slots,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            tables.stride(0), out.stride(0), out.stride(1),
            *(k_new.stride()[:2] + v_new.stride()[:2] if new is not None else (0,) * 4),
            1.0 / math.sqrt(d), n_heads)
    consts = dict(GROUPS=groups, GROUPS_POW2=max(16, triton.next_power_of_2(groups)), D=d,
                  BLOCK=block, TILE=tile, SPLITS=splits, NEW=new is not None,
                  num_warps=num_warps, **stages)
    pdl = launch_pdl(q, kernels)  # v2 and the merge (trireme.ops.pdl)
    if variant == "v1":
        grid = (n_kv, r, splits) if heads_first else (r, n_kv, splits)
        _paged_decode_kernel[grid](*args, HEADS_FIRST=bool(heads_first), **consts)
    else:
        _paged_decode_v2_kernel[(r, n_kv // heads, splits)](
            *args, HEADS=heads, PREFETCH=bool(prefetch), PDL=pdl, launch_pdl=pdl,
            EARLY=early_reads(q, kernels) and not prefetch, LINE=128 // k_pool.element_size(),
            **consts)
    if splits > 1:
        _merge_splits_kernel[(r, n_heads)](*parts, out, out.stride(0), out.stride(1), D=d,
                                           SPLITS=splits, num_warps=1, PDL=pdl, launch_pdl=pdl)
    return out
