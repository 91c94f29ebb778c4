"""Run a function on several CPU processes joined by gloo: the harness of the distributed tests.

`run_ranks(fn, world_size, tmp_path, *args)` spawns `world_size` processes; each starts a gloo
process group (rendezvous through a file under tmp_path, so no port can collide) and calls
`fn(rank, world_size, *args)`. An assertion failing on any rank fails the test with that rank's
traceback. `fn` must be importable (a module-level function of a test module).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, store_path: str, args: tuple) -> None:
    torch.set_num_threads(1)  # several processes share two cores
    # as torchrun says it: train() then gives each process its share of the cores (two ranks
    # of two threads each on two cores made every op wait on spinning threads, 5-20x slower)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ.pop("WORLD_SIZE", None)  # the group below is the only source of truth
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, tmp_path, *args) -> None:
    store = tmp_path / f"store-{fn.__name__}-{world_size}"
    mp.start_processes(
        _entry, args=(fn, world_size, str(store), args), nprocs=world_size, join=True,
        start_method="spawn",
    )
