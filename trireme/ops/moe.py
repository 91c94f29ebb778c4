"""Mixture-of-experts building blocks: routing, load-balancing losses, token permutation and the
experts' matmuls. Plain functions of tensors; trireme.models.moe puts them together.

Routing, for T tokens and E experts (logits [T, E] in fp32):

    softmax        p = softmax(logits); the top-k experts by p + bias; weights = their p
    topk_softmax   the top-k experts by logits + bias; weights = softmax over those k logits
    sigmoid        s = sigmoid(logits); the top-k by s + bias; weights = their s / sum of those s

`bias` (auxiliary-loss-free balancing) only changes which experts are picked, never the weights.
Group-limited routing cuts the experts into G groups, scores each group by the sum of its two best
scores, and picks the top-k only inside each token's best `top_groups` groups. The weights are
finally multiplied by `scale`.

Load-balancing losses (each times its coefficient; P = the routing probabilities, normalized per
token; f_e = the share of the T * k assignments that went to expert e):

    aux      E * sum_e f_e * mean_t P_te            over the micro batch (Switch / GShard)
    seq_aux  the same per sequence, averaged        (DeepSeek-V3)
    z        mean_t logsumexp(logits_t)^2           (ST-MoE)

They reach the gradients without changing the model's loss value: `attach_aux_loss` returns its
input unchanged and, in the backward, hands the aux loss the gradient `scale` (the loss scale of
the step over its micro batches), as if it had been added to the loss.

Token flow: the (token, expert) assignments are sorted by expert (`dispatch_order`), the tokens
gathered in that order, each expert's run multiplied by its weights (`expert_swiglu`: one
torch._grouped_mm for all experts, or a loop, the reference), and the outputs, times the routing
weights, added back to their tokens (trireme.ops.moe_permute moves the rows). With a capacity,
an expert keeps at most `capacity` assignments (by weight or by position) and the others are
dropped: those tokens skip that expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from trireme.ops.swiglu import swiglu

ROUTERS = ("softmax", "topk_softmax", "sigmoid")


def route(
    logits: Tensor, top_k: int, router: str, bias: Tensor | None = None, num_groups: int = 1,
    top_groups: int = 1, scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(weights [T, k], experts [T, k] int64, probs [T, E]): see the module docstring. `probs`
    are the per-token normalized scores the balancing losses use."""
    if router == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        scores = probs = torch.softmax(logits, dim=-1)
    select = (logits if router == "topk_softmax" else scores)
    if bias is not None:
        select = select + bias
    if num_groups > 1:
        select = _limit_groups(select, num_groups, top_groups)
    experts = select.topk(top_k, dim=-1).indices  # [T, k]
    if router == "topk_softmax":
        weights = torch.softmax(logits.gather(-1, experts), dim=-1)
    elif router == "sigmoid":
        picked = scores.gather(-1, experts)
        weights = picked / picked.sum(dim=-1, keepdim=True)
    else:
        weights = scores.gather(-1, experts)
    return weights * scale, experts, probs


