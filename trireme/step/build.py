"""A step runner from the config: for one model or this rank's pipeline stages, the optimizer, the
data-parallel reduction (DDP buckets, distributed optimizer or FSDP), the gradient syncs and the
gradient norm over every parallel group.

Every combination goes through the same few choices:

- pipeline or not: `PipelineRunner` over a `PipelineSchedule`, or `PlainRunner`;
- the DP mode at DP > 1: FSDP (each chunk sharded by `fully_shard`, `FSDPOptimizer`), or a flat
  gradient buffer in buckets reduced by a `BucketReducer` (all-reduce for DDP, reduce-scatter for
  the distributed optimizer);
- the gradient norm: summed over TP and PP (squares), with the last stage's copy of a tied
  embedding left out; the sharded optimizers also sum over DP;
- expert parallelism: the routed experts' gradients in buckets of their own, reduced over the
  expert-data group (trireme.step.data_parallel); the norm also sums them over the expert group.

A tied embedding under PP has a copy on the first and the last stage whose gradients are summed
after the DP reduction (`TiedEmbeddingSync`). Each DP mode makes the two copies' reduced parts
line up: DDP reduces the whole gradient; the distributed optimizer's layout puts the embedding in
a bucket of its own (`data_parallel_layout`), cut into the same DP chunks on both stages; FSDP
shards it by rows the same way on both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trireme.config import Config
from trireme.models.gpt import GPT
from trireme.optim.distributed import DistributedOptimizer
from trireme.optim.optimizer import (
    GradNormFn,
    MixedPrecisionOptimizer,
    build_optimizer,
    named_trainable_parameters,
)
from trireme.parallel.mesh import ParallelMesh
from trireme.parallel.sharding import parameter_shardings
from trireme.parallel.tensor import TensorParallel
from trireme.step.data_parallel import BucketReducer, data_parallel_layout
from trireme.step.fsdp import FSDPOptimizer, GradientSyncSwitch, local_grad, shard_model
from trireme.step.grads import PartialGradSync, _grad, norm_weights, parallel_grad_norm
from trireme.step.pipeline import PipelineSchedule, TiedEmbeddingSync, model_replica_group
from trireme.step.runners import PipelineRunner, PlainRunner, Reducer, StepRunner

# Gradients and the loss are averaged over the data x context ranks: context-parallel ranks hold
# the same parameters and see other tokens of the same samples (the data group at context = 1).
REDUCE_AXIS = "data_context"

# fp8 is bf16 everywhere except the transformer blocks' matmuls (trireme.ops.fp8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}
TIED = "embedding.weight"  # the name of a tied embedding's copy on the last stage


def build_step_runner(
    cfg: Config, chunks: list[GPT], tp: TensorParallel | None, mesh: ParallelMesh,
    device: torch.device, force_data_parallel: bool = False,
) -> StepRunner:
    """The step runner of this rank's `chunks` (one model, or its pipeline stages).

    `force_data_parallel` builds the DP > 1 path (buckets, reducer, distributed optimizer) even
    at DP = 1, over a process group of one rank (which must exist): benchmarks use it to measure
    what that path costs (bench/train_throughput.py --dp-path)."""
    pipelined = mesh.size("pipeline") > 1
    tied = pipelined and cfg.model.tie_embeddings
    # the last stage's copy of a tied embedding is counted by the first stage
    skip = frozenset({TIED}) if tied and not chunks[0].stage.first else frozenset()
    syncs: list[Callable[[], None]] = [PartialGradSync(c, tp) for c in chunks if tp is not None]
    schedule = build_schedule(cfg, chunks, mesh, device) if pipelined else None
    grad_norm = None
    expert_group = mesh.group("expert") if mesh.size("expert") > 1 else None
    if tp is not None or pipelined or expert_group is not None:
        pipeline_group = mesh.group("pipeline") if pipelined else None
        grad_norm = parallel_grad_norm(chunks, tp, pipeline_group, skip, expert_group)
    optimizer, reducer = build_data_parallel_optimizer(cfg, chunks, mesh, device, grad_norm,
                                                       force_data_parallel, skip)
    if tied:  # the two copies summed after the DP mean (both sums: they commute)
        syncs.append(TiedEmbeddingSync(chunks, mesh, tied_grad_part(reducer)))
    parts = dict(reducer=reducer, grad_sync=run_all([s for s in syncs if s]),
                 dp_group=mesh.group(REDUCE_AXIS), dp_size=mesh.size(REDUCE_AXIS))
    if schedule is not None:
        return PipelineRunner(schedule, optimizer, device, **parts)
    return PlainRunner(chunks, optimizer, device, **parts)


def tied_grad_part(reducer: Reducer | None) -> Callable[[nn.Parameter], torch.Tensor]:
    """The part of a gradient that holds its DP mean on this rank after the reduction."""
    if isinstance(reducer, BucketReducer):
        return reducer.reduced_part
    if isinstance(reducer, GradientSyncSwitch):
        return local_grad
    return _grad


def build_schedule(cfg: Config, chunks: list[GPT], mesh: ParallelMesh, device: torch.device,
                   micro_batch_size: int = 0) -> PipelineSchedule:
    """The pipeline schedule; activations between stages are [micro batch, seq, hidden] (the
    sequence cut over the context ranks, and split over the TP ranks under sequence
    parallelism)."""
    seq = cfg.model.seq_length // cfg.parallel.context  # this context rank's share
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1:
        seq //= cfg.parallel.tensor
    shape = (micro_batch_size or cfg.train.micro_batch_size, seq, cfg.model.hidden_size)
    return PipelineSchedule(chunks, mesh, shape, DTYPES[cfg.model.precision], device)


def build_data_parallel_optimizer(
    cfg: Config, chunks: list[GPT], mesh: ParallelMesh, device: torch.device,
    grad_norm: GradNormFn | None, force: bool = False, skip: frozenset[str] = frozenset(),
) -> tuple[MixedPrecisionOptimizer, Reducer | None]:
    """The optimizer of `chunks` and, under data parallelism, what reduces their gradients over
    the DP replicas. At DP = 1 (unless `force`) this is the plain optimizer and no reducer: no
    cost at all. `skip`: names the gradient norm leaves out (module docstring)."""
    precision = cfg.model.precision
    if mesh.size(REDUCE_AXIS) == 1 and not force:
        return build_optimizer(chunks, cfg.optimizer, precision, device, grad_norm), None
    pipeline_group = mesh.group("pipeline") if mesh.size("pipeline") > 1 else None
    if cfg.parallel.data_parallel_mode == "fsdp":
        for chunk in chunks:
            shard_model(chunk, mesh)
        optimizer = FSDPOptimizer(chunks, cfg, device, mesh.group("data_context"), pipeline_group,
                                  skip)
        return optimizer, GradientSyncSwitch(chunks)
    named = named_trainable_parameters(chunks)
    tied = cfg.model.tie_embeddings and pipeline_group is not None
    alone = [i for i, (name, _) in enumerate(named) if name == TIED] if tied else []
    experts = expert_parameters(chunks, named) if mesh.size("expert") > 1 else []
    layout = data_parallel_layout([p.numel() for _, p in named], cfg.parallel.bucket_size,
                                  mesh.size(REDUCE_AXIS), alone, experts,
                                  mesh.size("expert_data"))
    groups = {"expert_data": mesh.group("expert_data")} if experts else {}
    sharded = cfg.parallel.distributed_optimizer
    if sharded:
        tp = chunks[0].tp
        weights, norm_group = None, tp.group if tp is not None else None
        if tp is not None or skip:
            weights = norm_weights(chunks, tp, named, layout.offsets, layout.total, skip)
        if pipeline_group is not None:  # the squares summed over the stages too
            norm_group = pipeline_group if tp is None else model_replica_group(mesh)
        optimizer = DistributedOptimizer(named, cfg.optimizer, precision, device, layout,
                                         mesh.group(REDUCE_AXIS), norm_group, weights, groups)
    else:
        optimizer = build_optimizer(chunks, cfg.optimizer, precision, device, grad_norm, layout)
    owner = {id(p): c for c, chunk in enumerate(chunks) for p in chunk.parameters()}
    chunk_of = [owner[id(p)] for p in optimizer.params]
    reducer = BucketReducer(optimizer.params, layout, optimizer.grad_buffer,
                            mesh.group(REDUCE_AXIS),
                            scatter=sharded, chunk_of=chunk_of, groups=groups)
    return optimizer, reducer


def expert_parameters(chunks: list[GPT], named: list[tuple[str, nn.Parameter]]) -> list[int]:
    """Indices into `named` of the expert-parallel experts' weights."""
    experts = set()
    for chunk in chunks:
        experts.update(parameter_shardings(chunk, "expert"))
    return [i for i, (name, _) in enumerate(named) if name in experts]


def run_all(calls: list[Callable[[], None]]) -> Callable[[], None] | None:
    """One callable running `calls` in order (None if there are none)."""
    if not calls:
        return None

    def run() -> None:
        for call in calls:
            call()

    return run
