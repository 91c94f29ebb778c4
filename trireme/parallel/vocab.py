"""The vocabulary split across tensor-parallel ranks: embedding, output logits, cross-entropy.

The table is padded to a multiple of make_vocab_size_divisible_by * T rows, so every vocabulary
size splits evenly, and rank r holds rows [r * V_p / T, (r + 1) * V_p / T). Initialization draws
only the real rows (the padded ones are 0), so the model is the same at every T. Padded entries
never reach the loss: their logits are -inf inside the softmax, and the gathered logits are cut to
the real vocabulary.

Cross-entropy runs on the vocabulary slices without ever forming the full logits. For one token
with logits z (split by columns over ranks) and target t:

    m = max_r max_j z_rj                     all-reduce (max)
    S = sum_r sum_j exp(z_rj - m)            all-reduce (sum)
    z_t - m                                  from the rank that holds t, all-reduce (sum)
    loss = log S - (z_t - m)
    d loss / d z_rj = softmax_rj - [j is t]  local: no communication in backward
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from trireme.config import ModelConfig
from trireme.ops.cross_entropy import token_mean
from trireme.parallel.comm import gather_last_dim
from trireme.parallel.sharding import Sharding, even_sharding
from trireme.parallel.tensor import TensorParallel


def padded_vocab_size(cfg: ModelConfig, tensor_parallel: int = 1) -> int:
    """Rows of the embedding table: vocab_size rounded up to make_vocab_size_divisible_by * T."""
    multiple = max(1, cfg.make_vocab_size_divisible_by) * tensor_parallel
    return int(math.ceil(cfg.vocab_size / multiple) * multiple)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; each token's vector comes from the rank that
    holds its row, summed over the group (or reduce-scattered to sequence shards under SP)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.sharding = even_sharding(0, num_embeddings, tp.rank, tp.size)
        rows = num_embeddings // tp.size
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # rows other ranks hold
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # [b, s, h]
        x = x.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.reduce_partial_sums(x)  # [b, s, h], or [b, s / T, h] under SP

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": self.sharding}

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]} of " \
               f"{self.sharding.full_rows}, dim={self.weight.shape[1]}"


def vocab_embedding(num_embeddings: int, dim: int, tp: TensorParallel | None) -> nn.Module:
    """nn.Embedding at T = 1, else VocabParallelEmbedding."""
    if tp is None:
        return nn.Embedding(num_embeddings, dim)
    return VocabParallelEmbedding(num_embeddings, dim, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits (module docstring), fp32."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int,
        group: dist.ProcessGroup,
    ) -> Tensor:
        n, width = logits.shape  # [tokens, V_p / T]
        real = min(max(vocab_size - vocab_start, 0), width)  # columns that are real tokens
        if real > 0:
            row_max = logits[:, :real].max(dim=-1).values.float()
        else:  # a rank holding only padding
            row_max = torch.full((n,), float("-inf"), device=logits.device)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z = logits.float() - row_max.unsqueeze(-1)  # a new fp32 tensor, worked on in place
        z[:, real:] = float("-inf")  # padding: exp(-inf) = 0, out of the softmax

        local_label = labels - vocab_start
        here = (local_label >= 0) & (local_label < real)
        local_label = local_label.masked_fill(~here, 0)
        target = z.gather(1, local_label.unsqueeze(1)).squeeze(1).masked_fill(~here, 0.0)
        softmax = z.exp_()
        sums = torch.stack([softmax.sum(dim=-1), target])  # [2, n]: one all-reduce for both
        dist.all_reduce(sums, group=group)
        sum_exp, target = sums[0], sums[1]
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, here)
        ctx.input_dtype = logits.dtype
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_label, here = ctx.saved_tensors
        grad = softmax  # turned into the gradient in place: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_label] -= here.to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int, group: dist.ProcessGroup
) -> Tensor:
    """Cross-entropy per token [n] from this rank's logits [n, V_p / T] (columns vocab_start..)
    and the global labels [n]; labels outside [0, vocab_size) (e.g. -100) give log S, to be
    weighted 0 by the caller."""
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, vocab_size, group)


def parallel_output(
    x: Tensor,
    weight: Tensor,
    tp: TensorParallel,
    vocab_size: int,
    labels: Tensor | None = None,
    loss_mask: Tensor | None = None,
) -> Tensor:
    """The output layer on vocabulary slices: the mean loss with `labels`, else the logits
    [b, s, vocab_size] gathered from all ranks.

    x is the final norm's output ([b, s, h], or [b, s / T, h] under SP); weight is this rank's
    [V_p / T, h] slice of the output (or tied embedding) matrix.
    """
    x = tp.to_full_sequence(x)  # [b, s, h] on every rank
    logits = F.linear(x, weight)  # [b, s, V_p / T]: this rank's slice of the vocabulary
    if labels is None:
        return gather_last_dim(logits, tp.group, tp.size, tp.rank)[..., :vocab_size]
    width = weight.shape[0]
    per_token = vocab_parallel_cross_entropy(
        logits.reshape(-1, width), labels.reshape(-1), tp.rank * width, vocab_size, tp.group
    )  # [b * s]
    return token_mean(per_token, labels, loss_mask)
