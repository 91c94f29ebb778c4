"""Index build time of the GPT dataset: a 1M-document, 1B-token dataset, cold and cached.

Writes a dataset of `--documents` documents averaging `--tokens / --documents` tokens (the `.bin`
is a sparse file: building indices never reads tokens), then, each in a fresh process:

    cold     open the dataset, build epoch 0's document / sample / shuffle indices and write them
             to an empty cache, read one batch
    cached   the same with the cache filled: a restart

Times are measured inside the process (imports excluded, listed apart). Prints a table; writes
JSON to bench/results/data_index.json (and $OUT when set).

    python bench/data_index.py --documents 1000000 --tokens 1000000000 --seq-length 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from trireme.data.gpt_dataset import GPTDataset, split_documents
from trireme.data.indexed import IndexedDataset
t1 = time.perf_counter()
prefix, cache, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
ds = IndexedDataset(prefix)
t2 = time.perf_counter()
train_ids, _, _ = split_documents(ds.num_documents, "969,30,1")
data = GPTDataset(ds, seq, 1234, train_ids, cache_dir=cache)
batch = data.get_samples(np.arange(8))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "index_s": t3 - t2,
                  "total_s": t3 - t1, "samples_per_epoch": data.samples_per_epoch}))
"""


def write_dataset(prefix: str, documents: int, tokens: int, seed: int = 0) -> None:
    """Lengths drawn around the mean, adjusted to sum to `tokens`; a sparse .bin of that size."""
    rng = np.random.default_rng(seed)
    mean = tokens / documents
    lengths = rng.integers(1, int(2 * mean), documents).astype(np.int64)
    lengths = np.floor(lengths * (tokens - documents) / lengths.sum()).astype(np.int64) + 1
    lengths[: tokens - int(lengths.sum())] += 1  # the rounding remainder, one token each
    itemsize = 2  # uint16
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1] * itemsize)])
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, documents, documents + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(documents + 1, dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * itemsize)


def run_child(prefix: str, cache: str, seq: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", CHILD, prefix, cache, str(seq)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the timed process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=1_000_000_000)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "data_index.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix, cache = os.path.join(tmp, "big"), os.path.join(tmp, "cache")
        start = time.perf_counter()
        write_dataset(prefix, args.documents, args.tokens)
        write_s = time.perf_counter() - start
        cold = run_child(prefix, cache, args.seq_length)
        cached = run_child(prefix, cache, args.seq_length)
        cache_mb = sum(f.stat().st_size for f in Path(cache).rglob("*.npy")) / 1e6
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "settings": {"documents": args.documents, "tokens": args.tokens,
                     "seq_length": args.seq_length, "split": "969,30,1 (train split)",
                     "cpu_affinity": sorted(os.sched_getaffinity(0))},
        "write_dataset_s": write_s,
        "cache_mb": cache_mb,
        "cold": cold,
        "cached": cached,
    }
    print(f"{args.documents:,} documents, {args.tokens:,} tokens, seq {args.seq_length}, "
          f"{cold['samples_per_epoch']:,} samples per epoch; cache {cache_mb:.1f} MB")
    print(f"{'run':<8} {'open .idx':>10} {'indices':>10} {'total':>10} {'(imports)':>10}")
    for name, r in (("cold", cold), ("cached", cached)):
        print(f"{name:<8} {r['open_s']:>9.3f}s {r['index_s']:>9.3f}s {r['total_s']:>9.3f}s "
              f"{r['import_s']:>9.3f}s")
    for path in [args.out] + ([os.path.join(os.environ["OUT"], os.path.basename(args.out))]
                              if os.environ.get("OUT") else []):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
