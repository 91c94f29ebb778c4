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

Two reductions:

- all-reduce (plain DDP): every replica ends with the whole mean gradient;
- reduce-scatter (distributed optimizer): each bucket is padded to a multiple of DP and replica r
  receives only chunk r of each bucket's mean, written back into the same place of its buffer.
  Replica r's optimizer shard is the union of its chunks (`GradLayout.shard_ranges`).

At DP = 1 none of this exists: no buckets, no hooks beyond the optimizer's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.optim.layout import GradLayout
from trireme.parallel.comm import _reduce_scatter_single


class BucketReducer:
    """Reduces the flat gradient buffer over the DP group, bucket by bucket, overlapped with the
    last micro batch's backward (module docstring).

    Usage per step: `start_step()`; set `last_micro_batch = True` before the last backward;
    `finish()` before the optimizer step (waits for every reduction). `events`, when a list,
    records "reduce <bucket>" as each reduction starts (tests use it to see the overlap).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: GradLayout,
        grad_flat: Tensor,
        group: dist.ProcessGroup,
        scatter: bool = False,
    ) -> None:
        self.layout = layout
        self.grad_flat = grad_flat
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.scatter = scatter
        self.last_micro_batch = False
        self.events: list[str] | None = None
        self._bucket_of = {}
        for b, bucket in enumerate(layout.buckets):
            for i in bucket.params:
                self._bucket_of[id(params[i])] = b
        self._pending: list[int] = []
        self._works: list[tuple[int, object, Tensor | None]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.start_step()

    def start_step(self) -> None:
        self.last_micro_batch = False
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._works = []

    def _on_grad_ready(self, param: Tensor) -> None:
        # Runs after the optimizer's hook has added this micro batch's gradient into main_grad.
        if not self.last_micro_batch:
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
        if self.scatter:
            out = view.new_empty(bucket.numel // self.size)
            work = _reduce_scatter_single(out, view, group=self.group, async_op=True)
            self._works.append((b, work, out))
        else:
            work = dist.all_reduce(view, group=self.group, async_op=True)
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
                start, end = self.layout.shard_ranges(self.rank)[b]
                self.grad_flat[start:end].copy_(out)
        self._works = []
        self.last_micro_batch = False

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
