"""Step runners: one per schedule, each running a whole training step and evaluation.

A step runner is what the trainer calls; its whole interface is

    result = runner.step(batches, lr)   # this DP replica's micro batches (`Batch`es) of one step
    loss = runner.evaluate(batches)     # mean loss of the micro batches, forward only

`step` runs forward + backward of every micro batch (gradients accumulate in fp32 main
gradients), the data-parallel reduction of the gradients, the sums of partial gradients (tensor
parallelism, a tied embedding's two pipeline copies), and one optimizer step. It returns device
scalars, with no host sync: `loss` (mean over the micro batches and the DP replicas),
`grad_norm`, `skipped`, `loss_scale`. `evaluate` returns a device scalar too.

Each runner owns its data-parallel reduction, because only the runner knows when the backward of
a model chunk is its last one of the step: the reducer (`BucketReducer` for DDP and the
distributed optimizer, `GradientSyncSwitch` for FSDP) is told so before each backward, and the
reduction of that chunk's gradients starts during that backward, overlapped with the rest of it.

- `PlainRunner`: one model, micro batches one after the other; the reduction starts during the
  last micro batch's backward.
- `PipelineRunner`: this rank's pipeline stages, micro batches through the (interleaved) 1F1B
  schedule of `PipelineSchedule`; the reduction of each chunk starts during that chunk's last
  backward (micro batch M - 1 on every chunk, since each chunk runs its backwards in micro-batch
  order), while the schedule goes on with the other chunks and stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.data.batch import Batch
from trireme.ops.fp8_training import end_fp8_step, start_fp8_step
from trireme.optim.optimizer import MixedPrecisionOptimizer
from trireme.parallel.context_parallel import split_batch
from trireme.step.data_parallel import BucketReducer, data_parallel_loss
from trireme.step.fsdp import GradientSyncSwitch
from trireme.step.pipeline import PipelineSchedule
from trireme.step.stragglers import RankTimes

Reducer = BucketReducer | GradientSyncSwitch


class StepRunner:
    """What the two runners share: the parts of a step and its tail (module docstring).

    `reducer` averages the gradients over the DP replicas (None at DP = 1); `grad_sync` sums the
    partial gradients afterwards (TP partial sums, a tied embedding's copies: sums, so they
    commute with the DP mean); `dp_group` / `dp_size` average the logged loss.
    """

    def __init__(
        self, chunks: list[nn.Module], optimizer: MixedPrecisionOptimizer,
        device: torch.device, reducer: Reducer | None = None,
        grad_sync: Callable[[], None] | None = None,
        dp_group: dist.ProcessGroup | None = None, dp_size: int = 1,
    ) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        self.device = device
        self.reducer = reducer
        self.grad_sync = grad_sync
        self.dp_group, self.dp_size = dp_group, dp_size
        ctx = getattr(chunks[0], "ctx", None)  # the context-parallel group, if any
        self.context = ctx.context if ctx is not None else None
        self.times = RankTimes(device)  # this rank's own time per step (engine/stragglers.py)

    def step(self, batches: list[Batch], lr: float) -> dict[str, Tensor]:
        raise NotImplementedError

    def evaluate(self, batches: list[Batch]) -> Tensor:
        raise NotImplementedError

    def _local(self, batches: list[Batch]) -> list[Batch]:
        """Under context parallelism this rank's share of each micro batch's sequence."""
        if self.context is None:
            return batches
        return [split_batch(batch, self.context) for batch in batches]

    def _context_mean(self, loss: Tensor) -> Tensor:
        """An evaluation loss averaged over the context ranks (each holds part of every
        sequence; data-parallel replicas evaluate the same batches, so nothing else differs)."""
        if self.context is None:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss, group=self.context.group)
        return loss / self.context.size

    def _start(self, num_micro_batches: int) -> None:
        self.times.step_started()
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        for chunk in self.chunks:  # fp8 delayed scaling: the amax histories move on a step
            start_fp8_step(chunk)
        if self.reducer is not None:
            self.reducer.start_step()
        if any(chunk.moe_sublayers() for chunk in self.chunks):
            # MoE balancing losses: their gradient is d(step loss) / d(their value)
            one = torch.ones((), device=self.device)
            scale = self.optimizer.scale_loss(one) / num_micro_batches
            for chunk in self.chunks:
                chunk.start_step(scale)

    def _mark_backward(self, chunk: int, micro_batch: int, num_micro_batches: int) -> None:
        """Before a backward: its chunk's gradients reduce over DP if it is the chunk's last."""
        if self.reducer is not None:
            self.reducer.set_last_backward(chunk, micro_batch == num_micro_batches - 1)

    def _finish(self, loss: Tensor, lr: float) -> dict[str, Tensor]:
        """Wait for the DP reduction, sum the partial gradients, step; the loss averaged over
        the DP replicas. A non-finite loss (on any replica: the mean is then non-finite too)
        skips the update on every rank, as a non-finite gradient norm does."""
        self.times.compute_done()  # from here on this rank waits for the others
        if self.reducer is not None:
            self.reducer.finish()
        if self.grad_sync is not None:
            self.grad_sync()
        loss = data_parallel_loss(loss, self.dp_group, self.dp_size)
        for chunk in self.chunks:  # fp8: the weights' casts are this step's, W changes now
            end_fp8_step(chunk)
        result = self.optimizer.step(lr, loss)
        result["loss"] = loss
        moe = {name: stats for chunk in self.chunks for name, stats in chunk.after_step().items()}
        if moe:
            result["moe"] = moe
        return result


class PlainRunner(StepRunner):
    """One model (maybe tensor-parallel or FSDP-sharded): micro batches one after the other."""

    def step(self, batches: list[Batch], lr: float) -> dict[str, Tensor]:
        """One optimizer step over `batches` (module docstring)."""
        batches = self._local(batches)
        model, n = self.chunks[0], len(batches)
        self._start(n)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, batch in enumerate(batches):
            self._mark_backward(0, i, n)  # the DP buckets reduce during the last backward only
            loss = model(batch.tokens, batch.labels, **batch.model_kwargs())
            self.optimizer.scale_loss(loss / n).backward()
            loss_sum += loss.detach()
        return self._finish(loss_sum / n, lr)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> Tensor:
        """Mean loss of `batches` (dropout off)."""
        batches = self._local(batches)
        model = self.chunks[0]
        model.eval()
        total = torch.zeros((), device=self.device)
        for batch in batches:
            total += model(batch.tokens, batch.labels, **batch.model_kwargs()).float()
        model.train()
        return self._context_mean(total / len(batches))


class PipelineRunner(StepRunner):
    """This rank's pipeline stages, run by `schedule` (module docstring)."""

    def __init__(self, schedule: PipelineSchedule, optimizer: MixedPrecisionOptimizer,
                 device: torch.device, **parts) -> None:
        super().__init__(schedule.chunks, optimizer, device, **parts)
        self.schedule = schedule
        self._num_micro_batches = 0

    def step(self, batches: list[Batch], lr: float) -> dict[str, Tensor]:
        """One optimizer step over `batches` (module docstring); the loss comes from the last
        stage, broadcast to every stage."""
        batches = self._local(batches)
        self._start(len(batches))
        self._num_micro_batches = len(batches)
        loss = self.schedule.forward_backward(batches, self.optimizer.scale_loss,
                                              self._before_backward)
        return self._finish(loss, lr)

    def _before_backward(self, chunk: int, micro_batch: int) -> None:
        self._mark_backward(chunk, micro_batch, self._num_micro_batches)

    def evaluate(self, batches: list[Batch]) -> Tensor:
        """Mean loss of `batches` through the stages (dropout off), on every stage."""
        batches = self._local(batches)
        for chunk in self.chunks:
            chunk.eval()
        loss = self.schedule.evaluate(batches)
        for chunk in self.chunks:
            chunk.train()
        return self._context_mean(loss)
