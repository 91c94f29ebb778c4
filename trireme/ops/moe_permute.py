"""Moving tokens to their experts and back: the permutation of a mixture of experts.

T tokens, each sent to k experts: T k assignments, assignment a = t k + j (token t's j-th pick).
`order` [N] lists assignments sorted by expert (trireme.ops.moe.dispatch_order); the rows of
x_sorted [N, h] follow it, and out_sorted [N, h] is what the experts made of them:

    permute      x_sorted[i] = tokens[order[i] // k]
    unpermute    y[t] = sum_j w[t, j] * out_sorted[inv[t k + j]]     inv[order[i]] = i

The reference (`permute_reference`, `unpermute_reference`) is plain autograd: a gather, whose
backward adds rows into the tokens with atomics (index_put with accumulate), and an index_add of the
weighted outputs, with atomics in the forward; it also takes a partial `order` (capacity dropping).

The dropless path (every assignment kept, so N = T k and `inv` exists) never adds with atomics:
each of y's rows, and each row of the permutation's input gradient, is a gather of k rows and
their (weighted) sum, summed in fp32 and rounded once:

    permute      forward  x_sorted = tokens[order // k]                      (gather)
                 backward d tokens[t] = sum_j d x_sorted[inv[t k + j]]       (gather + sum)
    unpermute    forward  y[t] = sum_j w[t, j] out_sorted[inv[t k + j]]      (gather + sum)
                 backward g = dy[order // k]                                 (gather, [N, h])
                          d out_sorted[i] = w_flat[order[i]] * g[i]
                          d w_flat[order[i]] = <g[i], out_sorted[i]>         (row dots)

The routing weights are applied in the unpermutation (not before the experts), so an expert-
parallel exchange between the two carries tokens only.

The two passes that read N rows and write T (`gather_sum`) or that read 2 N rows and write N
(`unpermute_backward`) are custom ops: on CUDA one Triton kernel each
(trireme.ops.moe_permute_triton), which reads every row once; elsewhere, or without Triton, their
plain references (`gather_sum_reference`, `unpermute_backward_reference`). On an H200 at the
fine-grained shape (T 32k, k 8, h 2048: N rows are 1 GiB in bf16) both kernels measured faster
than a plain gather + sum, embedding_bag's weighted sum and the reference's index_add (the MoE
sublayer's figures: bench/RESULTS.md). Both ops are
opaque to torch.compile (their fake implementations give the shapes).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trireme.ops.optional import optional_kernel


def inverse_permutation(order: Tensor) -> Tensor:
    """inv with inv[order[i]] = i ([N]; `order` a permutation of 0..N-1)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def gather_sum_reference(rows: Tensor, index: Tensor, weights: Tensor | None = None) -> Tensor:
    """[T, h], rows' dtype: y[t] = sum_j weights[t, j] * rows[index[t, j]] (index [T, k]; no
    weights: 1), in fp32 and rounded once."""
    t, k = index.shape
    gathered = rows.index_select(0, index.flatten()).view(t, k, -1).float()  # [T, k, h]
    if weights is not None:
        gathered = gathered * weights.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(rows.dtype)


def unpermute_backward_reference(
    dy: Tensor, out_sorted: Tensor, w_sorted: Tensor, token_of: Tensor,
) -> tuple[Tensor, Tensor]:
    """(d out_sorted [N, h] in its dtype, d w_sorted [N] fp32) of the unpermutation, with
    g = dy[token_of]: w_sorted * g and the row dots <g, out_sorted>, in fp32."""
    g = dy.index_select(0, token_of).float()  # [N, h]
    d_out = (g * w_sorted.float().unsqueeze(-1)).to(out_sorted.dtype)
    return d_out, (g * out_sorted.float()).sum(dim=-1)


@torch.library.custom_op("trireme::moe_gather_sum", mutates_args=(),
                         schema="(Tensor rows, Tensor index, Tensor? weights=None) -> Tensor")
def gather_sum(rows: Tensor, index: Tensor, weights: Tensor | None = None) -> Tensor:
    """gather_sum_reference as one op: on CUDA one Triton kernel (trireme.ops.moe_permute_triton),
    elsewhere (or without Triton) the reference."""
    return gather_sum_reference(rows, index, weights)


@gather_sum.register_fake
def _(rows: Tensor, index: Tensor, weights: Tensor | None = None) -> Tensor:
    return rows.new_empty(index.shape[0], rows.shape[1])


