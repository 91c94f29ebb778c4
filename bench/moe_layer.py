"""The whole MoE sublayer (router, permutation, expert GEMMs, unpermutation) forward + backward,
against a dense SwiGLU MLP of the same active FLOPs, in one process.

    python bench/moe_layer.py                         # the Mixtral and fine-grained shapes, bf16
    python bench/moe_layer.py --shapes mixtral --iters 20
    python bench/moe_layer.py --device cpu --shapes tiny --iters 2    # smoke test

Shapes (issue 15): mixtral = hidden 4096, expert FFN 14336, 8 experts, top-2, 16k tokens;
fine = hidden 2048, expert FFN 768, 128 experts, top-8, 32k tokens; tiny = a CPU smoke test.

For each shape, random bf16 tokens x [T, h] and output gradient dy (not an expanded one):
1. Correctness: the grouped path (torch._grouped_mm) against the per-expert loop, outputs and
   input gradients, on the first 2048 tokens (relative max error, must stay under --tol).
2. Speed, CUDA events around each iteration, the median of --iters after --warmup: the MoE layer
   (grouped, dropless, top-k softmax router) and the dense MLP with FFN = top_k x expert FFN;
   TFLOP/s count the active FLOPs, 6 x T x (3 h F k + h E) and 6 x T x 3 h F k; the ratio is
   the MoE's share of the dense rate.
Prints a table, writes bench/results/moe_layer.json (a copy to $OUT when set), exits 1 if a check
fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_throughput as tt  # noqa: E402

from trireme.config import ModelConfig  # noqa: E402
from trireme.models.mlp import MLP  # noqa: E402
from trireme.models.moe import MoE  # noqa: E402
from trireme.parallel.context import ParallelContext  # noqa: E402

SHAPES = {  # hidden, expert ffn, experts, top-k, tokens
    "mixtral": (4096, 14336, 8, 2, 16384),
    "fine": (2048, 768, 128, 8, 32768),
    "tiny": (64, 32, 8, 2, 256),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="mixtral,fine")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_layer.json"))
    return p.parse_args(argv)


def layers(shape: str, device: torch.device, dtype: torch.dtype, grouped: bool = True):
    h, f, e, k, _ = SHAPES[shape]
    cfg = ModelConfig(hidden_size=h, num_attention_heads=1, ffn_hidden_size=f * k, vocab_size=8,
                      layer_pattern="E", num_layers=1, moe_num_experts=e, moe_top_k=k,
                      moe_ffn_hidden_size=f, moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    moe, dense = MoE(cfg, ParallelContext()), MLP(cfg, ParallelContext())
    for module in (moe, dense):
        for param in module.parameters():
            torch.nn.init.normal_(param, std=0.02)
    return moe.to(device, dtype).train(), dense.to(device, dtype).train()


def time_fwd_bwd(module, x: torch.Tensor, dy: torch.Tensor, iters: int, warmup: int) -> float:
    """Median seconds of one forward + backward."""
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        xi = x.detach().requires_grad_(True)
        start.record()
        module(xi).backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
        module.zero_grad(set_to_none=True)
    return statistics.median(times)


def check(shape: str, device: torch.device, dtype: torch.dtype, tokens: int) -> float:
    """Relative max error of the grouped path against the loop (outputs and input gradients)."""
    h = SHAPES[shape][0]
    x = torch.randn(1, tokens, h, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    outs = []
    for grouped in (True, False):
        moe, _ = layers(shape, device, dtype, grouped)
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        y.backward(dy)
        outs.append((y.detach().float(), xi.grad.float()))
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*outs))


def run(shape: str, args, device: torch.device) -> dict:
    h, f, e, k, t = SHAPES[shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    error = check(shape, device, dtype, min(t, 2048))
    moe, dense = layers(shape, device, dtype)
    x = torch.randn(1, t, h, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    row = {"shape": shape, "hidden": h, "expert_ffn": f, "experts": e, "top_k": k, "tokens": t,
           "grouped_vs_loop_rel_error": error}
    if device.type == "cuda":
        moe_s = time_fwd_bwd(moe, x, dy, args.iters, args.warmup)
        dense_s = time_fwd_bwd(dense, x, dy, args.iters, args.warmup)
        moe_flops, dense_flops = 6 * t * (3 * h * f * k + h * e), 6 * t * 3 * h * f * k
        row.update(moe_s=moe_s, dense_s=dense_s, moe_tflops=moe_flops / moe_s / 1e12,
                   dense_tflops=dense_flops / dense_s / 1e12)
        row["moe_share_of_dense"] = row["moe_tflops"] / row["dense_tflops"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = [run(shape, args, device) for shape in args.shapes.split(",")]
    print(f"{'shape':>8} {'err':>8} {'moe TF/s':>9} {'dense TF/s':>10} {'share':>6}")
    for r in rows:
        print(f"{r['shape']:>8} {r['grouped_vs_loop_rel_error']:8.1e} "
              f"{r.get('moe_tflops', 0):9.1f} {r.get('dense_tflops', 0):10.1f} "
              f"{r.get('moe_share_of_dense', 0):6.1%}")
    data = {**tt.run_header("moe_layer", device, argv), "rows": rows}
    out = Path(args.out)
    tt.write_json(out, data)
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0 if all(r["grouped_vs_loop_rel_error"] < args.tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
