"""One chunk's softmax part of the fused cross-entropy as one Triton kernel (imported only where it
runs: it needs Triton). trireme.ops.fused_cross_entropy has the chunked loss around it and
`_loss_and_grad`, the eager reference it is tested against (tests/test_cross_entropy_triton.py,
through Triton's CPU interpreter, TRITON_INTERPRET=1).

For logits z [c, V] (bf16 / fp16 / fp32; the columns from `vocab_size` on are padding), labels
y [c] and weights w [c] (fp32), one program per row i, fp32 math:

    pass 1 (reads the tiles holding real columns once), an online logsumexp over BLOCK columns:
        m_t   = max(m_{t-1}, max_j z_j)                     running max (a scalar)
        s_t   = s_{t-1} * exp(m_{t-1} - m_t) + exp(z_tile - m_t)   per lane, [BLOCK]
        lse   = m + log(sum over the lanes of s)
    loss_i = w_i * (lse - z[y_i])                            (z[y_i]: one scalar load)
    pass 2 (reads the row again, from L2 if it is still there: pass 1 loads it "evict_last"),
    writes every column:
        dz_j  = w_i * (exp(z_j - lse) - [j == y_i])          j < vocab_size
        dz_j  = 0                                            j >= vocab_size (their z unused)

cast to the logits' dtype (rounded to nearest even). The lanes keep their own sums rescaled by
the scalar running max, so each tile costs one cross-lane max and one exp per element; the sum
is reduced once at the end. (Measured on the H200 against this: a running max per lane, with no
cross-lane step but two exps per element, and the whole row as one tile held in registers, read
once; both were slower at the llama3 and GPT-2 vocabularies (bench/kernel_choices.py --ops
ce_step), and were removed.) A label < 0 (-100: ignored) counts with weight 0: a zero loss
term and a zero gradient row. Traffic per element: two reads and one write (the compiled torch
version makes about four passes: max, sum of exp + target, gradient). The per-row loss terms go
to a [c] fp32 buffer, summed by torch (no atomics: a deterministic sum).

The fp8 output layer (trireme.ops.fp8_head) takes the gradient in e5m2 with an a-priori scale s
(a 0-dim fp32 tensor on the device, which every program loads: no host sync). With `out_scale`
pass 2 writes, into a new [c, V] float8_e5m2 tensor (1 byte an element; not in place),

        q_j   = e5m2(clamp(dz_j * s, -e5m2_max, e5m2_max))   rounded to nearest even

i.e. trireme.ops.fp8's `quantize(dz, E5M2, s)` of the fp32 dz, as `_loss_and_grad_e5m2` (the
compiled reference) writes it; on sm_90 Triton's default downcast is one cvt.rn.satfinite per
two values, round to nearest even as torch's .to(torch.float8_e5m2) (Triton 3.6 and 3.9 both:
the tests' sm_90 compile check). Triton's CPU interpreter (3.6 and 3.9) rounds fp32 -> e5m2
wrongly, 7917.2 -> 4096 for one: the tests make it round as torch does (tests/interpreted.py
E5M2_ROUND).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from trireme.ops.fp8 import E5M2

BLOCK = 4096  # columns per tile: 8 KiB of bf16, 16 elements a thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _load(z_row, c, n_cols, vocab_size, EVICT: tl.constexpr):
    """fp32 logits at columns c, -inf from vocab_size on. The load is masked by n_cols, not
    vocab_size, and the padding replaced after it: a mask that is constant over 8 columns lets
    Triton load 16-byte vectors (an odd vocabulary such as 50257 would make every load scalar);
    the few padding columns of the last tile are read for it."""
    z = tl.load(z_row + c, mask=c < n_cols, other=float("-inf"), eviction_policy=EVICT)
    return tl.where(c < vocab_size, z.to(tl.float32), float("-inf"))


@triton.jit
def _logsumexp_tile_max(z_row, n_cols, vocab_size, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Pass 1 with one running max per row: a cross-lane max per tile, one exp per element."""
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.max(tl.full([BLOCK], neg_inf, tl.float32), 0)  # running max, a scalar
    s = tl.zeros([BLOCK], tl.float32)  # per-lane sums of exp(z - m)
    for start in range(0, vocab_size, BLOCK):  # the real columns only
        c = start + cols
        z = _load(z_row, c, n_cols, vocab_size, EVICT)
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = tl.where(m_new == neg_inf, 0.0, m_new)  # all -inf so far: exp(-inf) = 0
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = m_new
    shift = tl.where(m == neg_inf, 0.0, m)
    return shift + tl.log(tl.sum(s, 0))


@triton.jit
def _gradient(z, c, lse, label, w, vocab_size):
    """d loss / d z for fp32 logits z at columns c: exactly 0 from vocab_size on."""
    g = (tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)) * w
    return tl.where(c < vocab_size, g, 0.0)


