"""Checkpoints of a tensor-parallel model in the single-process form.

Saving gathers every sharded tensor (model weights and the optimizer's per-parameter state) into
the full tensor under its global name, and global rank 0 writes the usual checkpoint. The
vocabulary tables are stored with the single-process padding (make_vocab_size_divisible_by), so
the checkpoint does not depend on the tensor-parallel degree: loading resizes the tables to this
model's padding (the padded rows are zero) and keeps this rank's slice. A checkpoint written at
any degree therefore resumes at any degree, and `trireme generate` reads it in one process.

This gathers the whole model through every rank, fine for now; sharded checkpoints come later.
"""

from __future__ import annotations

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


def _tp(model: nn.Module) -> TensorParallel | None:
    return getattr(model, "tp", None)


def full_tensors(tensors: dict[str, Tensor], model: nn.Module, rows: int) -> dict[str, Tensor]:
    """Gathered full tensors (collective under TP), vocabulary tables at `rows` rows."""
    tp = _tp(model)
    if tp is not None:
        tensors = gather_full(tensors, parameter_shardings(model), tp.group)
    return fit_vocab_rows(tensors, rows)


def local_tensors(tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """This rank's slices of full tensors, vocabulary tables resized to the model's padding."""
    tensors = fit_vocab_rows(tensors, model.padded_vocab_size)
    if _tp(model) is None:
        return tensors
    return shard_full(tensors, parameter_shardings(model))


def full_optimizer_state(state: dict[str, Any], model: nn.Module, rows: int) -> dict[str, Any]:
    return {k: full_tensors(v, model, rows) if k in OPTIMIZER_TENSORS else v
            for k, v in state.items()}


def local_optimizer_state(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
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
