"""`trireme plan`: the layouts of a config on a cluster, ranked by predicted speed.

    trireme plan --config llama3-8b --gpus 8 [--gpus-per-node 8] [--gpu h200] [--top 5] [--json]
    trireme plan --calibrate [--out rates.json]      measure this device's rate table

The fit of a run to its GPU (the micro batch, the memory check) is trireme.plan.fit's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from trireme.config import load_config
from trireme.errors import ConfigError
from trireme.plan.calibrate import calibrate
from trireme.plan.fit import resolve_vocab_size
from trireme.plan.planner import Plan, Prediction, make_plan
from trireme.plan.rates import Rates, load_rates


def _row(i: str, p: Prediction) -> str:
    lay = p.layout
    par = f"TP{lay.tensor}" + ("/noSP" if lay.tensor > 1 and not lay.sequence_parallel else "")
    par += f" PP{lay.pipeline}" + (f"x{lay.virtual_pipeline}" if lay.virtual_pipeline > 1 else "")
    par += f" CP{lay.context}" + (f"/{lay.context_mode}" if lay.context > 1 else "")
    par += f" EP{lay.expert} {lay.dp_mode}"
    return (f"{i:>5} {par:<34} {lay.recompute:<9} {lay.micro_batch_size:>3} "
            f"{p.memory_gib:>8.1f} {p.tokens_per_s:>11,.0f} {100 * p.mfu:>5.1f}%  {p.reason()}")


def format_plan(plan: Plan, top: int, gpus: int, rates: Rates, per_node: int = 8) -> str:
    head = (f"{'':>5} {'layout':<34} {'recompute':<9} {'mb':>3} {'GiB/GPU':>8} "
            f"{'tokens/s':>11} {'MFU':>6}  why")
    lines = [f"trireme plan: {gpus} x {rates.name} ({rates.memory_gib:.0f} GiB each); "
             f"{plan.considered} valid layouts, {len(plan.candidates)} fit", head]
    g = plan.given
    lines.append(f"given {g.error}" if g.error else _row("given", g) +
                 ("" if g.fits else "  (does not fit)"))
    for i, p in enumerate(plan.candidates[:top], 1):
        lines.append(_row(str(i), p))
    if not plan.candidates:
        lines += _nothing_fits(plan, gpus, rates, per_node)
    return "\n".join(lines)


def _nothing_fits(plan: Plan, gpus: int, rates: Rates, per_node: int) -> list[str]:
    """When no layout fits: the least-memory layout the planner found (a row) and one line of
    what to change, from what was already predicted."""
    s = plan.smallest
    if s is None:
        return [f"no layout of this config is valid on {gpus} GPUs (the trainer refuses every "
                "one; the given line says why for the config as given)"]
    room = rates.memory_gib - rates.context_gib
    tried = ("it already recomputes every layer (full) at micro batch 1"
             if s.layout.recompute == "full" and s.layout.micro_batch_size == 1 else
             "recompute none / selective / full and micro batches down to 1 were all tried")
    # Memory per GPU falls at most in proportion to the GPUs (activations and replicated state
    # do not shard): a lower bound, rounded up to whole nodes.
    need = math.ceil(gpus * s.memory_gib / room)
    if need > per_node:
        need = math.ceil(need / per_node) * per_node
    largest = max(s.memory_parts.items(), key=lambda kv: kv[1])[0] if s.memory_parts else ""
    other = ("; or a shorter sequence (--model.seq_length)" if largest == "activations" else
             "; or a smaller model")
    return [_row("least", s) + "  (does not fit)",
            f"nothing fits: the least memory of the {plan.considered} valid layouts is "
            f"{s.memory_gib:.1f} GiB/GPU (above) against {room:.1f} GiB per {rates.name} "
            f"({rates.memory_gib:.1f} less {rates.context_gib:.1f} for the CUDA context); "
            f"{tried}, so: more GPUs (at least about {need} if memory per GPU fell in "
            f"proportion){other}"]


def plan_json(plan: Plan, top: int) -> dict:
    return {"given": plan.given.to_dict(),
            "candidates": [p.to_dict() for p in plan.candidates[:top]],
            "considered": plan.considered,
            "smallest": plan.smallest.to_dict() if plan.smallest is not None else None}


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trireme plan", description=(
        "Predict memory and speed of the parallel layouts of a config, best first."))
    parser.add_argument("--config", default="tiny", help="preset name or a .toml path")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs in the run")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h200", help="h200, h100, a100, cpu or a rates .json")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this device's rate table and write it (--out)")
    parser.add_argument("--out", default="rates.json", help="--calibrate: the file to write")
    args, rest = parser.parse_known_args(argv)
    overrides = _overrides(rest)
    if args.calibrate:
        rates = calibrate(args.out)
        print(rates.to_json(), end="")
        print(f"trireme plan: wrote {args.out}; use it with --gpu {args.out}", file=sys.stderr)
        return 0
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--gpus = {args.gpus} and --gpus-per-node = {args.gpus_per_node} "
                          "must be at least 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        # torchrun starts the same number of processes on every node, and the planner places
        # ranks node by node (a group within --gpus-per-node ranks is priced at NVLink speed)
        raise ConfigError(f"--gpus = {args.gpus} is not a whole number of nodes of "
                          f"--gpus-per-node = {args.gpus_per_node}")
    if args.top < 1:
        raise ConfigError(f"--top = {args.top}: the number of layouts to show must be at least 1")
    cfg = load_config(args.config, overrides)
    cfg = resolve_vocab_size(cfg)
    rates = load_rates(args.gpu)
    plan = make_plan(cfg, args.gpus, args.gpus_per_node, rates)
    if args.json:
        print(json.dumps(plan_json(plan, args.top), indent=2))
    else:
        print(format_plan(plan, args.top, args.gpus, rates, args.gpus_per_node))
    return 0


def _overrides(rest: list[str]) -> list[str]:
    """`--section.key=value` (or `--section.key value`) arguments; anything else is an error."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not (arg.startswith("--") and "." in arg.split("=", 1)[0]):
            raise ConfigError(f"trireme plan: unknown argument {arg!r}; config keys are given "
                              "as --section.key=value")
        if "=" not in arg and i + 1 < len(rest):
            arg, i = f"{arg}={rest[i + 1]}", i + 1
        out.append(arg[2:])
        i += 1
    return out
