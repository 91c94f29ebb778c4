"""Gradients under tensor parallelism: finishing the partial ones, and the global norm.

Some parameters are replicated on every tensor-parallel rank, but each rank's backward sees only
part of their use, so its gradient is a partial sum that must be summed over the ranks:

- under sequence parallelism, every replicated parameter (norm weights and biases, the biases
  added after a row-parallel layer, learned position embeddings): it sees only this rank's tokens;
- always, QK-norm weights: shared by all heads, they see only this rank's heads;
- always, a mixture-of-experts layer's router and routed experts: the layer cuts its tokens
  among the TP ranks (trireme.models.moe), so each rank's gradient is that of its tokens;
- the key/value rows of a fused QKV weight when T exceeds the query groups: a replicated K/V head
  sees only the query heads of this rank, so its rows are summed over the T / groups ranks that
  hold it.

`PartialGradSync` does this after the last micro batch's backward, one all-reduce per group.

The global gradient norm must count every element of the full model once. Rank r adds
sum(g^2) / replicas for each piece of its gradients (replicas = how many TP ranks hold the same
numbers: 1 for split parts, T for replicated parameters, T / groups for replicated K/V heads), and
the sums are all-reduced over the group; under pipeline parallelism also over the stages, with
the last stage's copy of a tied embedding left out (`parallel_grad_norm`). Under expert
parallelism each rank of the expert group holds other experts: their squares are also summed over
that group, the other parameters' (the same on every rank of it) counted once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.parallel.sharding import Sharding, parameter_shardings
from trireme.parallel.tensor import TensorParallel

# Replicated parameters whose gradient is partial even without SP: used inside the head-split part
# of attention, or by a mixture-of-experts layer on this TP rank's share of the tokens.
HEAD_SPLIT_REPLICATED = (".q_norm.", ".k_norm.", ".router.", ".experts.")
IN_PLACE = 1 << 20  # gradients of at least this many elements are all-reduced where they lie


def _in_place(g: Tensor) -> bool:
    """Whether PartialGradSync all-reduces `g` where it lies: large ones, and the experts' 3-D
    ones (whatever their size, so that the tests' small models take this path too)."""
    return g.is_contiguous() and (g.numel() >= IN_PLACE or g.dim() > 2)


def _grad(param: nn.Parameter) -> Tensor:
    """The gradient the optimizer will read: the fp32 main gradient if there is one."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        return main
    if param.grad is None:  # unused this step: a zero gradient still joins the collective
        param.grad = torch.zeros_like(param)
    return param.grad


class PartialGradSync:
    """Sums the partial gradients of `model` over the TP ranks that share them (module doc)."""

    def __init__(self, model: nn.Module, tp: TensorParallel) -> None:
        shardings = parameter_shardings(model, "tensor")
        # group -> [(param, rows of dim 0 to reduce, or None for all)]
        self.entries: dict[dist.ProcessGroup, list[tuple[nn.Parameter, slice | None]]] = (
            defaultdict(list)
        )
        for name, param in model.named_parameters():
            if not param.requires_grad:  # frozen (model.freeze): no gradient to finish
                continue
            sharding = shardings.get(name)
            if sharding is None:
                wrapped = f".{name}."
                if tp.sequence_parallel or any(k in wrapped for k in HEAD_SPLIT_REPLICATED):
                    self.entries[tp.group].append((param, None))
                continue
            for part in sharding.slices():
                if part.replicas > 1:
                    rows = slice(part.local_start, part.local_start + part.rows)
                    self.entries[tp.replica_groups[part.replicas]].append((param, rows))

    def __call__(self) -> None:
        for group, items in self.entries.items():
            grads = [_grad(p) if rows is None else _grad(p)[rows] for p, rows in items]
            small = [g for g in grads if not _in_place(g)]
            for g in grads:  # large ones (a MoE layer's experts) in place: no concatenated copy
                if _in_place(g):
                    dist.all_reduce(g, group=group)
            if not small:
                continue
            flat = torch.cat([g.reshape(-1) for g in small])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in small:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def __bool__(self) -> bool:
        return bool(self.entries)


def tensor_parallel_grad_norm(
    model: nn.Module, tp: TensorParallel
) -> Callable[[list[tuple[str, Tensor]]], Tensor]:
    """A function (name, gradient) pairs -> the global L2 norm of the full model's gradient."""
    return parallel_grad_norm([model], tp)


def parallel_grad_norm(
    chunks: list[nn.Module],
    tp: TensorParallel | None,
    pipeline_group: dist.ProcessGroup | None = None,
    skip: frozenset[str] = frozenset(),
    expert_group: dist.ProcessGroup | None = None,
) -> Callable[[list[tuple[str, Tensor]]], Tensor]:
    """Like `tensor_parallel_grad_norm` for this rank's model chunks, the squares also summed over
    the pipeline stages (`pipeline_group`) and over the expert group (`expert_group`: the experts
    counted on each rank, everything else on one). Names in `skip` are not counted here: the last
    stage's copy of a tied embedding, which the first stage counts."""
    shardings: dict[str, Sharding] = {}
    experts: set[str] = set()
    for chunk in chunks:
        shardings.update(parameter_shardings(chunk, "tensor"))
        experts.update(parameter_shardings(chunk, "expert"))
    tp_size = tp.size if tp is not None else 1
    ep_size = dist.get_world_size(expert_group) if expert_group is not None else 1

    def grad_norm(named_grads: list[tuple[str, Tensor]]) -> Tensor:
        by_replicas: dict[int, list[Tensor]] = defaultdict(list)
        for name, g in named_grads:
            sharding = shardings.get(name)
            if name in skip:
                continue
            elif name in experts:
                by_replicas[tp_size].append(g)
            elif sharding is None:
                by_replicas[tp_size * ep_size].append(g)
            else:
                for view, replicas in sharding.views(g):
                    by_replicas[replicas * ep_size].append(view)
        device = named_grads[0][1].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for replicas, tensors in by_replicas.items():
            norms = torch._foreach_norm(tensors, 2.0)
            total = total + torch.stack(norms).float().square().sum() / replicas
        if expert_group is not None:
            dist.all_reduce(total, group=expert_group)
        if tp is not None:
            dist.all_reduce(total, group=tp.group)
        if pipeline_group is not None:
            dist.all_reduce(total, group=pipeline_group)
        return total.sqrt()

    return grad_norm


def inverse_replicas(
    model: nn.Module, tp: TensorParallel, named_params: list[tuple[str, nn.Parameter]],
    offsets: tuple[int, ...], total: int,
) -> Tensor:
    """A flat fp32 tensor in the gradient-buffer layout (`offsets`, `total`): 1 / (TP ranks
    holding the same numbers) for each element (0 on padding), so that sum(g^2 * w) over the TP
    ranks counts each element of the full model once (the distributed optimizer's norm)."""
    return norm_weights([model], tp, named_params, offsets, total)


def norm_weights(
    chunks: list[nn.Module], tp: TensorParallel | None,
    named_params: list[tuple[str, nn.Parameter]], offsets: tuple[int, ...], total: int,
    skip: frozenset[str] = frozenset(),
) -> Tensor:
    """`inverse_replicas` for a rank's model chunks (pipeline stages), with 0 for the names in
    `skip` (the last stage's copy of a tied embedding, counted by the first stage) and 1 for
    everything else when there is no tensor parallelism."""
    shardings: dict[str, Sharding] = {}
    for chunk in chunks:
        shardings.update(parameter_shardings(chunk, "tensor"))
    tp_size = tp.size if tp is not None else 1
    weights = torch.zeros(total, dtype=torch.float32, device=named_params[0][1].device)
    for (name, p), offset in zip(named_params, offsets):
        if name in skip:
            continue
        view = weights[offset : offset + p.numel()].view(p.shape)
        sharding = shardings.get(name)
        if sharding is None:
            view.fill_(1.0 / tp_size)
        else:
            for part, replicas in sharding.views(view):
                part.fill_(1.0 / replicas)
    return weights
