"""Kernels per layer of the compiled decode step (trireme.serving.compiled_decode), before and
after its fusions: how many Inductor kernels and extern calls (GEMMs) each compiled piece makes.

    python bench/decode_kernels.py                   # llama3-1b shape, batch 64, GPU (Triton)
    python bench/decode_kernels.py --smoke           # preset tiny, batch 4, CPU (C++ kernels)

Each piece is compiled with Inductor (fullgraph, static shapes, as the CUDA graphs' largest
bucket) on x [1, B, h] and the generated code is read back (torch._inductor.utils.
run_and_get_code): the Inductor kernels it defines (Triton on the GPU, C++ on the CPU) and its
extern_kernels calls. A middle layer of a decode step runs

    before  pre (input norm, qkv, heads: q and k RoPE'd apart, .contiguous() q, k, v)
            -> paged kernel -> post (x + out(y), then x + mlp(norm(x)))
    after   project (qkv of the carried h, q and k RoPE'd as one [B, H + n_kv, d] tensor, v a
            view: no copy) -> paged kernel -> post_norm (post, and h = the next layer's input
            norm of x, in the kernel of the last residual add)

(the first layer runs `pre` with the fused q/k RoPE, the last plain `post`). The paged kernel is
the same launch either way and not counted. A table is printed and JSON written (default
bench/results/decode_kernels-<preset>.json, with --smoke decode_kernels-smoke.json).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trireme.config import load_config  # noqa: E402
from trireme.models.gpt import GPT  # noqa: E402
from trireme.serving.compiled_decode import (  # noqa: E402
    _post,
    _post_norm,
    _pre,
    _project,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)  # an Inductor kernel's definition
EXTERN = re.compile(r"extern_kernels\.(\w+)\(")  # a library call (GEMM) in the graph's call()


def before_pre(block: torch.nn.Module, name: str, x: torch.Tensor, rope):
    """The decode pre-attention piece as it was before the fusions: norm, qkv, attention.heads
    (q and k RoPE'd apart), contiguous q, k, v [B, heads, d]."""
    attention = getattr(block, name)
    q, k, v = attention.heads(attention.qkv(getattr(block, f"{name}_norm")(x)), rope)
    return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))


def count(fn, *args) -> dict:
    """Compile fn with Inductor, run it once on args: its kernels (names) and extern calls."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)
    _, codes = run_and_get_code(compiled, *args)
    code = "\n".join(codes)
    kernels = KERNEL.findall(code)
    externs = EXTERN.findall(code)
    return {"kernels": len(kernels), "externs": len(externs), "names": kernels,
            "extern_names": externs}


def inputs(model: GPT, batch: int, device: torch.device, dtype: torch.dtype):
    """x [1, B, h], rope (cos, sin [1, B, d]) at random positions, y [B, H, d]."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, batch, cfg.hidden_size, generator=gen).to(device, dtype)
    positions = torch.randint(0, cfg.seq_length, (1, batch), generator=gen).to(device)
    rope = model.rope(device, position_ids=positions)
    y = torch.randn(batch, cfg.num_attention_heads, cfg.head_size, generator=gen).to(device, dtype)
    return x, rope, y


def measure(model: GPT, batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Kernel counts of every piece (module docstring), and per middle layer before / after."""
    block = next(iter(model.layers.values()))
    x, rope, y = inputs(model, batch, device, dtype)
    norm = block.attention_norm
    with torch.no_grad():
        h = norm(x)  # [1, B, h]: what post_norm hands the next layer's project
        pieces = {
            "before pre": count(before_pre, block, "attention", x, rope),
            "post": count(_post, block, x, y, "attention", ("mlp",)),
            "pre": count(_pre, block, "attention", x, rope),
            "project": count(_project, block, "attention", h, rope),
            "post_norm": count(_post_norm, block, x, y, "attention", ("mlp",), norm),
        }
    layer = {"before": {k: pieces["before pre"][k] + pieces["post"][k]
                        for k in ("kernels", "externs")},
             "after": {k: pieces["project"][k] + pieces["post_norm"][k]
                       for k in ("kernels", "externs")}}
    return {"pieces": pieces, "layer": layer}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="preset tiny, batch 4, on the CPU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.batch = "tiny", 4
        args.device = "cpu" if args.device == "auto" else args.device
    return args


def main(argv=None) -> int:
    args = parse(argv)
    # the vocabulary is no piece's business (the blocks only): a small one, if none is set
    cfg = load_config(args.preset, ["model.vocab_size=256", *args.override]).model
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    dtype = DTYPES[cfg.precision] if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = GPT(cfg, seed=None).to(dtype).eval()
    result = measure(model, args.batch, device, dtype)
    print(f"{args.preset}, batch {args.batch}, {device.type}, {dtype}")
    print(f"{'piece':<12} {'kernels':>7} {'externs':>7}  kernels")
    for name, c in result["pieces"].items():
        print(f"{name:<12} {c['kernels']:>7} {c['externs']:>7}  {', '.join(c['names'])}")
    for when in ("before", "after"):
        c = result["layer"][when]
        print(f"a middle layer {when}: {c['kernels']} kernels + {c['externs']} extern calls "
              f"(+ the paged kernel)")
    out = Path(args.out or Path(__file__).parent / "results" /
               f"decode_kernels-{'smoke' if args.smoke else args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "batch": args.batch, "device": device.type,
                               "dtype": str(dtype), "qk_norm": cfg.qk_norm, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
