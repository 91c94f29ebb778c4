"""Ring attention's efficiency without the network: on one GPU, the blocks one rank of a C-rank ring
computes (its zigzag query chunks against every arriving K/V block, each merged by its
log-sum-exp; forward and backward) against one SDPA call over the same number of tokens.

    python bench/ring_efficiency.py                     # llama3-1b heads, 32k tokens per rank
    python bench/ring_efficiency.py --smoke             # CPU, tiny: that the script runs

The rank runs the library's own ring (trireme.parallel.ring_attention) over a LocalRing whose
`pass_on` hands it the next rank's K/V block from memory instead of receiving it, so what is timed
is exactly the rank's compute. (The gradient accumulators that would arrive from the neighbour are
stood in for by this rank's own, the same size: their values are not checked, their cost is
the same.) Useful work is counted as the (query, key) pairs the causal mask allows; a
forward+backward pair costs 4 d (forward) + 10 d (backward, flash's 2.5x) FLOPs per head, the
same count for both sides, so the ratio of TFLOP/s is the efficiency.

Before timing, `--check` (on by default) compares the rank's output and dq with full causal
attention over the whole sequence (bf16 tolerances). Prints a table; writes
bench/results/ring_efficiency.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.parallel.context_parallel import zigzag_index  # noqa: E402
from trireme.parallel.ring_attention import Ring, ring_attention  # noqa: E402


@dataclass(frozen=True, eq=False)
class LocalRing(Ring):
    """Rank `rank` of a ring whose every K/V block (`blocks`, [2, b, H_kv, s, d] each, by rank)
    is already on this device: passing a block on returns the one rank r - n - 1 would send at
    the rank's n-th pass (counted within a forward or a backward, C - 1 passes each)."""

    blocks: tuple = ()
    passes: list = field(default_factory=lambda: [0])

    def pass_on(self, block):
        if block.dtype != self.blocks[0].dtype:  # a gradient accumulator (fp32): see the doc
            return block, []
        n = self.passes[0] % (self.size - 1)
        self.passes[0] += 1
        return self.blocks[(self.rank - n - 1) % self.size], []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens-per-rank", type=int, default=32768)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--kernels", nargs="+", default=["auto"],
                   help="ring block kernels to time: auto cudnn flash (plain: small sizes only)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--out", default=str(REPO / "bench/results/ring_efficiency.json"))
    return p.parse_args(argv)


def _qkv(args, seq: int, device, dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (1, args.heads, seq, args.head_dim)
    kv_shape = (1, args.kv_heads, seq, args.head_dim)
    return (torch.randn(shape, generator=gen, device=device, dtype=dtype),
            torch.randn(kv_shape, generator=gen, device=device, dtype=dtype),
            torch.randn(kv_shape, generator=gen, device=device, dtype=dtype))


def _ring_for(args, size: int, q, k, v, kernel: str) -> tuple[LocalRing, tuple]:
    """The local ring of rank args.rank and its (q, k, v) slices, from the whole sequence's."""
    seq = q.shape[2]
    positions = tuple(zigzag_index(seq, size, r) for r in range(size))
    blocks = tuple(torch.stack([k[:, :, p.to(k.device)], v[:, :, p.to(k.device)]])
                   for p in positions)
    index = positions[args.rank].to(q.device)
    ring = LocalRing(None, size, args.rank, positions, kernel, blocks=blocks)
    return ring, (q[:, :, index], k[:, :, index], v[:, :, index]), index


def check(args, size: int, device, dtype, kernel: str) -> float:
    """Max abs error of this rank's out and dq against full causal attention."""
    seq = 1024 * size if not args.smoke else 16 * size
    q, k, v = _qkv(args, seq, device, dtype, seed=1)
    ring, local, index = _ring_for(args, size, q, k, v, kernel)
    local = [t.clone().requires_grad_() for t in local]
    out = ring_attention(*local, ring)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, local[0], dout)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    grad_out = torch.zeros_like(want)
    grad_out[:, :, index] = dout
    (want_dq,) = torch.autograd.grad(want, full[0], grad_out)
    error = max((out - want[:, :, index]).abs().max().item(),
                (dq - want_dq[:, :, index]).abs().max().item())
    if error > (0.05 if dtype != torch.float32 else 1e-4):
        raise SystemExit(f"ring C={size} ({kernel}) disagrees with full attention: "
                         f"max error {error:.3g}")
    return error


def _time(fn, repeats: int, device) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _fwd_bwd(fn, leaves):
    def run():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return run


def _flops(args, pairs: int) -> float:
    return 14.0 * args.heads * args.head_dim * pairs  # 4 d forward + 10 d backward, per head


def measure(args, size: int, device, dtype, kernel: str) -> dict:
    s = args.tokens_per_rank
    q, k, v = _qkv(args, s * size, device, dtype)
    ring, local, _ = _ring_for(args, size, q, k, v, kernel)
    pairs = sum(ring.block(step).pairs() for step in range(size))
    local = [t.clone().requires_grad_() for t in local]
    ring_times = _time(_fwd_bwd(lambda a, b, c: ring_attention(a, b, c, ring), local),
                       args.repeats, device)
    base = [t.clone().requires_grad_() for t in _qkv(args, s, device, dtype, seed=2)]
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,  # noqa: E731
                                                          enable_gqa=True)
    sdpa_times = _time(_fwd_bwd(sdpa, base), args.repeats, device)
    sdpa_pairs = s * (s + 1) // 2
    row = {"C": size, "kernel": kernel, "tokens_per_rank": s, "pairs": pairs,
           "ring_ms": statistics.median(ring_times) * 1e3,
           "ring_spread_ms": (max(ring_times) - min(ring_times)) * 1e3,
           "sdpa_ms": statistics.median(sdpa_times) * 1e3}
    row["ring_tflops"] = _flops(args, pairs) / statistics.median(ring_times) / 1e12
    row["sdpa_tflops"] = _flops(args, sdpa_pairs) / statistics.median(sdpa_times) / 1e12
    if device.type == "cuda":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash_times = _time(_fwd_bwd(sdpa, base), args.repeats, device)
        row["sdpa_flash_tflops"] = _flops(args, sdpa_pairs) / statistics.median(flash_times) / 1e12
    row["efficiency"] = row["ring_tflops"] / row["sdpa_tflops"]
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.tokens_per_rank, args.heads, args.kv_heads, args.head_dim = 64, 4, 2, 16
        args.repeats = 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for size, kernel in ((s, k) for s in args.sizes for k in args.kernels):
        try:
            error = None if args.no_check else check(args, size, device, dtype, kernel)
            row = measure(args, size, device, dtype, kernel)
        except (RuntimeError, SystemExit) as failure:  # report it, go on with the others
            print(f"C={size} {kernel}: failed: {failure}", flush=True)
            continue
        row["check_max_error"] = error
        rows.append(row)
        print(f"C={size} {kernel}: ring {row['ring_ms']:.2f} ms "
              f"({row['ring_tflops']:.0f} TFLOP/s), "
              f"SDPA {row['sdpa_ms']:.2f} ms ({row['sdpa_tflops']:.0f}), "
              f"efficiency {row['efficiency']:.1%}", flush=True)
    print("\n| C | kernel | tokens/rank | ring ms | ring TFLOP/s | SDPA TFLOP/s | efficiency |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['C']} | {r['kernel']} | {r['tokens_per_rank']} | {r['ring_ms']:.2f} ± "
              f"{r['ring_spread_ms'] / 2:.2f} | {r['ring_tflops']:.0f} | {r['sdpa_tflops']:.0f} "
              f"| {r['efficiency']:.1%} |")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
