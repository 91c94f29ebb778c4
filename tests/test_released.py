"""The log step's gather lets go of its tensors before it returns (trireme/parallel/released.py):
a gloo worker that dropped them later could do it while the interpreter shuts down, and the
process aborted after a successful run (test_init_from's FSDP test, about one run in ten)."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.engine.stragglers import RankTimes, straggler_report
from trireme.parallel.released import all_gather_floats

CALLS = 200  # gloo's worker held the tensors after 20% of calls when measured


def _gathers(rank: int, world: int) -> None:
    assert all_gather_floats([rank + 0.5, -rank], torch.device("cpu")) == [
        [r + 0.5, -r] for r in range(world)]
    held = []
    plain = dist.all_gather

    def recording(table, tensor, *args, **kwargs):
        out = plain(table, tensor, *args, **kwargs)
        held.extend(weakref.ref(t) for t in (*table, tensor))
        return out

    dist.all_gather = recording
    try:
        for call in range(CALLS):
            times = RankTimes(torch.device("cpu"))
            times.add_data_wait(0.01 * (rank + 1))
            report = straggler_report(times, 3.0, torch.device("cpu"))
            assert report["data_wait_max_rank"] == world - 1, report
            alive = [r for r in held if r() is not None]
            assert not alive, f"call {call}: {len(alive)} gathered tensors still held"
            held.clear()
    finally:
        dist.all_gather = plain


def test_the_straggler_gather_releases_its_tensors(tmp_path):
    run_ranks(_gathers, 2, tmp_path)
