"""Pipeline parallelism, part 2: running a step's micro batches through the stages.

`PipelineSchedule` walks the timetable of trireme.step.schedules: in each tick this rank runs
its one forward or backward pass (if any), then exchanges the tick's activations and gradients
with its neighbours (p2p.py). A forward stores (input, output) of its micro batch for the
backward; the backward frees them at once, so the stored activations are the micro batches in
flight (at most P on the first stage under 1F1B; `max_in_flight` records it). It only moves
micro batches (`Batch`es) through the stages; the optimizer step and the data-parallel reduction
around it belong to the step runner (trireme.step.runners.PipelineRunner).

The last stage computes the loss of each micro batch; after the step it is broadcast to every
pipeline rank for logging. `TiedEmbeddingSync` sums the gradients of the two copies of a tied
embedding (first and last stage), so they stay identical.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.data.batch import Batch
from trireme.parallel.mesh import AXES, ParallelMesh
from trireme.parallel.p2p import exchange
from trireme.step.grads import _grad
from trireme.step.schedules import (
    FORWARD,
    Pass,
    Tick,
    evaluation_timetable,
    training_timetable,
)

BeforeBackward = Callable[[int, int], None]  # (chunk, micro batch) -> None


class _StepState:
    """What one run of the timetable holds: received tensors, stored activations, losses."""

    def __init__(self, micro_batches: list[Batch], training: bool,
                 before_backward: BeforeBackward | None = None) -> None:
        self.micro_batches = micro_batches
        self.training = training
        self.before_backward = before_backward
        self.inbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, stage, micro batch)
        self.stored: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}  # (chunk, mb)
        self.outputs: list[Tensor] = []  # the last stage's losses (or logits without labels)
        self.max_in_flight = 0


class PipelineSchedule:
    """Runs micro batches through this rank's model chunks with the (interleaved) 1F1B schedule."""

    def __init__(
        self, chunks: list[nn.Module], mesh: ParallelMesh, activation_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.chunks = chunks
        self.group = mesh.group("pipeline")
        self.rank = mesh.coordinate("pipeline")
        self.size = mesh.size("pipeline")
        self.virtual = len(chunks)
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.max_in_flight = 0  # of the last training step, over this rank's chunks
        # NCCL wants every rank of a group in its first point-to-point call; the first tick
        # involves only stages 0 and 1, so one collective sets the group up for all.
        dist.barrier(group=self.group)

    def _stage(self, chunk: int) -> int:
        return chunk * self.size + self.rank

    def forward_backward(
        self, micro_batches: list[Batch], scale_loss=lambda x: x,
        before_backward: BeforeBackward | None = None,
    ) -> Tensor:
        """Forward and backward of every micro batch (gradients accumulate in the parameters);
        returns the mean loss on every pipeline rank. `before_backward(chunk, micro_batch)` runs
        before each backward pass (the step runner marks each chunk's last one there, so its
        data-parallel reduction starts during that backward)."""
        state = _StepState(micro_batches, training=True, before_backward=before_backward)
        table = training_timetable(self.size, self.virtual, len(micro_batches))
        self._run(table, state, scale_loss)
        self.max_in_flight = state.max_in_flight
        return self._mean_loss(state)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[Batch]) -> Tensor:
        """The mean loss of the micro batches (forward only), on every pipeline rank."""
        state = _StepState(micro_batches, training=False)
        self._run(evaluation_timetable(self.size, self.virtual, len(micro_batches)), state)
        return self._mean_loss(state)

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], total: int, sample: Callable[[Tensor], Tensor]
    ) -> list[int]:
        """Extend `prompt_ids` to `total` tokens, one forward through the stages per token.

        The input is padded to the activation shape's sequence length (causal attention: the
        padding does not change the logits before it), so the shapes stay those of the config.
        The last stage picks each token with `sample` (logits [1, vocab] -> [1]) and broadcasts
        it to every pipeline rank.
        """
        seq = self.activation_shape[1] * (self.chunks[0].tp.size if self._split_sequence else 1)
        ids = torch.zeros((1, seq), dtype=torch.long, device=self.device)
        ids[0, : len(prompt_ids)] = torch.tensor(prompt_ids, device=self.device)
        last = dist.get_global_rank(self.group, self.size - 1)
        for pos in range(len(prompt_ids), min(total, seq)):
            state = _StepState([Batch(ids, None)], training=False)
            self._run(evaluation_timetable(self.size, self.virtual, 1), state)
            token = torch.zeros(1, dtype=torch.long, device=self.device)
            if state.outputs:
                token = sample(state.outputs[0][:, pos - 1].float())
            dist.broadcast(token, src=last, group=self.group)
            ids[0, pos] = token[0]
        return ids[0, : min(total, seq)].tolist()

    @property
    def _split_sequence(self) -> bool:
        tp = self.chunks[0].tp
        return tp is not None and tp.sequence_parallel

    def _run(self, table: list[Tick], state: _StepState, scale_loss=None) -> None:
        for tick in table:
            p = tick.passes[self.rank]
            outgoing = None
            if p is not None and p.kind == FORWARD:
                outgoing = self._forward(p, state)
            elif p is not None:
                outgoing = self._backward(p, state, scale_loss)
            transfers = []
            for m in tick.messages:
                if m.src == self.rank:
                    transfers.append(("send", outgoing.contiguous(), m.dst))
                if m.dst == self.rank:
                    buffer = torch.empty(self.activation_shape, dtype=self.dtype,
                                         device=self.device)
                    state.inbox[(m.kind, m.stage, m.micro_batch)] = buffer
                    transfers.append(("recv", buffer, m.src))
            exchange(transfers, self.group)

    def _forward(self, p: Pass, state: _StepState) -> Tensor | None:
        chunk = self.chunks[p.chunk]
        stage = self._stage(p.chunk)
        batch = state.micro_batches[p.micro_batch]
        x = None
        if not chunk.stage.first:
            x = state.inbox.pop((FORWARD, stage, p.micro_batch))
            x.requires_grad_(state.training)
        labels = batch.labels if chunk.stage.last else None
        out = chunk(batch.tokens, labels, hidden=x, **batch.model_kwargs())
        if chunk.stage.last:
            state.outputs.append(out.detach())
        if state.training:
            state.stored[(p.chunk, p.micro_batch)] = (x, out)
            state.max_in_flight = max(state.max_in_flight, len(state.stored))
        return None if chunk.stage.last else out.detach()

    def _backward(self, p: Pass, state: _StepState, scale_loss) -> Tensor | None:
        chunk = self.chunks[p.chunk]
        x, out = state.stored.pop((p.chunk, p.micro_batch))  # freed after this backward
        if state.before_backward is not None:
            state.before_backward(p.chunk, p.micro_batch)
        if chunk.stage.last:
            scale_loss(out / len(state.micro_batches)).backward()
        else:
            grad = state.inbox.pop(("backward", self._stage(p.chunk), p.micro_batch))
            torch.autograd.backward(out, grad)
        return None if x is None else x.grad

    def _mean_loss(self, state: _StepState) -> Tensor:
        """The last stage's mean loss, broadcast to every pipeline rank."""
        if state.outputs:
            loss = torch.stack(state.outputs).float().mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        last = dist.get_global_rank(self.group, self.size - 1)
        dist.broadcast(loss, src=last, group=self.group)
        return loss


