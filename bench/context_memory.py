"""Per-rank activation memory under context parallelism, on CPU processes (gloo): the bytes of the
tensors autograd saves for the backward during one forward of a micro batch, for C = 1, 2, 4 and
every context mode. They should fall about as 1/C (the gathered keys and values of `allgather`
are the exception: every rank keeps the whole sequence's).

    python bench/context_memory.py                    # llama-shaped, 4 layers, seq 4096
    python bench/context_memory.py --seq 1024 --layers 2     # smaller

Counts storage bytes of every saved tensor once (torch.autograd.graph.saved_tensors_hooks; the
parameters left out), on rank 0 of each layout. Prints a table and writes
bench/results/context_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.config import load_config  # noqa: E402
from trireme.data.batch import Batch  # noqa: E402
from trireme.models.gpt import GPT  # noqa: E402
from trireme.parallel.context import build_parallel_context  # noqa: E402
from trireme.parallel.context_parallel import split_batch  # noqa: E402
from trireme.parallel.mesh import ParallelDims, ParallelMesh  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "context_memory.json"))
    return p.parse_args(argv)


def saved_bytes(model: GPT, batch: Batch) -> int:
    """Bytes autograd saves for the backward in one forward of `batch` (each storage once; the
    parameters, which autograd also saves, left out: they do not depend on C)."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch.tokens, batch.labels, **batch.model_kwargs())
    return sum(seen.values())


def _rank(rank: int, world: int, store: str, args, mode: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = load_config("tiny", [f"model.seq_length={args.seq}", f"model.num_layers={args.layers}",
                               "model.hidden_size=256", "model.num_attention_heads=8",
                               "model.num_query_groups=4", "model.ffn_hidden_size=768",
                               "model.vocab_size=512", f"parallel.context={world}",
                               f"parallel.context_mode={mode}"])
    dims = ParallelDims(context=world)
    ctx = build_parallel_context(ParallelMesh.build(dims), cfg.model, False, 0, "cpu", mode)
    model = GPT(cfg.model, seed=0, ctx=ctx)
    tokens = torch.randint(0, 512, (1, args.seq), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens, tokens.roll(-1, 1))
    if world > 1:
        batch = split_batch(batch, ctx.context)
    used = saved_bytes(model, batch)
    if rank == 0:
        queue.put(used)
    dist.destroy_process_group()


def measure(args, world: int, mode: str) -> int:
    """Rank 0's saved bytes for `world` context ranks (a fresh process group each time)."""
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.pop("WORLD_SIZE", None)
        mp.start_processes(_rank, args=(world, f"{tmp}/store", args, mode, queue), nprocs=world,
                           join=True, start_method="spawn")
    return queue.get()


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for mode in ("allgather", "a2a", "ring"):
        base = None
        for world in (1, 2, 4):
            used = measure(args, world, mode)
            base = base or used
            rows.append({"mode": mode, "context": world, "saved_mib": used / 2**20,
                         "share_of_c1": used / base})
    print(f"{'mode':>10} {'C':>3} {'saved MiB':>10} {'x C=1':>7}")
    for r in rows:
        print(f"{r['mode']:>10} {r['context']:>3} {r['saved_mib']:>10.1f} {r['share_of_c1']:>7.3f}")
    out = {"benchmark": "context_memory", "torch": torch.__version__, "seq": args.seq,
           "layers": args.layers, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
