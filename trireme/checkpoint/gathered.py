"""Checkpoints of a tensor-, expert- and pipeline-parallel model in the single-process form.

Saving gathers every sharded tensor (model weights and the optimizer's per-parameter state) into
the full tensor under its global name (expert-parallel experts gathered over the expert group),
and global rank 0 writes the usual checkpoint. The
vocabulary tables are stored with the single-process padding (make_vocab_size_divisible_by), so
the checkpoint does not depend on the tensor-parallel degree: loading resizes the tables to this
model's padding (the padded rows are zero) and keeps this rank's slice. A checkpoint written at
any degree therefore resumes at any degree, and `trireme generate` reads it in one process.

Under pipeline parallelism `model` is the list of this rank's model chunks (stages); their names
are already the global ones, and `gather_stages` collects every stage's tensors on the first stage
(a tied embedding's last-stage copy is the same tensor as the first stage's, kept once). Loading
gives each chunk the names it holds, so a checkpoint loads under any pipeline layout too.

This gathers the whole model through one rank (`checkpoint.format = "gathered"`); the sharded
format (trireme/checkpoint/sharded.py) reuses the same Sharding description to let every rank
write its own pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trireme.parallel.sharding import gather_full, parameter_shardings, shard_full
from trireme.parallel.tensor import TensorParallel

VOCAB_TABLES = ("embedding.weight", "output.weight")
OPTIMIZER_TENSORS = ("exp_avg", "exp_avg_sq", "master")  # name -> tensor dicts in its state


def fit_vocab_rows(tensors: dict[str, Tensor], rows: int) -> dict[str, Tensor]:
    """The vocabulary tables cut or zero-padded to `rows` rows; padded rows hold zeros (no
    gradient ever reaches them), so this changes no number of the model."""
    out = dict(tensors)
    for name in VOCAB_TABLES:
        t = out.get(name)
        if t is None or t.shape[0] == rows:
            continue
        if t.shape[0] > rows:
            out[name] = t[:rows]
        else:
            out[name] = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
    return out


Model = nn.Module | Sequence[nn.Module]  # a model, or a pipeline rank's model chunks


def _modules(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _tp(model: Model) -> TensorParallel | None:
    return getattr(_modules(model)[0], "tp", None)


def _shardings(model: Model) -> dict:
    out = {}
    for module in _modules(model):
        out.update(parameter_shardings(module))
    return out


def gather_stages(tensors: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every pipeline stage's `tensors` merged on pipeline rank 0 of `group` (on CPU); {} on the
    other ranks. Collective over the pipeline group."""
    if group is None:
        return tensors
    first = dist.get_global_rank(group, 0)
    mine = {n: t.detach().cpu() if isinstance(t, Tensor) else t for n, t in tensors.items()}
    stages = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(mine, stages, dst=first, group=group)
    merged: dict[str, Any] = {}
    for stage in stages or []:
        for name, value in stage.items():
            merged.setdefault(name, value)  # the tied embedding: the first stage's copy
    return merged


def _groups(model: Model) -> dict[str, dist.ProcessGroup | None]:
    """The group of each sharding axis: tensor, and expert (expert-parallel experts)."""
    tp = _tp(model)
    ctx = getattr(_modules(model)[0], "ctx", None)
    return {"tensor": tp.group if tp is not None else None,
            "expert": ctx.group("expert") if ctx is not None else None}


def full_tensors(tensors: dict[str, Tensor], model: Model, rows: int) -> dict[str, Tensor]:
    """Gathered full tensors (collective under TP and EP), vocabulary tables at `rows` rows."""
    shardings = _shardings(model)
    if shardings:
        tensors = gather_full(tensors, shardings, _groups(model))
    return fit_vocab_rows(tensors, rows)


def local_tensors(tensors: dict[str, Tensor], model: Model) -> dict[str, Tensor]:
    """This rank's slices of full tensors, vocabulary tables resized to the model's padding."""
    tensors = fit_vocab_rows(tensors, _modules(model)[0].padded_vocab_size)
    shardings = _shardings(model)
    return shard_full(tensors, shardings) if shardings else tensors


def full_optimizer_state(
    state: dict[str, Any], model: Model, rows: int, pipeline: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """The optimizer state gathered over TP (and, given `pipeline`, the stages)."""
    return {k: gather_stages(full_tensors(v, model, rows), pipeline)
            if k in OPTIMIZER_TENSORS else v for k, v in state.items()}


def local_optimizer_state(state: dict[str, Any], model: Model) -> dict[str, Any]:
    return {k: local_tensors(v, model) if k in OPTIMIZER_TENSORS and v else v
            for k, v in state.items()}


def gather_rng_states(model: nn.Module) -> dict[str, Tensor]:
    """Every TP rank's dropout stream state, keyed by TP rank (empty without TP)."""
    tp = _tp(model)
    if tp is None:
        return {}
    device = tp.rng.device
    mine = tp.rng.state.to(device)
    states = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(states, mine, group=tp.group)
    return {str(r): s.cpu() for r, s in enumerate(states)}


def restore_rng_states(model: nn.Module, states: dict[str, Tensor]) -> bool:
    """Restore this rank's dropout stream if the checkpoint has one per rank of this degree;
    False (the stream stays freshly seeded) when it was saved at another degree."""
    tp = _tp(model)
    if tp is None or len(states) != tp.size:
        return False
    tp.rng.state = states[str(tp.rank)].to(device="cpu", dtype=torch.uint8)
    return True
