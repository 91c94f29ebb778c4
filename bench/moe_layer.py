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
3. The reference permutation (trireme.ops.moe_permute's index_add formulation, the code before
   the gather-only dropless path) timed the same way, and its distance from the fast one (relative
   max error of outputs and input gradients, bf16 on CUDA: the fast path sums in fp32).
With --profile, a torch.profiler table of the MoE layer's forward + backward: the kernels that
take the most device time (fast path, then the reference).
Prints a table, writes bench/results/moe_layer.json (a copy to $OUT when set), exits 1 if a check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_throughput as tt  # noqa: E402

from trireme.config import ModelConfig  # noqa: E402
from trireme.models.mlp import MLP  # noqa: E402
from trireme.models.moe import MoE  # noqa: E402
from trireme.ops.moe_permute import permute_reference, unpermute_reference  # noqa: E402
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
    p.add_argument("--profile", action="store_true", help="print the top kernels per shape")
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


@contextlib.contextmanager
def reference_permutation():
    """The MoE layers run the index_add permutation (the reference) inside this block."""
    with mock.patch("trireme.models.moe.permute",
                    lambda x, order, inverse, k: permute_reference(x, order, k)), \
            mock.patch("trireme.models.moe.unpermute",
                       lambda out, w, order, inverse: unpermute_reference(out, w, order)):
        yield


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


def check(shape: str, device: torch.device, dtype: torch.dtype, tokens: int) -> tuple[float, float]:
    """Relative max errors (outputs and input gradients) of the grouped path against the loop,
    and of the fast permutation against the reference."""
    h = SHAPES[shape][0]
    x = torch.randn(1, tokens, h, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    outs = []
    for grouped, reference in ((True, False), (False, False), (True, True)):
        moe, _ = layers(shape, device, dtype, grouped)
        xi = x.clone().requires_grad_(True)
        with reference_permutation() if reference else contextlib.nullcontext():
            y = moe(xi)
            y.backward(dy)
        outs.append((y.detach().float(), xi.grad.float()))

    def error(run, ref):
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(run, ref))
    return error(outs[0], outs[1]), error(outs[0], outs[2])


def profile(module, x: torch.Tensor, dy: torch.Tensor, title: str) -> None:
    """Print the kernels that take the most device time over 3 forward + backward passes."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if x.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    module(x.detach().requires_grad_(True)).backward(dy)  # warm
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            module(x.detach().requires_grad_(True)).backward(dy)
        if x.is_cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if x.is_cuda else "self_cpu_time_total"
    print(f"--- {title} (3 iterations)")
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70))


def run(shape: str, args, device: torch.device) -> dict:
    h, f, e, k, t = SHAPES[shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    error, fast_error = check(shape, device, dtype, min(t, 2048))
    moe, dense = layers(shape, device, dtype)
    x = torch.randn(1, t, h, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    row = {"shape": shape, "hidden": h, "expert_ffn": f, "experts": e, "top_k": k, "tokens": t,
           "grouped_vs_loop_rel_error": error, "fast_vs_reference_rel_error": fast_error}
    if args.profile:
        profile(moe, x, dy, f"{shape}: MoE layer")
        with reference_permutation():
            profile(moe, x, dy, f"{shape}: MoE layer, reference permutation")
    if device.type == "cuda":
        moe_s = time_fwd_bwd(moe, x, dy, args.iters, args.warmup)
        with reference_permutation():
            reference_s = time_fwd_bwd(moe, x, dy, args.iters, args.warmup)
        dense_s = time_fwd_bwd(dense, x, dy, args.iters, args.warmup)
        moe_flops, dense_flops = 6 * t * (3 * h * f * k + h * e), 6 * t * 3 * h * f * k
        row.update(moe_s=moe_s, reference_s=reference_s, dense_s=dense_s,
                   moe_tflops=moe_flops / moe_s / 1e12,
                   reference_tflops=moe_flops / reference_s / 1e12,
                   dense_tflops=dense_flops / dense_s / 1e12)
        row["moe_share_of_dense"] = row["moe_tflops"] / row["dense_tflops"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = [run(shape, args, device) for shape in args.shapes.split(",")]
    print(f"{'shape':>8} {'err':>8} {'ref err':>8} {'ref TF/s':>9} {'moe TF/s':>9} "
          f"{'dense TF/s':>10} {'share':>6}")
    for r in rows:
        print(f"{r['shape']:>8} {r['grouped_vs_loop_rel_error']:8.1e} "
              f"{r['fast_vs_reference_rel_error']:8.1e} {r.get('reference_tflops', 0):9.1f} "
              f"{r.get('moe_tflops', 0):9.1f} {r.get('dense_tflops', 0):10.1f} "
              f"{r.get('moe_share_of_dense', 0):6.1%}")
    data = {**tt.run_header("moe_layer", device, argv), "rows": rows}
    out = Path(args.out)
    tt.write_json(out, data)
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0 if all(max(r["grouped_vs_loop_rel_error"], r["fast_vs_reference_rel_error"])
                    < args.tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
