"""Running out of GPU memory: a one-line error that says what to change, and the allocator's
snapshot in the run directory to see where the memory went.

The snapshot (`torch.cuda.memory._snapshot()`: every segment and block of the caching allocator at
the moment of the failure) is the file https://pytorch.org/memory_viz reads; it is written by each
rank that ran out, as <run.dir>/memory_snapshot_rank<R>.pickle (written whole, then renamed).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from trireme.errors import TrainingError

ADVICE = ("try a smaller train.micro_batch_size, train.recompute = selective or full, "
          "model.fused_cross_entropy = true, or more tensor / pipeline parallelism")
BUILD_ADVICE = ("the parameters and optimizer state do not fit: a smaller model, more tensor / "
                "pipeline parallelism, or parallel.distributed_optimizer / FSDP (trireme plan "
                "predicts the memory)")
# The host's allocator raises a plain RuntimeError (torch.OutOfMemoryError is CUDA's), and a
# tensor larger than any memory fails before allocating.
HOST_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory",
                    "Storage size calculation overflowed")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is running out of memory, on a GPU or on the host."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in HOST_OOM_MARKERS))


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def write_memory_snapshot(path: Path, snapshot: Callable[[], dict]) -> Path | None:
    """`snapshot()` pickled to `path`; None when it cannot be taken or written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        data = snapshot()
        with open(tmp, "wb") as f:
            pickle.dump(data, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError):
        tmp.unlink(missing_ok=True)
        return None
    return path


def out_of_memory(error: BaseException, step: int, device: torch.device, run_dir: Path,
                  rank: int) -> TrainingError:
    """The one-line error for running out of memory at `step`, with the snapshot on CUDA."""
    where = ""
    if device.type == "cuda":
        written = write_memory_snapshot(run_dir / f"memory_snapshot_rank{rank}.pickle",
                                        torch.cuda.memory._snapshot)
        if written is not None:
            where = f"; the allocator's snapshot is {written} (open it in pytorch.org/memory_viz)"
    return TrainingError(f"out of memory at step {step} on {device} ({_first_line(error)})"
                         f"{where}; {ADVICE}")


def out_of_memory_building(error: BaseException, device: str) -> TrainingError:
    """The one-line error for running out of memory while the model and optimizer are built."""
    return TrainingError(f"out of memory building the model on {device} ({_first_line(error)}); "
                         f"{BUILD_ADVICE}")
