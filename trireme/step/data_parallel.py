"""Data parallelism: the gradient buffer's layout in buckets, and their overlapped reduction.

Every data-parallel (DP) replica computes the gradient of its own micro batches; the replicas must
end the step with the mean over all of them. The optimizer keeps the fp32 main gradients in one
flat buffer (`trireme.optim.optimizer`); here that buffer is cut into buckets of whole parameters,
in the order the backward pass finishes them (the output layer first):

    buffer = [ bucket 0 | bucket 1 | ... ]     bucket 0 holds the last parameters of the model

During the backward of the LAST micro batch of a step, a hook on each parameter counts down its
bucket; when a bucket's last gradient has been added, its reduction starts asynchronously and runs
while autograd computes the earlier layers. Earlier micro batches only accumulate (no traffic).
The gradient is divided by the DP degree before the sum, so the collective yields the mean.

Under pipeline parallelism a rank holds model chunks (stages) whose last backwards come at
different times of the schedule (interleaved 1F1B: chunk V-1's last backward, then more backwards
of the other chunks, then chunk V-2's last one ...). So "last" is kept per chunk: the step runner
says before each backward whether it is its chunk's last one (`set_last_backward`), and a
parameter counts only in its own chunk's last backward.

Two reductions:

- all-reduce (plain DDP): every replica ends with the whole mean gradient;
- reduce-scatter (distributed optimizer): each bucket is padded to a multiple of DP and replica r
  receives only chunk r of each bucket's mean, written back into the same place of its buffer.
  Replica r's optimizer shard is the union of its chunks (`GradLayout.shard_ranges`).

Under expert parallelism the routed experts' gradients sit in buckets of their own (placed after
the others, `data_parallel_layout`), reduced over the expert-data group: the replicas of this
rank's experts. Those gradients already hold the sum over the expert group's micro batches (the
tokens came to this rank's experts from every rank of it), so they are divided by the whole DP
degree too, and the sum over the expert-data replicas is the mean over every replica.

At DP = 1 none of this exists: no buckets, no hooks beyond the optimizer's own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.optim.layout import Bucket, GradLayout, grad_layout
from trireme.parallel.comm import _reduce_scatter_single


class BucketReducer:
    """Reduces the flat gradient buffer over the DP group, bucket by bucket, overlapped with the
    last micro batch's backward (module docstring).

    Usage per step: `start_step()`; before each backward say whether it is the last one of its
    model chunk (`set_last_backward(chunk, last)`, or `last_micro_batch = True` for every chunk);
    `finish()` before the optimizer step (waits for every reduction). `chunk_of[i]` is the chunk
    of `params[i]` (default: one chunk). `events`, when a list, records "reduce <bucket>" as each
    reduction starts (tests use it to see the overlap). `groups` gives the group of each bucket
    axis other than the DP group's (None: a group of one rank, nothing to reduce).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: GradLayout,
        grad_flat: Tensor,
        group: dist.ProcessGroup,
        scatter: bool = False,
        chunk_of: Sequence[int] | None = None,
        groups: Mapping[str, dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.layout = layout
        self.grad_flat = grad_flat
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.groups = {**(groups or {}), "data_context": group}
        self.ranks = bucket_ranks(self.groups)
        self.scatter = scatter
        self.events: list[str] | None = None
        chunk_of = list(chunk_of) if chunk_of is not None else [0] * len(params)
        self._last = [False] * (max(chunk_of, default=0) + 1)  # per chunk: in its last backward
        self._chunk_of = {id(p): c for p, c in zip(params, chunk_of)}
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._bucket_of = {}
        for b, bucket in enumerate(layout.buckets):
            for i in bucket.params:
                self._bucket_of[id(params[i])] = b
        self._pending: list[int] = []
        self._works: list[tuple[int, object, Tensor | None]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.start_step()

    @property
    def last_micro_batch(self) -> bool:
        """True while every chunk is in its last backward (the one-chunk case's flag)."""
        return all(self._last)

    @last_micro_batch.setter
    def last_micro_batch(self, value: bool) -> None:
        self._last = [value] * len(self._last)

    def set_last_backward(self, chunk: int, last: bool) -> None:
        """Whether the next backward of `chunk` is its last one this step (its buckets reduce)."""
        self._last[chunk] = last

    def start_step(self) -> None:
        self.last_micro_batch = False
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._works = []

    def _on_grad_ready(self, param: Tensor) -> None:
        # Runs after the optimizer's hook has added this micro batch's gradient into main_grad.
        if not self._last[self._chunk_of[id(param)]]:
            return
        b = self._bucket_of[id(param)]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        self._pending[b] = -1  # launched
        bucket = self.layout.buckets[b]
        view = self.grad_flat[bucket.start : bucket.end]
        view.div_(self.size)  # sum of (g / DP) = mean over the replicas
        if self.events is not None:
            self.events.append(f"reduce {b}")
        group = self.groups[bucket.axis]
        if group is None:  # one replica of these experts: the division was all
            return
        if self.scatter:
            out = view.new_empty(bucket.numel // dist.get_world_size(group))
            work = _reduce_scatter_single(out, view, group=group, async_op=True)
            self._works.append((b, work, out))
        else:
            work = dist.all_reduce(view, group=group, async_op=True)
            self._works.append((b, work, None))

    @torch.no_grad()
    def finish(self) -> None:
        """Start the buckets no gradient reached (unused parameters), in bucket order so every
        replica issues the same collectives, then wait for all of them."""
        for b, pending in enumerate(self._pending):
            if pending >= 0:
                self._launch(b)
        for b, work, out in self._works:
            work.wait()
            if out is not None:
                start, end = self.layout.shard_ranges(self.ranks)[b]
                self.grad_flat[start:end].copy_(out)
        self._works = []
        self.last_micro_batch = False

    def reduced_part(self, param: nn.Parameter) -> Tensor:
        """The flat part of `param`'s gradient that holds the DP mean on this rank after `finish`:
        all of it (all-reduce), or the part inside this rank's chunk of its bucket
        (reduce-scatter; possibly empty)."""
        i, b = self._index_of[id(param)], self._bucket_of[id(param)]
        start = self.layout.offsets[i]
        end = start + param.numel()
        if self.scatter:
            lo, hi = self.layout.shard_ranges(self.ranks)[b]
            start, end = max(start, lo), min(end, hi)
        return self.grad_flat[start : max(start, end)]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def data_parallel_loss(loss: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """The mean of `loss` over the DP replicas (unchanged at DP = 1)."""
    if group is None or size == 1:
        return loss
    loss = loss.clone()
    dist.all_reduce(loss, group=group)
    return loss / size


def bucket_ranks(groups: Mapping[str, dist.ProcessGroup | None]) -> dict[str, int]:
    """This rank's place in each bucket axis's group (0 in a group of one)."""
    return {axis: dist.get_rank(g) if g is not None else 0 for axis, g in groups.items()}


def data_parallel_layout(
    numels: Sequence[int], bucket_size: int, data_parallel: int, alone: Collection[int] = (),
    experts: Collection[int] = (), expert_data: int = 1,
) -> GradLayout:
    """`grad_layout` of the parameters with `numels` elements, except that each parameter in
    `alone` gets a bucket of its own, placed after the others, and the parameters in `experts`
    (expert-parallel experts) buckets of their own over the "expert_data" axis of `expert_data`
    ranks, placed between the two.

    Why: the two copies of a tied embedding (first and last pipeline stage) must be cut the same
    way into DP chunks on both stages, so that after a reduce-scatter rank d of each stage holds
    the same rows (their gradients are then summed chunk to chunk, and a sharded checkpoint sees
    one piece, not two overlapping ones). Alone in a bucket starting at the bucket's start, a
    parameter is cut by its own size only, whatever else the stage holds."""
    rest = [i for i in range(len(numels)) if i not in alone and i not in experts]
    expert = sorted(experts)
    axis = "data_context"
    parts = [(rest, grad_layout([numels[i] for i in rest], bucket_size, data_parallel), axis)]
    if expert:
        parts.append((expert, grad_layout([numels[i] for i in expert], bucket_size, expert_data),
                      "expert_data"))
    parts += [([i], grad_layout([numels[i]], 0, data_parallel), axis) for i in sorted(alone)]
    offsets, buckets, total = [0] * len(numels), [], 0
    for indices, part, axis in parts:
        for i, offset in zip(indices, part.offsets):
            offsets[i] = total + offset
        shards = 0 if axis == "data_context" else part.data_parallel
        for bucket in part.buckets:
            buckets.append(Bucket(total + bucket.start, total + bucket.end,
                                  tuple(indices[j] for j in bucket.params), axis, shards))
        total += part.total
    return GradLayout(tuple(offsets), total, tuple(buckets), data_parallel)
