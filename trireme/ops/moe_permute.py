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
their (weighted) sum, one fused kernel (embedding_bag's sum mode, fp32 accumulation):

    permute      forward  x_sorted = tokens[order // k]                      (gather)
                 backward d tokens[t] = sum_j d x_sorted[inv[t k + j]]       (gather + sum)
    unpermute    forward  y[t] = sum_j w[t, j] out_sorted[inv[t k + j]]      (gather + sum)
                 backward g = dy[order // k]                                 (gather, [N, h])
                          d out_sorted[i] = w_flat[order[i]] * g[i]
                          d w_flat[order[i]] = <g[i], out_sorted[i]>         (row dots)

The routing weights are applied in the unpermutation (not before the experts), so an expert-
parallel exchange between the two carries tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def inverse_permutation(order: Tensor) -> Tensor:
    """inv with inv[order[i]] = i ([N]; `order` a permutation of 0..N-1)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def gather_sum(rows: Tensor, index: Tensor, weights: Tensor | None = None) -> Tensor:
    """[T, h]: y[t] = sum_j weights[t, j] * rows[index[t, j]] (index [T, k]; no weights: 1),
    in one pass, summed in fp32 and rounded once (no autograd)."""
    return F.embedding_bag(index, rows.contiguous(), mode="sum", per_sample_weights=weights)


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
        g = dy.index_select(0, order.div(w.shape[1], rounding_mode="floor"))  # [N, h]
        d_w_sorted = torch.bmm(g.unsqueeze(1), out_sorted.unsqueeze(2)).flatten()  # [N]
        d_w = d_w_sorted[inverse].view_as(w).to(ctx.weights_dtype)
        d_out = g.mul_(w.flatten()[order].unsqueeze(-1))  # g is ours: scaled in place
        return d_out, d_w, None, None


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