@triton.jit
def _store_gradient(dz_row, c, g, n_cols, scale, FP8_MAX: tl.constexpr):
    """Write the fp32 gradient g at columns c in the output's dtype: rounded to it (to nearest
    even) or, with FP8_MAX > 0, as q(g) = fp8(clamp(g * scale, -FP8_MAX, FP8_MAX)) (a NaN stays
    NaN, as in torch's clamp)."""
    if FP8_MAX > 0:
        g = tl.clamp(g * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    # Triton's float downcasts round to nearest even by default (sm_90, fp32 -> e5m2: one
    # cvt.rn.satfinite instruction per two values)
    tl.store(dz_row + c, g.to(dz_row.dtype.element_ty), mask=c < n_cols)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, out_ptr, labels_ptr, weight_ptr, loss_ptr, scale_ptr,
    logits_stride, out_stride, n_cols, vocab_size,
    BLOCK: tl.constexpr, EVICT_1: tl.constexpr, EVICT_2: tl.constexpr, FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = logits_ptr + row.to(tl.int64) * logits_stride  # c * V can pass 2^31
    dz_row = out_ptr + row.to(tl.int64) * out_stride
    label = tl.load(labels_ptr + row)
    w = tl.load(weight_ptr + row)
    w = tl.where(label >= 0, w, 0.0)  # an ignored label: weight 0
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    lse = _logsumexp_tile_max(z_row, n_cols, vocab_size, BLOCK, EVICT_1)  # pass 1
    target = tl.load(z_row + tl.maximum(label, 0)).to(tl.float32)
    target = tl.where(label < vocab_size, target, neg_inf)  # a padded label: as the reference
    tl.store(loss_ptr + row, tl.where(w == 0.0, 0.0, w * (lse - target)))
    scale = 1.0
    if FP8_MAX > 0:  # the e5m2 output's scale, a device scalar
        scale = tl.load(scale_ptr)
    for start in range(0, n_cols, BLOCK):  # pass 2: every column, padding written as 0
        c = start + cols
        z = _load(z_row, c, n_cols, vocab_size, EVICT_2)
        g = _gradient(z, c, lse, label, w, vocab_size)
        _store_gradient(dz_row, c, g, n_cols, scale, FP8_MAX)


def loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
    vocab_size: int | None = None, *, in_place: bool = False, out_scale: torch.Tensor | None = None,
    block: int | None = None, num_warps: int | None = None, l2_hints: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the weighted losses (fp32 scalar), d loss / d logits in logits.dtype): the
    module docstring's kernel, the same contract as trireme.ops.fused_cross_entropy's
    `_loss_and_grad`. logits [c, V] (rows may be strided, columns contiguous), labels [c] (-100
    allowed), weight [c] fp32; columns from `vocab_size` on (None: none) are padding.
    `in_place`: the gradient overwrites the logits (no second [c, V] tensor). `out_scale` (a
    0-dim fp32 tensor on the logits' device, read by the kernel: no host sync): the gradient is
    written as q5(dz) = e5m2(clamp(dz * out_scale, +-e5m2 max)) into a new [c, V] float8_e5m2
    tensor instead (`_loss_and_grad_e5m2`'s; not in place: another dtype). `block` (a power of
    two) and `num_warps` set the tile (default: BLOCK columns, or the vocabulary's next power of
    two if smaller). `l2_hints`: pass 1 loads "evict_last" and pass 2 "evict_first" (keep the
    row in L2 between the two)."""
    c, n_cols = logits.shape
    vocab_size = n_cols if vocab_size is None else min(vocab_size, n_cols)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    fp8_max = 0.0
    if out_scale is not None:
        if in_place:
            raise ValueError("in_place with out_scale: the e5m2 gradient cannot overwrite the "
                             f"{logits.dtype} logits; leave one of them out")
        out_scale = out_scale.to(device=logits.device, dtype=torch.float32).reshape(())
        fp8_max = torch.finfo(E5M2).max
        out = torch.empty(c, n_cols, dtype=E5M2, device=logits.device)
    elif in_place:
        out = logits
    else:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    labels = labels.contiguous()
    weight = weight.to(torch.float32).contiguous()
    rows = torch.empty(c, dtype=torch.float32, device=logits.device)  # per-row loss terms
    if block is None:
        block = min(BLOCK, triton.next_power_of_2(max(vocab_size, 16)))
    if num_warps is None:
        num_warps = NUM_WARPS if block >= 2048 else 4
    # Triton launches on the current device (the interpreter: the CPU)
    where = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    if c > 0:
        with where:
            _cross_entropy_kernel[(c,)](
                logits, out, labels, weight, rows, out_scale, logits.stride(0), out.stride(0),
                n_cols, vocab_size, BLOCK=block,
                EVICT_1="evict_last" if l2_hints else "", EVICT_2="evict_first" if l2_hints else "",
                FP8_MAX=fp8_max, num_warps=num_warps,
            )
    return rows.sum(), out
