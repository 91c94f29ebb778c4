"""The log step's gather lets go of its tensors before it returns (trireme/parallel/released.py):
a gloo worker that dropped them later could do it while the interpreter shuts down, and the
process aborted after a successful run (test_init_from's FSDP test, about one run in ten)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist
from distributed import run_ranks

from trireme.parallel.released import all_gather_floats, all_reduce_max
from trireme.step.stragglers import RankTimes, straggler_report
from trireme.training.loop import agree

CALLS = 200  # gloo's worker held the tensors after 20% of calls when measured


def _recorded(name: str, held: list):
    """torch.distributed's `name`, recording weak references to the tensors it was given."""
    plain = getattr(dist, name)

    def recording(*args, **kwargs):
        out = plain(*args, **kwargs)
        for arg in args[:2]:
            tensors = arg if isinstance(arg, list) else [arg]
            held.extend(weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor))
        return out

    return plain, recording


def _assert_released(held: list, call: int) -> None:
    alive = [r for r in held if r() is not None]
    assert not alive, f"call {call}: {len(alive)} tensors of the collective still held"
    held.clear()


def _gathers(rank: int, world: int) -> None:
    cpu = torch.device("cpu")
    assert all_gather_floats([rank + 0.5, -rank], cpu) == [[r + 0.5, -r] for r in range(world)]
    trainer = SimpleNamespace(env=SimpleNamespace(world_size=world), device=cpu)
    held: list = []
    gather, dist.all_gather = _recorded("all_gather", held)
    reduce, dist.all_reduce = _recorded("all_reduce", held)
    try:
        for call in range(CALLS):
            times = RankTimes(cpu)
            times.add_data_wait(0.01 * (rank + 1))
            report = straggler_report(times, 3.0, cpu)
            assert report["data_wait_max_rank"] == world - 1, report
            _assert_released(held, call)
            assert agree(trainer, rank == call % world) is True
            assert agree(trainer, False) is False
            assert all_reduce_max(-float(rank), cpu) == 0.0
            _assert_released(held, call)
    finally:
        dist.all_gather, dist.all_reduce = gather, reduce


def test_the_log_steps_collectives_release_their_tensors(tmp_path):
    """The straggler gather and the stop / rollback flag's all-reduce (loop.agree)."""
    run_ranks(_gathers, 2, tmp_path)
