"""A run fitted to its GPU before anything is built: the planner's micro batch for
train.micro_batch_size = -1 (`fit_micro_batch`), the memory check `trireme train` runs
(`memory_check`), the rate table of the nearest known GPU, and the vocabulary size the planner
needs."""

from __future__ import annotations

import dataclasses

from trireme.config import Config
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import ConfigError
from trireme.plan.planner import best_micro_batch, make_plan, predict_given
from trireme.plan.rates import Rates, load_rates


def resolve_vocab_size(cfg: Config) -> Config:
    """model.vocab_size = 0 takes the tokenizer's size, as training does
    (trireme.training.build.resolve_data), where that is known without opening the data:
    data.tokenizer ('bytes', 'null:N' or a file: loaded), else the embedded corpus (no data.path,
    not mock, no vision: its tokenizer is trained to data.embedded_vocab_size ids). A copy of
    `cfg` with it (`cfg` itself when the size is set); otherwise a one-line error."""
    m, d = cfg.model, cfg.data
    if m.vocab_size:
        return cfg
    if d.tokenizer:
        size = load_tokenizer(d.tokenizer).vocab_size
    elif not d.path and not d.mock and not m.vision_layers:
        size = d.embedded_vocab_size
    else:
        raise ConfigError("model.vocab_size = 0: the planner needs the vocabulary size; set "
                          "--model.vocab_size or --data.tokenizer")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=size))


def memory_check(cfg: Config, world: int, device_gib: float, device_name: str) -> None:
    """Before `trireme train` allocates: a one-line ConfigError when the predicted peak per GPU
    exceeds `device_gib`, naming the planner's fastest layout that fits (train.skip_memory_check
    turns it off)."""
    rates = device_rates(device_name, device_gib)
    given = predict_given(cfg, world, rates)
    if given.error or given.fits:
        return
    plan = make_plan(cfg, world, min(world, 8), rates)
    alt = ("no layout of this config fits; use more GPUs or a smaller micro batch"
           if not plan.candidates else
           "the planner's best that fits: " + " ".join(plan.candidates[0].layout.overrides())
           + f" ({plan.candidates[0].memory_gib:.1f} GiB)")
    raise ConfigError(
        f"this run needs about {given.memory_gib:.1f} GiB per GPU (predicted by trireme plan) "
        f"but the {device_name} has {device_gib:.1f} GiB; {alt}; or set "
        "--train.skip_memory_check=true")


def fit_micro_batch(cfg: Config, world: int, device_gib: float, device_name: str
                    ) -> tuple[Config, str] | None:
    """train.micro_batch_size = -1 (auto): a copy of `cfg` with the planner's choice for this
    GPU (planner.best_micro_batch) and the log line that says so, or None when nothing fits
    (resolve_layout's fallback then applies and the memory check speaks)."""
    choice = best_micro_batch(cfg, world, device_rates(device_name, device_gib))
    if choice is None:
        return None
    size = choice.layout.micro_batch_size
    fitted = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=size))
    return fitted, (f"trireme: train.micro_batch_size = {size} (auto: predicted "
                    f"{choice.memory_gib:.0f} GiB of {device_gib:.0f} and "
                    f"{choice.tokens_per_s:,.0f} tokens/s by trireme plan; set it to choose)")


def device_rates(device_name: str, device_gib: float) -> Rates:
    """The rate table of the nearest known GPU, with this device's memory."""
    rates = load_rates(_rates_name(device_name))
    return Rates(**{**rates.__dict__, "memory_gib": device_gib})


def _rates_name(device_name: str) -> str:
    name = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return key
    return "h100"
