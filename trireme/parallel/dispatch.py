"""Expert parallelism: sending routed tokens to the ranks that hold their experts, and back.

The E routed experts of a mixture-of-experts layer are cut over the expert group of P ranks:
rank r holds the L = E / P experts [r L, (r + 1) L) (`ExpertShard`). Each rank routes its own
tokens; the (token, expert) assignments it keeps then travel to the experts' ranks. Two ways:

- all-to-all (`all_to_all_dispatch`, the default): the assignments, sorted by expert and so by
  destination rank, go out in one all-to-all (their counts first, in a small one: the sizes need
  a host sync); each rank regroups what it received by local expert, runs its experts, and the
  outputs return by the reverse all-to-all into the sender's order. Each rank moves its own
  assignments only.
- all-gather (`all_gather_dispatch`): every rank gathers every rank's tokens, routing weights and
  chosen experts, computes its experts' weighted outputs for all of them, and a reduce-scatter
  returns to each rank the sum for its own tokens (summed in fp32). P times the traffic, no size
  exchange (one host sync: how many assignments this rank's experts got); fine for small groups.

Both are differentiable: the backward runs the reverse exchange, so the experts' gradients on a
rank sum the contributions of every rank's tokens that reached them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trireme.ops.moe import count_assignments
from trireme.ops.moe_permute import inverse_permutation
from trireme.parallel.comm import _all_gather_single, gather_sequence, reduce_scatter_sequence

# (rows sorted by local expert [M, h], rows per local expert [L]) -> outputs [M, h]
ExpertFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts: the expert group (None with one rank), its size and this rank's
    place, and the number of experts of the whole layer."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    num_experts: int

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in runs of `send` sent to each rank; `recv` rows come back from each."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None, None]:
        dx = dy.new_empty((sum(ctx.send), *dy.shape[1:]))
        dist.all_to_all_single(dx, dy.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
    """Differentiable all-to-all of rows: `send[r]` rows of `x` to rank r, `recv[r]` from it."""
    return _AllToAll.apply(x, recv, send, group)


def by_local_expert(recv_counts: Tensor, rows: int) -> Tensor:
    """The order that sorts the `rows` received rows by local expert. `recv_counts[s, j]`: rows
    from rank s for local expert j, arriving in (s, j) order; the result lists them in (j, s)
    order."""
    senders, local = recv_counts.shape
    j = torch.arange(local, device=recv_counts.device).repeat(senders)
    s = torch.arange(senders, device=recv_counts.device).repeat_interleave(local)
    key = torch.repeat_interleave(j * senders + s, recv_counts.flatten(), output_size=rows)
    return torch.argsort(key, stable=True)


def all_to_all_dispatch(x: Tensor, counts: Tensor, shard: ExpertShard, experts: ExpertFn
                        ) -> Tensor:
    """Expert outputs [N, h] for assignments `x` [N, h] sorted by (global) expert, `counts` [E]
    of them per expert: each run computed on the rank holding its expert (module docstring)."""
    send_counts = counts.view(shard.size, shard.local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=shard.group)
    send = send_counts.sum(1).tolist()  # the one host sync: all-to-all sizes
    recv = recv_counts.sum(1).tolist()
    received = all_to_all(x, recv, send, shard.group)  # [M, h], by (sender, local expert)
    order = by_local_expert(recv_counts, sum(recv))
    out = experts(received[order], recv_counts.sum(0))
    return all_to_all(out[inverse_permutation(order)], send, recv, shard.group)


def all_gather_dispatch(tokens: Tensor, weights: Tensor, chosen: Tensor, shard: ExpertShard,
                        experts: ExpertFn) -> Tensor:
    """sum_j weights_tj * expert_{chosen_tj}(x_t) for this rank's tokens [T, h], with every
    rank's tokens gathered and each expert computed on its rank (module docstring). `chosen`
    [T, k]: the experts, -1 for a dropped assignment."""
    size, group, k = shard.size, shard.group, chosen.shape[1]
    x_all = gather_sequence(tokens.unsqueeze(0), group, size).squeeze(0)  # [P T, h]
    w_all = gather_sequence(weights.unsqueeze(0), group, size).squeeze(0)  # [P T, k]
    e_all = chosen.new_empty((size * chosen.shape[0], k))
    _all_gather_single(e_all, chosen.contiguous(), group=group)
    local = e_all.flatten() - shard.first
    key = torch.where((local >= 0) & (local < shard.local), local, shard.local)
    counts = count_assignments(key, shard.local + 1)[: shard.local]
    order = torch.argsort(key, stable=True)[: int(counts.sum())]  # the one host sync
    token_of = order.div(k, rounding_mode="floor")
    out = experts(x_all[token_of], counts).float() * w_all.flatten()[order].unsqueeze(-1).float()
    y_all = x_all.new_zeros(x_all.shape, dtype=torch.float32).index_add(0, token_of, out)
    y = reduce_scatter_sequence(y_all.unsqueeze(0), group, size).squeeze(0)  # fp32 sums
    return y.to(tokens.dtype)
