"""The planner: predict the given layout, enumerate the others, rank those that fit.

    plan = make_plan(cfg, gpus=8, per_node=8, rates=load_rates("h200"))
    plan.given          the config as given (a Prediction; `error` set if the trainer refuses it)
    plan.candidates     every valid layout that fits, fastest first (predicted tokens/s)
    plan.smallest       the valid layout predicted to need the least memory, fitting or not
                        (None when no layout is valid): what to report when nothing fits

A layout fits when its predicted peak (allocator overhead included) plus the CUDA context is
within the device's memory (`fits`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trireme.config import Config
from trireme.errors import ConfigError
from trireme.parallel.layout import Layout
from trireme.plan.enumerate import Choice, resolve, valid_layouts
from trireme.plan.memory import GIB, estimate_memory, rank_params
from trireme.plan.rates import Rates
from trireme.plan.time import estimate_time


@dataclass
class Prediction:
    layout: Choice  # the settings predicted
    memory_gib: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    fits: bool = False
    memory_parts: dict[str, float] = field(default_factory=dict)
    time_parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def reason(self) -> str:
        """One line: where the memory and the time go."""
        if self.error:
            return self.error
        mem = sorted(self.memory_parts.items(), key=lambda kv: -kv[1])[:2]
        tim = sorted(self.time_parts.items(), key=lambda kv: -kv[1])[:3]
        m = ", ".join(f"{k} {v:.1f}" for k, v in mem)
        t = ", ".join(f"{k} {100 * v / self.step_s:.0f}%" for k, v in tim)
        return f"GiB: {m}; time: {t}"

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "overrides": self.layout.overrides(),
                "memory_gib": round(self.memory_gib, 3), "step_s": round(self.step_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 1), "mfu": round(self.mfu, 4),
                "fits": self.fits, "reason": self.reason(), "error": self.error,
                "memory_parts_gib": {k: round(v, 3) for k, v in self.memory_parts.items()},
                "time_parts_s": {k: round(v, 4) for k, v in self.time_parts.items()}}


@dataclass
class Plan:
    given: Prediction
    candidates: list[Prediction]
    considered: int
    smallest: Prediction | None = None


def predict(cfg: Config, layout: Layout, rates: Rates, per_node: int = 8) -> Prediction:
    """Memory and time of `cfg` in its layout (`resolve`'s: a validated config, its micro batch
    resolved)."""
    mem = estimate_memory(cfg, layout, rates)
    params = max(rank_params(cfg, layout, r).total for r in range(layout.pipeline))
    t = estimate_time(cfg, layout, rates, per_node, params)
    gib = mem.total / GIB
    return Prediction(Choice.of(cfg), gib, t.step_s, t.tokens_per_s, t.mfu,
                      gib + rates.context_gib <= rates.memory_gib,
                      {k: v / GIB for k, v in mem.parts.items()}, t.parts)


def predict_given(cfg: Config, world: int, rates: Rates, per_node: int = 8) -> Prediction:
    """The prediction of the config as given, or its one-line error if the trainer refuses it."""
    try:
        resolved, layout = resolve(cfg, world)
    except ConfigError as e:
        return Prediction(Choice.of(cfg), error=str(e))
    return predict(resolved, layout, rates, per_node)


def make_plan(cfg: Config, gpus: int, per_node: int, rates: Rates) -> Plan:
    """The given config's prediction and every fitting layout, fastest first."""
    given = predict_given(cfg, gpus, rates, per_node)
    fitting, considered, smallest = [], 0, None
    for _choice, laid, layout in valid_layouts(cfg, gpus, per_node):
        considered += 1
        pred = predict(laid, layout, rates, per_node)
        if pred.fits:
            fitting.append(pred)
        if smallest is None or pred.memory_gib < smallest.memory_gib:
            smallest = pred
    fitting.sort(key=lambda p: (-p.tokens_per_s, p.memory_gib))
    return Plan(given, fitting, considered, smallest)


def best_micro_batch(cfg: Config, world: int, rates: Rates, fraction: float = 0.85,
                     limit: int = 16, per_node: int = 8) -> Prediction | None:
    """train.micro_batch_size = -1 (auto) on a GPU: of the micro batches that divide the global
    batch per data-parallel replica (at most `limit`), those predicted to fit in `fraction` of
    the device's memory; the fastest predicted, or the smallest within 1% of it (the same speed
    for less memory). None when none fits or the trainer refuses the layout."""
    par = cfg.parallel
    per_replica, data = 0, world // (par.pipeline * par.context * par.tensor)
    if data and cfg.train.global_batch_size % data == 0:
        per_replica = cfg.train.global_batch_size // data
    fitting = []
    for size in (n for n in range(1, min(per_replica, limit) + 1) if per_replica % n == 0):
        sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                   micro_batch_size=size))
        pred = predict_given(sized, world, rates, per_node)
        room = fraction * rates.memory_gib - rates.context_gib
        if pred.error is None and pred.memory_gib <= room:
            fitting.append(pred)
    if not fitting:
        return None
    best = max(p.tokens_per_s for p in fitting)
    return min((p for p in fitting if p.tokens_per_s >= 0.99 * best),
               key=lambda p: p.layout.micro_batch_size)
