"""A tensor-parallel rank's model read from a checkpoint without the rest of it.

`model_from_state` takes the whole model in every process and cuts each rank's slice from it:
under `torchrun` for a model larger than one GPU, every rank of a node then holds the whole
model in host memory at once. `model_from_checkpoint` builds this rank's shard on its device
(no random init, already in its dtype) and reads into it only the parts of the stored tensors
it holds (pieces.py describes them, as resuming a sharded checkpoint under another layout
does): from a sharded checkpoint through torch.distributed.checkpoint, from a gathered one as
slices of model.safetensors. The vocabulary tables' extra tensor-parallel padding rows, which no
checkpoint stores, are zero. The files' sha256 are checked first, the ranks sharing the work.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from trireme.checkpoint import directory
from trireme.checkpoint import format as fmt
from trireme.checkpoint.pieces import Entry
from trireme.checkpoint.sharded import (
    check_shapes,
    is_sharded,
    model_entries,
    read_pieces,
    stored_shapes,
    verify_digests,
    zero_vocab_tables,
)
from trireme.config import ModelConfig
from trireme.errors import CheckpointError
from trireme.models.gpt import GPT
from trireme.parallel.context import ParallelContext


def model_from_checkpoint(cfg: ModelConfig, path: Path, device: torch.device,
                          dtype: torch.dtype, ctx: ParallelContext) -> GPT:
    """This rank's shard of `GPT(cfg)` under `ctx`, in `dtype` on `device`, filled from the
    checkpoint directory `path` (a step directory; collective over the tensor group)."""
    group = ctx.group("tensor")
    world = dist.get_world_size(group)
    verify_digests(path, directory.check_complete(path), group, world, dist.get_rank(group))
    sharded = is_sharded(path)
    stored = stored_shapes(path) if sharded else safetensors_shapes(path)
    with torch.device("meta"):
        model = GPT(cfg, seed=None, ctx=ctx)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    rows = stored.get("model/embedding.weight", (cfg.padded_vocab_size,))[0]
    entries = model_entries([model], rows)  # the stored vocabulary rows: any padding beyond
    check_shapes(entries, stored, path, cfg)  # them (tensor parallelism's) stays zero
    with torch.no_grad():
        zero_vocab_tables([model])
        if sharded:
            read_pieces(path, entries)
        else:
            read_slices(path / directory.MODEL_FILE, entries)
    return model


def _names(f, path: Path) -> dict[str, str]:
    """Model name -> stored key (tied names share one stored tensor; format.py writes them)."""
    try:
        names = json.loads((f.metadata() or {}).get(fmt.NAMES_KEY, "{}"))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, dict):
        raise CheckpointError(f"{path}: its tensor name list is corrupted; load an earlier step")
    return names | {k: k for k in f.keys() if k not in names.values()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is truncated or corrupted ({e}); load an earlier step"
                              ) from None


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """"model/<name>" -> stored shape, of a gathered checkpoint's model.safetensors."""
    file = path / directory.MODEL_FILE
    with _open(file) as f:
        return {f"model/{name}": tuple(f.get_slice(key).get_shape())
                for name, key in _names(f, file).items()}


def read_slices(file: Path, entries: dict[str, Entry]) -> None:
    """Copy into each piece its block of the stored tensor, read as a slice of `file`."""
    with _open(file) as f:
        names = _names(f, file)
        for key, entry in entries.items():
            name = names[key[len("model/"):]]
            stored = f.get_slice(name)
            for piece in entry.pieces:
                if piece.data.dim() == 0:
                    piece.data.copy_(f.get_tensor(name))
                    continue
                block = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.data.shape))
                piece.data.copy_(stored[block])
