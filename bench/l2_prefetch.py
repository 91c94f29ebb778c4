r"""Would the decode step's small GEMMs run faster with their weights prefetched into the L2?

    python bench/l2_prefetch.py            # llama3-1b's shapes, batch 64, 640 keys (GPU)

The step's qkv and out projections (12.6 and 8.4 MB of weights) take ~6 us each on the H200
whoever writes the kernel (bench/RESULTS.md, sessions 7-8): a kernel's fixed cost, not the
bandwidth. The paged decode kernel before the out projection reads its keys at ~3.2 TB/s, below
what the memory gives. This times, over --layers layers (each its own pools and weights, so
nothing is read from the L2 by accident), one CUDA graph of:

- serial:  the paged kernel, then x W_out^T (cuBLAS), as the step runs them;
- side:    the same, with a bulk L2 prefetch of W_out (cp.async.bulk.prefetch.L2) on a second
           stream beside the paged kernel, joined before the GEMM;
- before:  the prefetch, then the paged kernel, then the GEMM (does the prefetch survive the
           84 MB of keys the paged kernel reads?);
- after:   the paged kernel, the prefetch, then the GEMM (the GEMM on an L2-resident weight,
           the prefetch's own time included);
- gemm_cold / gemm_l2: the GEMM alone on cold weights / on the weight it has just read.

Per layer microseconds (median of --repeats replays). Writes JSON (default
bench/results/l2_prefetch.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from serve_profile import kernel_case  # noqa: E402

from trireme.config import load_config  # noqa: E402
from trireme.ops.paged_attention_triton import paged_decode_attention  # noqa: E402

PREFETCH_ASM = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def _prefetch_kernel(ptr, nbytes, LANES: tl.constexpr):
    """Program p asks the L2 for its share of the nbytes at ptr, LANES pieces at once (each a
    multiple of 16 bytes: the bulk prefetch's unit)."""
    pid = tl.program_id(0)
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16 * LANES) * 16 * LANES
    piece = share // LANES
    start = pid.to(tl.int64) * share + tl.arange(0, LANES).to(tl.int64) * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    tl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r",
                              [ptr.to(tl.pointer_type(tl.int8)) + start, size], dtype=tl.int32,
                              is_pure=False, pack=1)


def prefetch(t: torch.Tensor, programs: int) -> None:
    _prefetch_kernel[(programs,)](t, t.numel() * t.element_size(), LANES=64, num_warps=2)


def graph_us(fn, layers: int, repeats: int) -> tuple[float, list[float]]:
    """Per-layer microseconds of fn(l) for l in range(layers), captured as one CUDA graph."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / layers)
    return statistics.median(times), times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--programs", default="32,132")
    p.add_argument("--out", default=str(HERE / "results" / "l2_prefetch.json"))
    args = p.parse_args(argv)
    m = load_config(args.preset).model
    dev, dt = torch.device("cuda"), torch.bfloat16
    cases = [kernel_case(m, args.batch, args.context, 16, dev, dt, seed) for seed in
             range(args.layers)]
    hidden = m.num_attention_heads * m.head_size
    weights = [torch.randn(m.hidden_size, hidden, device=dev, dtype=dt) * 0.02
               for _ in range(args.layers)]
    x = torch.randn(args.batch, hidden, device=dev, dtype=dt)
    side = torch.cuda.Stream()
    rows = {}

    def attend(i):
        return paged_decode_attention(*cases[i])

    def run(name, fn):
        us, times = graph_us(fn, args.layers, args.repeats)
        rows[name] = {"us": us, "min": min(times), "max": max(times)}
        print(f"{name:<18} {us:8.2f} us per layer (min {min(times):.2f}, max {max(times):.2f})",
              flush=True)

    run("gemm_cold", lambda i: F.linear(x, weights[i]))
    run("gemm_l2", lambda i: (F.linear(x, weights[i]), F.linear(x, weights[i])))
    run("paged", attend)
    run("serial", lambda i: (attend(i), F.linear(x, weights[i])))
    for programs in (int(n) for n in args.programs.split(",")):
        def beside(i, programs=programs):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(weights[i], programs)
            attend(i)
            torch.cuda.current_stream().wait_stream(side)
            F.linear(x, weights[i])

        run(f"side_{programs}", beside)
        run(f"before_{programs}", lambda i, n=programs: (prefetch(weights[i], n), attend(i),
                                                          F.linear(x, weights[i])))
        run(f"after_{programs}", lambda i, n=programs: (attend(i), prefetch(weights[i], n),
                                                         F.linear(x, weights[i])))
        run(f"prefetch_{programs}", lambda i, n=programs: prefetch(weights[i], n))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "batch": args.batch,
                               "context": args.context, "layers": args.layers,
                               "weight_mb": weights[0].numel() * 2 / 1e6, "rows": rows},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