def _limit_groups(select: Tensor, num_groups: int, top_groups: int) -> Tensor:
    """`select` with every expert outside each token's best `top_groups` groups at -inf."""
    t, e = select.shape
    grouped = select.view(t, num_groups, e // num_groups)
    best_two = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(best_two, dtype=torch.bool)
    keep.scatter_(1, best_two.topk(top_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def balance_sums(logits: Tensor, probs: Tensor, experts: Tensor, rows: Tensor, num_rows: int
                 ) -> Tensor:
    """What the balancing losses need of these tokens, as sums (so that the sums of several
    ranks' tokens combine by addition), flat fp32: assignments per expert [E], probabilities per
    expert [E], both per sequence [B, E] twice, sum of logsumexp^2, tokens. `rows` [T]: each
    token's sequence (0 .. num_rows - 1)."""
    t, k = experts.shape
    num_experts = probs.shape[1]
    device = probs.device
    counts = count_assignments(experts, num_experts).float()
    cells = rows.repeat_interleave(k) * num_experts + experts.flatten()  # (sequence, expert)
    per_seq = count_assignments(cells, num_rows * num_experts).float()
    in_row = (rows == torch.arange(num_rows, device=device).unsqueeze(1)).float()  # [B, T]
    seq_probs = in_row @ probs  # a matmul, not atomics: the same sums on every run
    z = torch.logsumexp(logits, dim=-1).square().sum()
    return torch.cat([counts, probs.sum(dim=0), per_seq.flatten(), seq_probs.flatten(),
                      z.reshape(1), torch.full((1,), float(t), device=device)])


def balance_losses(sums: Tensor, num_experts: int, top_k: int, num_rows: int
                   ) -> tuple[dict[str, Tensor], Tensor]:
    """The three balancing losses (module docstring), unweighted fp32 scalars, from
    `balance_sums` (of one micro batch, possibly added over ranks), and the assignments per
    expert [E] (fp32)."""
    e, b = num_experts, num_rows
    counts, prob_sum, per_seq, seq_probs, rest = sums.split([e, e, b * e, b * e, 2])
    z_sum, t = rest[0], rest[1]
    s = t / b  # tokens per sequence
    aux = e * (counts / (t * top_k) * prob_sum / t).sum()
    seq = (per_seq.view(b, e) / (s * top_k)) * (seq_probs.view(b, e) / s)
    losses = {"aux_loss": aux, "seq_aux_loss": e * seq.sum(dim=-1).mean(), "z_loss": z_sum / t}
    return losses, counts


class _AttachAuxLoss(torch.autograd.Function):
    """y = x; in the backward the aux loss gets gradient `scale` (and x its own gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(torch.float32).reshape(()), None


def attach_aux_loss(x: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
    """`x` unchanged; the backward through it also differentiates `aux` (times `scale`)."""
    if not aux.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, aux, scale)


def dispatch_order(
    experts: Tensor, weights: Tensor, num_experts: int, capacity: int = 0,
    drop_policy: str = "probs",
) -> tuple[Tensor, Tensor]:
    """(order, counts): the flat assignment indices (into experts.flatten()) sorted by expert,
    dropped ones left out, and the assignments each expert keeps [E]. Without a capacity every
    assignment is kept; with one, each expert keeps its `capacity` best by weight ("probs") or
    its first in token order ("position"). Stable sorts: the same on every rank and run."""
    flat = experts.flatten()
    if capacity <= 0:
        return torch.argsort(flat, stable=True), count_assignments(experts, num_experts)
    priority = -weights.flatten() if drop_policy == "probs" else torch.arange(
        flat.numel(), device=flat.device)
    by_priority = torch.argsort(priority, stable=True)
    order = by_priority[torch.argsort(flat[by_priority], stable=True)]
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
    order = order[rank < capacity]
    return order, torch.bincount(flat[order], minlength=num_experts)


def count_assignments(experts: Tensor, num_experts: int) -> Tensor:
    """[E] int64: the assignments each expert got. Unlike torch.bincount on CUDA (which reads
    the largest id back to size its output), no host sync."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def capacity_of(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert may take: ceil(factor * T * k / E) (0: no limit)."""
    return 0 if factor <= 0 else math.ceil(factor * num_tokens * top_k / num_experts)


def grouped_mm_runs(x: Tensor) -> bool:
    """Whether torch._grouped_mm takes `x`: CUDA in bf16, the CPU in fp32."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return (x.is_cuda and x.dtype == torch.bfloat16) or (x.device.type == "cpu"
                                                         and x.dtype == torch.float32)


def expert_swiglu(x: Tensor, counts: Tensor, fc1: Tensor, fc2: Tensor, grouped: bool,
                  activation: Callable[[Tensor], Tensor] = swiglu) -> Tensor:
    """[N, h] -> [N, h]: rows sorted by expert, `counts` [E] rows each, through expert e's
    SwiGLU fc2[e]^T (silu(gate) * up) with [gate; up] = x fc1[e] (fc1 [E, h, 2F], fc2 [E, F, h]).
    `activation`: swiglu, or trireme.ops.swiglu.fused_swiglu (the same numbers, one backward
    kernel on CUDA)."""
    if grouped:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(x, fc1, offs=offsets)  # [N, 2F]
        return torch._grouped_mm(activation(h), fc2, offs=offsets)  # [N, h]
    outputs, start = [], 0
    for e, n in enumerate(counts.tolist()):  # the reference: one expert at a time
        outputs.append(activation(x[start : start + n] @ fc1[e]) @ fc2[e])
        start += n
    return torch.cat(outputs) if outputs else x[:0]
