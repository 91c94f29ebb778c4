"""Attention over a block of keys that also returns each query's log-sum-exp, the exact merge of
two such partial attentions, and the gradient of one block (the pieces ring attention is built of).

For one query with scores s_j = q . k_j / sqrt(d) over its allowed keys J:

    lse = log sum_{j in J} exp(s_j)        out = sum_{j in J} exp(s_j - lse) v_j

If J is cut into disjoint A and B, the parts' results give the whole exactly:

    lse = log(exp(lse_A) + exp(lse_B))     out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

A query with no allowed key has lse = -inf and out = 0, which the merge treats as "nothing".

The backward of softmax attention needs only the final out O and lse L (flash attention's
backward): for a block with scores S, P = exp(S - L) is the block's share of the final
probabilities, and with dO the output gradient and D = rowsum(dO * O):

    dV = P^T dO     dP = dO V^T     dS = P * (dP - D)     dQ = dS K / sqrt(d)
    dK = dS^T Q / sqrt(d)

Summing a block's dQ over all blocks gives the full dQ; dK, dV of a block are already complete.

Shapes: q [b, H, s_q, d], k and v [b, H_kv, s_k, d] with H a multiple of H_kv (GQA: query head
h reads key/value head h // (H / H_kv)), mask [s_q, s_k] bool (True = may attend) or None; lse
[b, H, s_q] in fp32. Everything is computed in plain PyTorch in fp32 (the reference; no kernel
that returns the LSE is wired in yet).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_TINY = torch.finfo(torch.float32).tiny


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """[b, H, s, ...] -> [b, H_kv, H / H_kv, s, ...]: the query heads that share a KV head."""
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _scores(q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
    """fp32 scores [b, H_kv, g, s_q, s_k], -inf where the mask forbids."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    keys = k.float().unsqueeze(2)  # [b, H_kv, 1, s_k, d]
    scores = _grouped(q.float(), k.shape[1]) @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite_or_zero(x: Tensor) -> Tensor:
    """x where finite, else 0: a shift for exp that leaves all -inf rows at -inf."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _log_total(peak: Tensor, total: Tensor) -> Tensor:
    """peak + log(total), -inf where total is 0; finite gradients everywhere."""
    return torch.where(total > 0, peak + torch.log(total.clamp_min(_TINY)), float("-inf"))


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """(out [b, H, s_q, d] in q's dtype, lse [b, H, s_q] fp32) of q over the keys k, v."""
    b, h, s_q, d = q.shape
    scores = _scores(q, k, mask)
    # The shift cancels in the result, so its gradient is zero: detached.
    peak = _finite_or_zero(scores.amax(-1, keepdim=True)).detach()
    weights = torch.exp(scores - peak)  # 0 where masked
    total = weights.sum(-1, keepdim=True)  # >= 1 unless no key is allowed
    out = (weights / total.clamp_min(_TINY)) @ v.float().unsqueeze(2)  # [b, H_kv, g, s_q, d]
    lse = _log_total(peak, total).squeeze(-1)
    return out.reshape(b, h, s_q, d).to(q.dtype), lse.reshape(b, h, s_q)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention over the union of two disjoint key sets from each set's (out, lse);
    -> (out fp32, lse fp32)."""
    peak = _finite_or_zero(torch.maximum(lse_a, lse_b)).detach()
    weight_a, weight_b = torch.exp(lse_a - peak), torch.exp(lse_b - peak)
    total = weight_a + weight_b  # >= 1 unless both are empty
    share_a = (weight_a / total.clamp_min(_TINY)).unsqueeze(-1)
    share_b = (weight_b / total.clamp_min(_TINY)).unsqueeze(-1)
    return share_a * out_a.float() + share_b * out_b.float(), _log_total(peak, total)


def attention_delta(out: Tensor, dout: Tensor) -> Tensor:
    """D = rowsum(dO * O) [b, H, s_q] fp32, shared by every block's backward."""
    return (dout.float() * out.float()).sum(-1)


def attention_block_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, lse: Tensor,
                             delta: Tensor, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One key block's part of the gradient of the final attention output: (dq [b, H, s_q, d]
    to be summed over blocks, dk and dv [b, H_kv, s_k, d] of this block), fp32. `lse` and
    `delta` are the final (merged) ones."""
    kv_heads, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    scores = _scores(q, k, mask)  # [b, H_kv, g, s_q, s_k]
    probs = torch.exp(scores - _finite_or_zero(_grouped(lse, kv_heads)).unsqueeze(-1))
    dout_g = _grouped(dout.float(), kv_heads)  # [b, H_kv, g, s_q, d]
    dv = (probs.transpose(-2, -1) @ dout_g).sum(2)
    dprobs = dout_g @ v.float().unsqueeze(2).transpose(-2, -1)
    dscores = probs * (dprobs - _grouped(delta, kv_heads).unsqueeze(-1)) * scale
    dq = (dscores @ k.float().unsqueeze(2)).reshape(q.shape)
    dk = (dscores.transpose(-2, -1) @ _grouped(q.float(), kv_heads)).sum(2)
    return dq, dk, dv
