"""Does programmatic dependent launch (trireme.ops.pdl) change what the engine computes? The
same greedy requests through two engines, one with EngineSettings.pdl off (`--pdl off`) and one
with it on (the llama3-1b shape, random weights, CUDA graphs and the compiled decode step as
serving runs): every kernel is deterministic, so without a race the tokens are the same, every one.

    python bench/pdl_check.py                   # on the GPU
    python bench/pdl_check.py --smoke           # a tiny model on the CPU (PDL never applies)
    python bench/pdl_check.py --switch early_reads   # another switch: here the early reads
        # (L2 prefetch before the wait) off and on

Prints the requests whose tokens differ; writes JSON (default bench/results/pdl_check.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_throughput import build, engine_for, make_prompts  # noqa: E402
from serve_throughput import parse_args as serve_args  # noqa: E402

from trireme.serving.sampling import SamplingParams  # noqa: E402

SWITCHES = ("pdl", "early_reads")  # EngineSettings' on / off kernel settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--switch", choices=SWITCHES, default="pdl",
                   help="the engine setting the two engines differ in: off in the first, on in "
                   "the second")
    p.add_argument("--out", default=str(HERE / "results" / "pdl_check.json"))
    return p.parse_args(argv)


def greedy_tokens(model, args, prompts, switch: str, value: str, tokens: int
                  ) -> list[list[int]]:
    """Each prompt's greedy tokens from a fresh engine captured with `switch` (a serve flag of
    serve_throughput.py's: pdl, early_reads) = value (on / off)."""
    graphs = next(model.parameters()).is_cuda
    engine = engine_for(model, argparse.Namespace(**{**vars(args), switch: value}),
                        max_running=len(prompts), graphs=graphs)
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
    values = ["off", "on"]
    off = greedy_tokens(model, serve, prompts, args.switch, values[0], tokens)
    on = greedy_tokens(model, serve, prompts, args.switch, values[1], tokens)
    differ = [i for i, (a, b) in enumerate(zip(off, on)) if a != b]
    result = {"device": str(device), "requests": len(prompts), "tokens": tokens,
              "switch": args.switch, "values": values,
              "differ": differ, "same": not differ and len(off) == len(on) == len(prompts)}
    print(f"{len(prompts)} requests x {tokens} greedy tokens, {args.switch} {values[0]} vs "
          f"{values[1]}: "
          f"{'the same tokens' if result['same'] else f'{len(differ)} differ: {differ[:10]}'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0 if result["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
