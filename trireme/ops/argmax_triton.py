"""A decode step's greedy ids and "row is finite" flags as two Triton kernels, one read of the
logits (imported only where it runs: it needs Triton). trireme.ops.argmax has the dispatcher
and the torch reference it is tested against (tests/test_argmax_triton.py, through Triton's CPU
interpreter, TRITON_INTERPRET=1).

For logits z [n, V] (bf16 / fp16 / fp32, columns contiguous, rows at any stride):

    ids[i]    = min { j : z[i, j] = max_k z[i, k] }     torch.argmax's first index among ties,
                                                         NaN counted above everything
    finite[i] = 1 if every z[i, j] is finite else 0      (no NaN, no +-inf)

Ordering key. Each value is upcast to fp32 (exact) and its bits b read as a signed int32;
key = b ^ ((b >> 31) & 0x7FFFFFFF) flips the magnitude bits of negatives, so the int32 order of
the keys is the float order (-inf < ... < -0 < +0 < ... < +inf). Two fix-ups give torch's
equalities: both zeros get key 0 (-0.0 == 0.0 ties), and every NaN gets INT32_MAX (above +inf,
all NaNs tie, so the first NaN wins as in torch). Padding lanes get INT32_MIN, below every real
key, so a chunk with at least one real column always reports a real column.

Split reduction (fills the GPU at small n: one program per row would leave most SMs idle).
Stage 1, grid (n, S): program (i, s) reads the CHUNK = TILES * BLOCK columns
[s * CHUNK, (s + 1) * CHUNK) of row i, tile by tile. Lane l keeps the best key it has seen and
its column (strictly greater replaces, so the lane keeps its earliest column among ties, the
columns arriving in increasing order) and whether it saw a non-finite value. At the end:
    M = max_l key_l,   j = min { col_l : key_l = M },   bad = max_l bad_l
written to part[0..2, i, s] (int32). Stage 2, grid (n,): the same merge over s = 0 .. S - 1
(max key, then the smallest column holding it: the first index over the whole row, whatever the
split), written to out [2, n] int64: out[0] = ids, out[1] = finite. Both merges are min / max,
so the result does not depend on the order anything runs in (deterministic, no atomics).
Traffic: the logits once (n * V * itemsize bytes) plus 12 * n * S bytes of partials.

The loops run over a constexpr tile count (TILES), not a runtime column count: besides letting
Triton unroll, this keeps Triton 3.6's interpreter working, whose tensor __index__ calls int()
on a one-element 1-d numpy array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars") when a `range` bound is a runtime kernel argument.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from trireme.ops.kernel_settings import DEFAULT_KERNELS, KernelSettings
from trireme.ops.pdl import launch_pdl
from trireme.ops.pdl_triton import enter

# columns per tile: 4 KiB of bf16, 16 elements (two 16-byte loads) a thread at 4 warps; compiled
# for sm_90: 72 registers (bf16), no spills. Larger tiles keep more bytes in flight per thread.
BLOCK = 2048
MIN_CHUNK = 4096  # columns per stage-1 program at least (a program's fixed cost amortized)
PROGRAMS_PER_SM = 4  # stage-1 programs aimed for: about this many per SM
# the tiling is chosen for this many rows whatever n is: its constexprs (TILES, S_BLOCK) then
# depend only on V and the GPU, so a serving engine whose steps sample 1, 5, 64, ... rows
# compiles the kernels once (at startup: trireme.ops.argmax.warm_up), not once per new row
# count in the middle of serving (each Triton compile stalls the engine)
REFERENCE_ROWS = 64
NUM_WARPS = 4
INT32_MIN = tl.constexpr(-2147483648)  # constexpr: a global a kernel may read
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _order_key(z):
    """int32 keys of fp32 values z whose integer order is torch.argmax's order (module
    docstring): floats in order, -0 == +0, NaN above +inf and all NaNs equal."""
    bits = z.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(z == 0.0, 0, key)
    return tl.where(z != z, INT32_MAX, key)


@triton.jit
def _merge(key, col):
    """(max key, smallest col holding it) of one block of candidates."""
    best = tl.max(key, 0)
    first = tl.min(tl.where(key == best, col, INT32_MAX), 0)
    return best, first


@triton.jit(do_not_specialize=["part_plane", "n_parts"])
def _chunk_kernel(
    logits_ptr, part_ptr, row_stride, n_cols, part_plane, n_parts,
    BLOCK: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr = False,
):
    """Stage 1: program (i, s) reduces row i's columns [s * CHUNK, (s + 1) * CHUNK) to
    part[:, i, s] = (max key, its first column, any non-finite)."""
    enter(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    z_row = logits_ptr + row.to(tl.int64) * row_stride  # n * V can pass 2^31
    cols = tl.arange(0, BLOCK)
    start = s * (TILES * BLOCK)
    best = tl.full([BLOCK], INT32_MIN, tl.int32)  # per lane: best key so far
    col = tl.full([BLOCK], INT32_MAX, tl.int32)  # per lane: its (earliest) column
    bad = tl.zeros([BLOCK], tl.int32)  # per lane: 1 once a NaN / inf was seen
    for t in range(TILES):
        c = start + t * BLOCK + cols
        inside = c < n_cols
        z = tl.load(z_row + c, mask=inside, other=0.0).to(tl.float32)
        key = tl.where(inside, _order_key(z), INT32_MIN)
        better = key > best  # strict: a tie keeps the lane's earlier column
        best = tl.where(better, key, best)
        col = tl.where(better, c, col)
        bad = tl.maximum(bad, tl.where(inside & ~(tl.abs(z) < float("inf")), 1, 0))
    top, first = _merge(best, col)
    at = part_ptr + row * n_parts + s
    tl.store(at, top)
    tl.store(at + part_plane, first)
    tl.store(at + 2 * part_plane, tl.max(bad, 0))


@triton.jit(do_not_specialize=["n_rows", "part_plane", "n_parts"])
def _merge_kernel(part_ptr, out_ptr, n_rows, part_plane, n_parts, S_BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Stage 2: program i merges part[:, i, 0 .. S - 1] (S = n_parts) into out[0, i] (ids,
    int64) and out[1, i] (finite, 0 / 1)."""
    enter(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, S_BLOCK)
    inside = s < n_parts
    at = part_ptr + row * n_parts + s
    key = tl.load(at, mask=inside, other=INT32_MIN)
    col = tl.load(at + part_plane, mask=inside, other=INT32_MAX)
    bad = tl.load(at + 2 * part_plane, mask=inside, other=0)
    _, first = _merge(key, col)
    tl.store(out_ptr + row, first.to(tl.int64))
    tl.store(out_ptr + n_rows + row, (1 - tl.max(bad, 0)).to(tl.int64))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split(n: int, n_cols: int, programs: int, block: int = BLOCK,
          min_chunk: int = MIN_CHUNK) -> tuple[int, int, int]:
    """(block, tiles, S): the stage-1 tiling of [n, n_cols] logits aiming at `programs`
    programs in all. CHUNK = tiles * block columns per program, a power of two (few distinct
    compiled kernels), at least min(min_chunk, n_cols rounded up) and at least n_cols / S for
    the smallest S with n * S >= programs; S = ceil(n_cols / CHUNK)."""
    per_row = max(1, -(-programs // max(n, 1)))  # programs wanted per row
    chunk = triton.next_power_of_2(max(-(-n_cols // per_row), 1))
    chunk = max(chunk, min(min_chunk, triton.next_power_of_2(n_cols)))
    block = min(block, chunk)
    return block, chunk // block, -(-n_cols // chunk)


def greedy_and_finite(logits: torch.Tensor, *, block: int | None = None,
                      min_chunk: int | None = None, programs: int | None = None,
                      num_warps: int | None = None,
                      kernels: KernelSettings = DEFAULT_KERNELS) -> torch.Tensor:
    """[2, n] int64: row 0 the argmax ids of logits [n, V] (the first index among ties),
    row 1 whether each row is all finite (1 / 0), by the module docstring's two kernels.
    `block` (a power of two), `min_chunk`, `programs` and `num_warps` override the launch
    (tests, benchmark; default: BLOCK, MIN_CHUNK, PROGRAMS_PER_SM per SM or 4 programs off
    CUDA, NUM_WARPS (1 for tiles under 1024 columns)). Without `programs` the tiling is the
    one for REFERENCE_ROWS rows whatever n is (one compiled kernel per V). `kernels`: whether
    to launch with PDL (trireme.ops.pdl)."""
    n, n_cols = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(2, n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    rows = n
    if programs is None:
        programs = PROGRAMS_PER_SM * _sm_count(logits.device.index or 0) if logits.is_cuda else 4
        rows = REFERENCE_ROWS
    block, tiles, s = split(rows, n_cols, programs, block or BLOCK, min_chunk or MIN_CHUNK)
    part = torch.empty(3, n, s, dtype=torch.int32, device=logits.device)
    # Triton launches on the current device (the interpreter: the CPU)
    where = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    num_warps = num_warps or (NUM_WARPS if block >= 1024 else 1)
    pdl = launch_pdl(logits, kernels)
    with where:
        _chunk_kernel[(n, s)](logits, part, logits.stride(0), n_cols, n * s, s, BLOCK=block,
                              TILES=tiles, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
        _merge_kernel[(n,)](part, out, n, n * s, s, S_BLOCK=triton.next_power_of_2(s),
                            PDL=pdl, num_warps=1, launch_pdl=pdl)
    return out