@gather_sum.register_kernel("cuda")
def _(rows: Tensor, index: Tensor, weights: Tensor | None = None) -> Tensor:
    kernels = _triton_kernels()
    if kernels is None:
        return gather_sum_reference(rows, index, weights)
    with torch.cuda.device(rows.device):  # Triton launches on the current device
        return kernels.gather_sum(rows, index, weights)


@torch.library.custom_op(
    "trireme::moe_unpermute_backward", mutates_args=(),
    schema="(Tensor dy, Tensor out_sorted, Tensor w_sorted, Tensor token_of) -> (Tensor, Tensor)")
def unpermute_backward(
    dy: Tensor, out_sorted: Tensor, w_sorted: Tensor, token_of: Tensor,
) -> tuple[Tensor, Tensor]:
    """unpermute_backward_reference as one op: on CUDA one Triton kernel that reads each row of
    dy[token_of] and out_sorted once, elsewhere (or without Triton) the reference."""
    return unpermute_backward_reference(dy, out_sorted, w_sorted, token_of)


@unpermute_backward.register_fake
def _(dy: Tensor, out_sorted: Tensor, w_sorted: Tensor, token_of: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(out_sorted), w_sorted.new_empty(w_sorted.shape, dtype=torch.float32)


@unpermute_backward.register_kernel("cuda")
def _(dy: Tensor, out_sorted: Tensor, w_sorted: Tensor, token_of: Tensor) -> tuple[Tensor, Tensor]:
    kernels = _triton_kernels()
    if kernels is None:
        return unpermute_backward_reference(dy, out_sorted, w_sorted, token_of)
    with torch.cuda.device(out_sorted.device):
        return kernels.unpermute_backward(dy, out_sorted, w_sorted, token_of)


@optional_kernel("MoE permutation's gathers and sums run as plain torch ops")
def _triton_kernels():
    """trireme.ops.moe_permute_triton, or None (with a warning) without Triton."""
    import trireme.ops.moe_permute_triton as kernels
    return kernels


class _Permute(torch.autograd.Function):
    """x_sorted = tokens[order // k]; backward: d tokens[t] = sum_j d x_sorted[inv[t k + j]]."""

    @staticmethod
    def forward(ctx, tokens: Tensor, order: Tensor, inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return tokens.index_select(0, order.div(top_k, rounding_mode="floor"))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return gather_sum(grad, inverse.view(-1, ctx.top_k)), None, None, None


class _Unpermute(torch.autograd.Function):
    """y[t] = sum_j w[t, j] out_sorted[inv[t k + j]]; the backward in the module docstring."""

    @staticmethod
    def forward(ctx, out_sorted: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        w = weights.to(out_sorted.dtype)  # [T, k], rounded like the reference's product
        ctx.save_for_backward(out_sorted, w, order, inverse)
        ctx.weights_dtype = weights.dtype
        return gather_sum(out_sorted, inverse.view_as(w), w)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
        out_sorted, w, order, inverse = ctx.saved_tensors
        token_of = order.div(w.shape[1], rounding_mode="floor")  # [N]
        d_out, d_w_sorted = unpermute_backward(dy.contiguous(), out_sorted, w.flatten()[order],
                                               token_of)
        return d_out, d_w_sorted[inverse].view_as(w).to(ctx.weights_dtype), None, None


def permute(tokens: Tensor, order: Tensor, inverse: Tensor, top_k: int) -> Tensor:
    """[N, h] = tokens[order // k] (dropless: inverse = inverse_permutation(order)); its
    backward gathers and sums, no atomics."""
    return _Permute.apply(tokens, order, inverse, top_k)


def unpermute(out_sorted: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """[T, h]: y[t] = sum_j weights[t, j] * out_sorted[inverse[t k + j]] (weights [T, k]; every
    assignment kept), y in out_sorted's dtype; forward and backward without atomics."""
    return _Unpermute.apply(out_sorted, weights, order, inverse)


def permute_reference(tokens: Tensor, order: Tensor, top_k: int) -> Tensor:
    """[N, h] = tokens[order // k], plain autograd (its backward adds with atomics); `order`
    may leave assignments out."""
    return tokens[order.div(top_k, rounding_mode="floor")]


def unpermute_reference(out_sorted: Tensor, weights: Tensor, order: Tensor) -> Tensor:
    """[T, h]: the rows times their weights, added into their tokens (index_add), plain
    autograd; y in out_sorted's dtype. Assignments left out of `order` add nothing."""
    t, k = weights.shape
    out = out_sorted * weights.flatten()[order].unsqueeze(-1).to(out_sorted.dtype)  # [N, h]
    y = out_sorted.new_zeros(t, out_sorted.shape[1])
    return y.index_add(0, order.div(k, rounding_mode="floor"), out)
