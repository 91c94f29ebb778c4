"""How fast one kernel can stream a buffer of a given size from HBM on this GPU: torch's sum
of a bf16 vector (a read-bound reduction) per size, timed as CUDA graph replays cycling over
enough buffers that none is read from the L2. The ceiling to hold a decode-step kernel reading
N bytes against (the bound's 4.2 TB/s is a large copy's rate; short reads ramp up and drain).

    python bench/read_rate.py [--sizes-mb 8,16,32,64,87,128,256,1024]

Prints a table; writes JSON (default bench/results/read_rate.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gemm_layouts import timed_us  # noqa: E402  (graph replays cycling over buffers)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="8,16,32,64,87,128,256,1024")
    p.add_argument("--reps", type=int, default=48)
    p.add_argument("--out", default=str(HERE / "results" / "read_rate.json"))
    return p.parse_args(argv)


def rate(mb: float, reps: int) -> dict:
    """Microseconds and TB/s of one sum over `mb` MB (bf16), graph-replayed."""
    n = int(mb * 1e6) // 2
    count = max(2, min(reps, -(-1024 // max(int(mb), 1))))  # >= ~1 GB touched per cycle
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    out = torch.empty((), device="cuda", dtype=torch.float32)
    us = timed_us(lambda o, b: torch.sum(b, dim=0, dtype=torch.float32, out=o), bufs, out, reps)
    return {"mb": mb, "us": us, "tb_s": 2 * n / us / 1e6}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("read_rate needs a GPU")
        return 1
    rows = [rate(float(mb), args.reps) for mb in args.sizes_mb.split(",")]
    print(f"{'MB':>6} {'us':>9} {'TB/s':>6}")
    for r in rows:
        print(f"{r['mb']:>6.0f} {r['us']:>9.2f} {r['tb_s']:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
