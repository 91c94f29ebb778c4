"""A tensor table: how each trireme tensor is made of Hugging Face tensors, run both ways.

One `Entry` per trireme tensor names the Hugging Face tensors it is made of and how:
  copy     the same matrix
  cat      rows concatenated: q/k/v -> our fused qkv ([all q; all k; all v], head-major on both
           sides), gate/up -> our SwiGLU fc1 ([gate; up])
  conv1d   transposed: GPT-2's Conv1D stores [in, out], nn.Linear [out, in]
  vocab    embedding rows: ours are padded to padded_vocab_size with zero rows, theirs are not
  patch    a vision patch embedding: their conv weight [w, 3, p, p] is our linear's [w, 3 p p]
  experts  one [E, in, out] tensor from E groups of nn.Linear weights, `sizes` rows each:
           ours[e] = cat(group e)^T, so x @ ours[e] = [x W_1^T | x W_2^T ...] (fc1: the groups
           are (gate, up), fc2: (down,))
Reading runs the table forwards (`to_ours`), writing backwards (`export_state`), so the two
directions cannot drift apart. The tables themselves are the families' (convert_hf.py, hf_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trireme.checkpoint.model_state import expected_shapes, listing
from trireme.config import ModelConfig
from trireme.errors import CheckpointError
from trireme.models.block import SUBLAYERS


@dataclass(frozen=True)
class Entry:
    """One trireme tensor and the Hugging Face tensors it is made of."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"  # copy | cat | conv1d | vocab | experts | patch
    sizes: tuple[int, ...] = ()  # cat: rows of each part; experts: rows of each part of a group


def part_sizes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Rows of each part of our fused weights, by tensor name within the sublayer: the
    attention's qkv (q, k, v) and SwiGLU's fc1 (gate, up)."""
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    return {"qkv.weight": (q, kv, kv), "fc1.weight": (cfg.ffn_size, cfg.ffn_size)}


def sublayer_entries(cfg: ModelConfig, kind: str, ours: str, theirs: str) -> list[Entry]:
    """The rows of one sublayer's weights under the names its class declares (`hf_names`,
    trireme.models.sublayer): `ours` and `theirs` are the two prefixes, e.g. "layers.3.mlp."
    and "model.layers.3.mlp."; a weight of several Hugging Face tensors is their rows stacked."""
    sizes = part_sizes(cfg)
    rows = []
    for mine, parts in SUBLAYERS[kind].hf_names(cfg).items():
        names = tuple(theirs + part for part in parts)
        rows.append(Entry(ours + mine, names, "cat", sizes[mine]) if len(parts) > 1
                    else Entry(ours + mine, names))
    return rows


def with_biases(rows: list[Entry]) -> list[Entry]:
    """The bias rows of weight rows: the same names with `.bias` for `.weight`."""
    return [Entry(_bias(e.ours), tuple(_bias(n) for n in e.theirs), e.kind, e.sizes)
            for e in rows]


def _bias(name: str) -> str:
    return name.removesuffix(".weight") + ".bias"


def to_ours(entry: Entry, parts: list[Tensor], cfg: ModelConfig) -> Tensor:
    """The trireme tensor of `entry` from its Hugging Face parts."""
    if entry.kind == "cat":
        return torch.cat(parts)
    if entry.kind == "conv1d":
        return parts[0].t()
    if entry.kind == "patch":
        return parts[0].reshape(parts[0].shape[0], -1)
    if entry.kind == "experts":
        n = len(entry.sizes)
        return torch.stack([torch.cat(parts[i : i + n]).t() for i in range(0, len(parts), n)])
    if entry.kind == "vocab":
        w = parts[0]
        padded = w.new_zeros((cfg.padded_vocab_size, *w.shape[1:]))
        padded[: w.shape[0]] = w
        return padded
    return parts[0]


def _to_theirs(entry: Entry, t: Tensor, cfg: ModelConfig) -> list[Tensor]:
    if entry.kind == "cat":
        return list(t.split(list(entry.sizes)))
    if entry.kind == "conv1d":
        return [t.t()]
    if entry.kind == "patch":
        return [t.reshape(t.shape[0], 3, cfg.vision_patch_size, cfg.vision_patch_size)]
    if entry.kind == "experts":
        return [part for expert in t for part in expert.t().split(list(entry.sizes))]
    if entry.kind == "vocab":
        return [t[: cfg.vocab_size]]
    return [t]


def export_state(
    table: list[Entry], state: dict[str, Tensor], cfg: ModelConfig
) -> dict[str, Tensor]:
    """trireme state -> Hugging Face state. A tensor the table lacks must be all zeros (a bias
    the architecture does not have, an unused expert bias); one the state lacks is written as
    zeros (GPT-2's biases)."""
    out: dict[str, Tensor] = {}
    dtype = weight_dtype(state)
    for entry in table:
        t = state.get(entry.ours)
        if t is None:
            t = torch.zeros(bias_shape(entry.ours, cfg), dtype=dtype)
        out.update(zip(entry.theirs, _to_theirs(entry, t, cfg)))
    covered = {entry.ours for entry in table}
    dropped = [n for n, t in state.items() if n not in covered and bool(t.any())]
    if dropped:
        raise CheckpointError(
            listing("the chosen Hugging Face architecture has no place for", dropped)
        )
    return out


def their_shapes(table: list[Entry], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor the table names, for a model of config `cfg`."""
    ours = expected_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for entry in table:
        shape = ours.get(entry.ours) or bias_shape(entry.ours, cfg)
        if entry.kind == "cat":
            out.update((n, (size, *shape[1:])) for n, size in zip(entry.theirs, entry.sizes))
        elif entry.kind == "experts":  # ours [E, in, out]: each part [rows, in]
            sizes = entry.sizes * shape[0]
            out.update((n, (size, shape[1])) for n, size in zip(entry.theirs, sizes))
        elif entry.kind == "conv1d":
            out[entry.theirs[0]] = tuple(reversed(shape))
        elif entry.kind == "patch":
            out[entry.theirs[0]] = (shape[0], 3, cfg.vision_patch_size, cfg.vision_patch_size)
        elif entry.kind == "vocab":
            out[entry.theirs[0]] = (cfg.vocab_size, *shape[1:])
        else:
            out[entry.theirs[0]] = shape
    return out


def bias_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape of a bias trireme's model may lack (its config has no `bias`)."""
    if "attention.qkv" in name:
        return ((cfg.num_attention_heads + 2 * cfg.kv_heads) * cfg.head_size,)
    if "mlp.fc1" in name:
        return ((2 if cfg.activation == "swiglu" else 1) * cfg.ffn_size,)
    return (cfg.hidden_size,)


def weight_dtype(state: dict[str, Tensor]) -> torch.dtype:
    return next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
