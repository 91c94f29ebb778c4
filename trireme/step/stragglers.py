"""Straggler detection: each rank's own step time, compared across ranks at log steps.

In synchronous training a slow rank makes every rank slow (they all wait for it in the gradient
reduction), so the wall time per step says nothing about who is slow. What does: the time a rank
spends on its own work, from the start of its step to the moment it starts waiting for the
data-parallel reduction (`compute`), plus the time it waits for its micro batches (`data wait`).
The step runner marks those two moments (`step_started`, `compute_done`; CUDA events on a GPU,
read back only at log steps, so no extra sync), the trainer adds the data wait.

At each log step one small all_gather over all ranks (two numbers per rank) gives the table;
ranks whose step time exceeds `logging.straggler_factor` x the median (and the median by
more than NOISE_S, against timer noise in tiny runs) are named in the log line
and in metrics.jsonl (`stragglers`, with `step_time_max_rank` and friends). Under pipeline
parallelism a stage's compute includes its waits for the neighbouring stages (bubbles).
"""

from __future__ import annotations

import statistics
import time

import torch

from trireme.parallel.released import all_gather_floats

NOISE_S = 0.005  # a rank is no straggler for less than this many seconds over the median


class RankTimes:
    """This rank's compute and data-wait seconds since the last `take` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute_s = 0.0
        self.data_s = 0.0
        self.steps = 0
        self._start: float | torch.cuda.Event | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def step_started(self) -> None:
        self._start = self._mark()

    def compute_done(self) -> None:
        """The step's own work is queued; what follows waits for the other ranks."""
        if self._start is None:
            return
        end = self._mark()
        if self.cuda:
            self._events.append((self._start, end))
        else:
            self.compute_s += end - self._start
        self.steps += 1
        self._start = None

    def add_data_wait(self, seconds: float) -> None:
        self.data_s += seconds

    def take(self) -> tuple[float, float]:
        """(compute, data wait) seconds per step since the last call; on a GPU call it after the
        device is synchronized (the loop does at log steps)."""
        compute = self.compute_s + sum(a.elapsed_time(b) for a, b in self._events) / 1000
        steps = max(self.steps, 1)
        result = (compute / steps, self.data_s / steps)
        self.compute_s, self.data_s, self.steps, self._events = 0.0, 0.0, 0, []
        return result

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def straggler_report(times: RankTimes, factor: float, device: torch.device) -> dict:
    """Gather every rank's (step time, data wait) per step (collective over all ranks) and name
    the stragglers: the ranks above `factor` x the median step time."""
    compute, data = times.take()
    # the tensors let go before it returns: this is often a run's last collective (released.py)
    table = all_gather_floats([compute + data, data], device)
    step = [row[0] for row in table]
    wait = [row[1] for row in table]
    median = statistics.median(step)
    slowest = max(range(len(step)), key=step.__getitem__)
    hungriest = max(range(len(wait)), key=wait.__getitem__)
    return {
        "step_time_median_s": median,
        "step_time_max_s": step[slowest],
        "step_time_max_rank": slowest,
        "data_wait_max_s": wait[hungriest],
        "data_wait_max_rank": hungriest,
        "stragglers": [r for r, s in enumerate(step)
                       if s > factor * median and s - median > NOISE_S],
    }


def straggler_note(record: dict) -> str:
    """The log line's part about slow ranks ('' when there are none)."""
    ranks = record.get("stragglers")
    if not ranks:
        return ""
    median = max(record["step_time_median_s"], 1e-9)
    slow = ", ".join(str(r) for r in ranks)
    return (f"stragglers: rank {slow} (slowest rank {record['step_time_max_rank']}: "
            f"{record['step_time_max_s'] / median:.1f}x the median step time)")
