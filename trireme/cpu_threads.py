"""How many intra-op threads a CPU training process uses.

torch starts every process with one thread per core. Several processes on one machine (torchrun
ranks, or other work) then oversubscribe the cores: on a busy 2-core machine, training ran twice
as fast with one thread per process (issue 24). So a CPU run takes the cores it may use (its
affinity mask) divided by the processes torchrun started on this machine (LOCAL_WORLD_SIZE),
unless the user chose: `train.cpu_threads`, else OMP_NUM_THREADS (which torch already obeys;
torchrun sets it to 1 when it starts several processes and it is unset).
"""

from __future__ import annotations

import os

import torch

from trireme.words import count_of


def choose_cpu_threads(cores: int, local_processes: int, omp_num_threads: str | None,
                       configured: int) -> tuple[int | None, str]:
    """(threads to set, or None to keep what OMP_NUM_THREADS gave torch; why, for the log)."""
    if configured > 0:
        return configured, "train.cpu_threads"
    ignored = ""
    if omp_num_threads and valid_omp_num_threads(omp_num_threads):
        return None, f"OMP_NUM_THREADS={omp_num_threads}"
    if omp_num_threads:  # torch ignores it too ("abc", "0"): say so, and share the cores
        ignored = f"OMP_NUM_THREADS={omp_num_threads!r} ignored, not a positive integer; "
    local = max(1, local_processes)
    share = count_of(local, "local process", "local processes")
    return max(1, cores // local), f"{ignored}{count_of(cores, 'core')} / {share}"


def valid_omp_num_threads(value: str) -> bool:
    """Whether OpenMP (hence torch) obeys `value`: positive counts, one per nesting level,
    separated by commas ("4", "4,1"; spaces around them allowed)."""
    counts = [count.strip() for count in value.split(",")]
    return all(count.isascii() and count.isdigit() and int(count) > 0 for count in counts)


def _local_processes() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


def _choice(configured: int) -> tuple[int | None, str]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return choose_cpu_threads(cores or 1, _local_processes(), os.environ.get("OMP_NUM_THREADS"),
                              configured)


def set_cpu_threads(configured: int) -> None:
    """Set this process's intra-op threads (see the module docstring)."""
    threads, _ = _choice(configured)
    if threads is not None:
        torch.set_num_threads(threads)


def cpu_threads_note(configured: int) -> str:
    """What the run's start line says of it: " with 2 threads per process (2 cores / 1 local
    process; train.cpu_threads sets it)"."""
    why = _choice(configured)[1]
    hint = "" if configured > 0 else "; train.cpu_threads sets it"
    return f" with {count_of(torch.get_num_threads(), 'thread')} per process ({why}{hint})"
