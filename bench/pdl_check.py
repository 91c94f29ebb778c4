"""Does programmatic dependent launch (trireme.ops.pdl) change what the engine computes? The
same greedy requests through two engines, one captured with $TRIREME_PDL=0 and one with 1 (the
llama3-1b shape, random weights, CUDA graphs and the compiled decode step as serving runs):
every kernel is deterministic, so without a race the tokens are the same, every one.

    python bench/pdl_check.py                   # on the GPU
    python bench/pdl_check.py --smoke           # a tiny model on the CPU (PDL never applies)
    python bench/pdl_check.py --env TRIREME_PDL_PREFETCH --values 0,1   # another switch: here
        # the early L2 prefetch off and on

Prints the requests whose tokens differ; writes JSON (default bench/results/pdl_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_throughput import build, engine_for, make_prompts  # noqa: E402
from serve_throughput import parse_args as serve_args  # noqa: E402

from trireme.ops.pdl import ENV  # noqa: E402
from trireme.serving.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--env", default=ENV, help="the switch the two engines differ in")
    p.add_argument("--values", default="0,1", help="its two values, first,second")
    p.add_argument("--out", default=str(HERE / "results" / "pdl_check.json"))
    return p.parse_args(argv)


def greedy_tokens(model, args, prompts, env: str, value: str, tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from a fresh engine captured with $env = value."""
    os.environ[env] = value
    graphs = next(model.parameters()).is_cuda
    engine = engine_for(model, args, max_running=len(prompts), graphs=graphs)
    params = [SamplingParams(max_tokens=tokens, greedy=True, ignore_eos=True)] * len(prompts)
    out = [r.output_ids for r in engine.generate(prompts, params)]
    del engine
    if graphs:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    serve = serve_args(["--smoke"] if args.smoke else [])
    cfg, model, device = build(serve)
    prompts = make_prompts(serve, cfg.model.vocab_size)[:args.requests]
    tokens = min(args.tokens, serve.output_tokens) if args.smoke else args.tokens
    values = args.values.split(",")
    if len(values) != 2:
        raise SystemExit(f"--values {args.values!r}: give two, e.g. 0,1")
    before = os.environ.get(args.env)
    try:
        off = greedy_tokens(model, serve, prompts, args.env, values[0], tokens)
        on = greedy_tokens(model, serve, prompts, args.env, values[1], tokens)
    finally:  # the switch as it was
        os.environ.pop(args.env)
        if before is not None:
            os.environ[args.env] = before
    differ = [i for i, (a, b) in enumerate(zip(off, on)) if a != b]
    result = {"device": str(device), "requests": len(prompts), "tokens": tokens,
              "env": args.env, "values": values,
              "differ": differ, "same": not differ and len(off) == len(on) == len(prompts)}
    print(f"{len(prompts)} requests x {tokens} greedy tokens, {args.env}={values[0]} vs "
          f"{values[1]}: "
          f"{'the same tokens' if result['same'] else f'{len(differ)} differ: {differ[:10]}'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0 if result["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
