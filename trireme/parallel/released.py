"""Small collectives whose CPU tensors are let go before they return.

A gloo collective runs on the process group's worker thread, which holds the tensors until just
after the work completes; the Python call returns at completion, so the worker may drop the last
reference afterwards, and dropping a tensor made in Python takes the interpreter lock. When that
falls after the interpreter began shutting down (the collective was a run's last, just before the
process exits) the thread is ended inside a C++ destructor and the process aborts ("terminate
called without an active exception", SIGABRT) after a run that succeeded: a DP=2 FSDP run on the
CPU did so about once in ten (its process groups' threads outlive `destroy_process_group`).
Measured on 2 cores: after 20% of gloo `all_reduce` calls the worker still held the tensor, for
up to 2 ms. `all_gather_floats` and `all_reduce_max` wait for that release (sleeping, so the
worker can take the lock) before they return; `settle` ends a run with one such gather, so that
a worker still letting go of an earlier collective's tensors most likely gets the lock meanwhile
(its own tensors are waited for; another worker's are not visible).
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

RELEASE_TIMEOUT_S = 5.0  # far beyond the milliseconds measured; a stuck worker is not waited for


def all_gather_floats(values: list[float], device: torch.device,
                      group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """Every rank's `values` (same length on every rank), in rank order, as Python floats
    (collective over `group`, the default group when None)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    table = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if mine.device.type == "cpu":  # gloo (NCCL's tensors are released by its own thread)
        refs = [weakref.ref(t) for t in (mine, *table)]
        del mine, table
        wait_released(refs)
    return rows


def all_reduce_max(value: float, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` over the ranks of `group` (collective)."""
    t = torch.tensor(value, dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = float(t.item())
    if t.device.type == "cpu":
        ref = weakref.ref(t)
        del t
        wait_released([ref])
    return out


def settle(group: dist.ProcessGroup | None = None) -> None:
    """A gloo group's last collective of a run (module docstring); nothing on other backends."""
    if dist.get_backend(group) == "gloo":
        all_gather_floats([0.0], torch.device("cpu"), group)


def wait_released(refs: list[weakref.ref], timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
    """Sleep until every tensor of `refs` is gone (the collective's worker let go of them);
    False after `timeout_s` with some still held."""
    deadline = time.monotonic() + timeout_s
    while any(r() is not None for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True
