"""Parameter initialization as a function of (seed, parameter name) only.

Each tensor is drawn from its own CPU generator, seeded from sha256(f"{seed}:{name}"), in fp32, then
copied into the parameter (any device, any dtype). Nothing depends on construction order, on
the number of layers (beyond the scaled-init factor), on the vocabulary padding or on a parallel
layout, so a sharded model can draw the full tensor for a name and keep its slice, and start
bit-identical to the single-process model.

- weights: Normal(0, init_std); the residual output projections (`attention.out`, `mlp.fc2`) use
  init_std / sqrt(2 * num_layers) when cfg.scaled_init (GPT-2).
- norms: weight 1 (and bias 0); all biases 0.
- embedding and untied output layer: exactly vocab_size rows drawn, padded rows 0.
- fused weights draw their parts as separate tensors: `...qkv.weight/q`, `/k`, `/v`, and SwiGLU's
  `...fc1.weight/gate`, `/up`.

A tensor-parallel parameter (one with a Sharding, trireme.parallel.sharding) is drawn whole and the
rank keeps its slice: the same numbers as the single-process model's, whatever the degree.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from trireme.ops.norms import LayerNorm, RMSNorm
from trireme.parallel.random import name_seed
from trireme.parallel.sharding import parameter_shardings

if TYPE_CHECKING:
    from trireme.models.gpt import GPT


def draw_normal(
    seed: int,
    name: str,
    shape: tuple[int, ...] | torch.Size,
    std: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Normal(0, std) of `shape` in fp32, a function of (seed, name, shape, device type) only.

    Drawing on the parameter's own device keeps building a large model on a GPU fast; CPU and
    CUDA generators give different (each reproducible) numbers.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    out = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    return out.normal_(0.0, std, generator=generator)


def _weight_value(
    model: GPT, seed: int, name: str, shape: tuple[int, ...], dev: torch.device
) -> torch.Tensor:
    """The fp32 initial value of the full (unsharded) `shape` weight called `name`, which is
    neither a norm nor a bias."""
    cfg = model.cfg
    std = cfg.init_std
    if name.endswith(("attention.out.weight", "mlp.fc2.weight")) and cfg.scaled_init:
        std = std / math.sqrt(2 * cfg.num_layers)
    if name in ("embedding.weight", "output.weight"):
        value = torch.zeros(shape, device=dev)  # padded rows stay 0
        value[: cfg.vocab_size] = draw_normal(seed, name, (cfg.vocab_size, shape[1]), std, dev)
        return value
    if name.endswith("attention.qkv.weight"):
        q_rows = cfg.num_attention_heads * cfg.head_size
        kv_rows = cfg.kv_heads * cfg.head_size
        parts = [("q", q_rows), ("k", kv_rows), ("v", kv_rows)]
    elif name.endswith("mlp.fc1.weight") and cfg.activation == "swiglu":
        parts = [("gate", cfg.ffn_size), ("up", cfg.ffn_size)]
    else:
        return draw_normal(seed, name, shape, std, dev)
    return torch.cat(
        [draw_normal(seed, f"{name}/{part}", (rows, shape[1]), std, dev) for part, rows in parts]
    )


@torch.no_grad()
def init_parameters(model: GPT, seed: int) -> None:
    """Initialize every parameter of `model` from (seed, its name); see the module docstring."""
    shardings = parameter_shardings(model)
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, (RMSNorm, LayerNorm, nn.LayerNorm, nn.RMSNorm))
        for short_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{short_name}" if module_name else short_name
            dev = param.device
            if short_name == "bias":
                param.zero_()
            elif is_norm:
                param.fill_(1.0)
            elif name in shardings:  # tensor parallel: draw the full tensor, keep this rank's slice
                sharding = shardings[name]
                full = _weight_value(model, seed, name, sharding.full_shape(param.shape), dev)
                param.copy_(sharding.shard(full))
            else:
                param.copy_(_weight_value(model, seed, name, tuple(param.shape), dev))
