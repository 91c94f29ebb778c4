"""Tensor-parallel inference under torchrun: `trireme generate` on several GPUs of one node.

    torchrun --nproc_per_node 2 -m trireme generate --checkpoint C --input p.jsonl --output o.jsonl

Every process is one tensor-parallel rank: it holds its share of the heads, the MLP features and
the vocabulary rows (the training layers, trireme.parallel.tensor), and its KV cache holds only
its own key / value heads. Sequence parallelism stays off: a decode step has one token per
request, which cannot be split along the sequence.

What keeps the ranks in step, so that their collectives meet:
- each rank reads the whole checkpoint (stored in the single-process form) and keeps its slice;
  a non-finite weight on any rank stops every rank (`any_rank`);
- the logits are all-gathered: the same tensor on every rank;
- the serving engine's scheduler is a function of its requests and its pool: the pool gets the
  smallest block count any rank can hold (`agreed_min`), and the requests come in the same
  order on every rank (each reads the same input file);
- the sampled ids go out from rank 0 at every step (the engine's, whose group is its model's
  tensor group, and `generate`'s), and one-prompt generation agrees on its seed first
  (`agreed_seed`), so no rank's tokens can differ;
- only rank 0 prints or writes the output file.
The engine runs its plain path there (no CUDA graphs, no compiled pieces, no split-K kernels:
they are not built for the row-parallel layers' all-reduce). `trireme serve` under torchrun keeps
the ranks' engines in step by sending rank 0's requests to all (trireme.serving.replicated).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from trireme.config import ModelConfig
from trireme.parallel.context import ParallelContext, build_parallel_context
from trireme.parallel.mesh import DistributedEnv, ParallelDims, ParallelMesh


def start_ranks(env: DistributedEnv, cfg: ModelConfig, device: torch.device) -> ParallelContext:
    """This rank's tensor-parallel context over all ranks of `env` (init_distributed's: on CUDA
    each rank has GPU LOCAL_RANK, `device`); collective; a one-line ConfigError if the model's
    heads, groups or features do not divide among them."""
    mesh = ParallelMesh.build(ParallelDims(tensor=env.world_size), device.type)
    return build_parallel_context(mesh, cfg, False, 0, device)


def rank_device(env: DistributedEnv, device: torch.device) -> torch.device:
    """This rank's device: GPU LOCAL_RANK on CUDA, the CPU otherwise."""
    return torch.device("cuda", env.local_rank) if device.type == "cuda" else device


def _reduce(value: float, op: dist.ReduceOp, group: dist.ProcessGroup, device: torch.device
            ) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def agreed_min(value: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The smallest `value` over the group's ranks (`value` itself without a group)."""
    if group is None:
        return value
    return int(_reduce(value, dist.ReduceOp.MIN, group, device))


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether `flag` holds on some rank of the group (`flag` itself without a group)."""
    if group is None:
        return flag
    return _reduce(float(flag), dist.ReduceOp.MAX, group, device) > 0


def agreed_seed(seed: int | None, group: dist.ProcessGroup | None, device: torch.device
                ) -> int | None:
    """`seed`, or with a group and no seed, one seed drawn by the group's first rank and shared."""
    if group is None or seed is not None:
        return seed
    t = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.long, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return int(t.item())
