"""Parameter initialization as a function of (seed, parameter name) only.

Each tensor is drawn from its own generator, seeded from sha256(f"{seed}:{name}"), in fp32, then
copied into the parameter (any device, any dtype). Nothing depends on construction order, on
the number of layers (beyond the scaled-init factor), on the vocabulary padding or on a parallel
layout, so a sharded model can draw the full tensor for a name and keep its slice, and start
bit-identical to the single-process model.

The rule for a parameter comes from its role, which the module holding it declares in
`init_rules()` (short name -> `InitRule`), never from its name:
- weights: Normal(0, init_std); a residual branch's output projection (attention's `out`, the
  MLP's `fc2`) uses init_std / sqrt(2 * num_layers) when cfg.scaled_init (GPT-2).
- norms (any module that `is_norm`): weight 1 (and bias 0); all biases 0.
- vocabulary tables (embedding, untied output layer): exactly vocab_size rows drawn, padded rows 0.
- fused weights draw their parts as separate tensors named `<name>/<part>`: attention's
  `qkv.weight/q`, `/k`, `/v`, SwiGLU's `fc1.weight/gate`, `/up`.
- a parameter with its own distribution (Mamba-2's A_log, dt_bias, D, convolution) names a
  `draw(seed, name, shape, device)` function in its rule, also a function of (seed, name) only.

A tensor-parallel parameter (one with a Sharding, trireme.parallel.sharding) is drawn whole and the
rank keeps its slice: the same numbers as the single-process model's, whatever the degree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trireme.config import ModelConfig
from trireme.parallel.random import name_seed
from trireme.parallel.sharding import parameter_shardings


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


@dataclass(frozen=True)
class InitRule:
    """How one weight is drawn (module docstring); the default is a plain Normal(0, init_std)."""

    residual_output: bool = False  # std / sqrt(2 * num_layers) under cfg.scaled_init
    parts: tuple[tuple[str, int], ...] = ()  # a fused weight: (part name, full rows) in order
    vocab_rows: int = 0  # a vocabulary table: draw this many rows, the padding stays 0
    # its own distribution: draw(seed, name, full shape, device) -> fp32 tensor
    draw: Callable[[int, str, tuple[int, ...], torch.device], torch.Tensor] | None = None


def declared_rules(model: nn.Module) -> dict[str, InitRule]:
    """name -> InitRule of every parameter whose module declares one in `init_rules()`."""
    out = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "init_rules"):
            for short_name, rule in module.init_rules().items():
                out[f"{module_name}.{short_name}" if module_name else short_name] = rule
    return out


def _weight_value(
    cfg: ModelConfig, rule: InitRule, seed: int, name: str, shape: tuple[int, ...],
    dev: torch.device,
) -> torch.Tensor:
    """The fp32 initial value of the full (unsharded) `shape` weight called `name`."""
    if rule.draw is not None:
        return rule.draw(seed, name, shape, dev)
    std = cfg.init_std
    if rule.residual_output and cfg.scaled_init:
        std = std / math.sqrt(2 * cfg.num_layers)
    if rule.vocab_rows:
        value = torch.zeros(shape, device=dev)  # padded rows stay 0
        value[: rule.vocab_rows] = draw_normal(seed, name, (rule.vocab_rows, shape[1]), std, dev)
        return value
    if not rule.parts:
        return draw_normal(seed, name, shape, std, dev)
    return torch.cat([draw_normal(seed, f"{name}/{part}", (rows, shape[1]), std, dev)
                      for part, rows in rule.parts])


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """Initialize every parameter of `model` (whose config is `model.cfg`) from (seed, its name)
    by the rule of its role; see the module docstring."""
    cfg: ModelConfig = model.cfg
    shardings = parameter_shardings(model)
    rules = declared_rules(model)
    for module_name, module in model.named_modules():
        is_norm = getattr(module, "is_norm", False) or isinstance(module, (nn.LayerNorm,
                                                                            nn.RMSNorm))
        for short_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{short_name}" if module_name else short_name
            rule = rules.get(name, InitRule())
            if short_name == "bias" and rule.draw is None:
                param.zero_()
            elif is_norm and rule.draw is None:
                param.fill_(1.0)
            elif name in shardings:  # tensor parallel: draw the full tensor, keep this rank's slice
                sharding = shardings[name]
                full_shape = sharding.full_shape(param.shape)
                param.copy_(sharding.shard(
                    _weight_value(cfg, rule, seed, name, full_shape, param.device)))
            else:
                param.copy_(_weight_value(cfg, rule, seed, name, tuple(param.shape),
                                          param.device))
        if hasattr(module, "reset_buffers"):  # state that is not a parameter (e.g. MoE's bias)
            module.reset_buffers()