def first_last_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The group {first stage, last stage} of this rank's pipeline (None off those stages).
    Collective: every rank creates every pair, in the same order."""
    dims = mesh.dims
    grid = torch.arange(dims.world_size).view(dims.shape)
    columns = grid.movedim(AXES.index("pipeline"), -1).reshape(-1, dims.pipeline)
    mine = None
    for column in columns.tolist():
        group = dist.new_group([column[0], column[-1]])
        if mesh.rank in (column[0], column[-1]):
            mine = group
    return mine


def model_replica_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The ranks holding one model replica: every pipeline stage and tensor slice with this
    rank's data (and context) coordinate; sums over the whole model (a gradient norm) run over
    it. Collective: every rank creates every group, in the same order."""
    dims = mesh.dims
    grid = torch.arange(dims.world_size).view(dims.shape)
    order = [AXES.index(a) for a in ("data", "context", "pipeline", "tensor")]
    mine = None
    for ranks in grid.permute(order).reshape(-1, dims.pipeline * dims.tensor).tolist():
        group = dist.new_group(ranks)
        if mesh.rank in ranks:
            mine = group
    return mine


class TiedEmbeddingSync:
    """Sums the gradients of the tied embedding's two copies (first and last stage).

    `grad_of(param)` is the part of the gradient this rank holds reduced over DP: all of it
    (one process, DDP), this rank's chunk (distributed optimizer: the same rows on both stages,
    see `data_parallel_layout`) or its FSDP shard (the same rows on both stages too). Both DP
    means are summed, which equals the DP mean of the sums."""

    def __init__(self, chunks: list[nn.Module], mesh: ParallelMesh,
                 grad_of: Callable[[nn.Parameter], Tensor] = _grad) -> None:
        self.group = first_last_group(mesh)
        self.grad_of = grad_of
        self.param = None
        for chunk in chunks:
            if chunk.stage.first or chunk.stage.last:
                self.param = chunk.embedding.weight

    def __call__(self) -> None:
        if self.param is None:
            return
        grad = self.grad_of(self.param)
        if grad.numel():  # an empty chunk is empty on both stages
            dist.all_reduce(grad, group=self.group)
