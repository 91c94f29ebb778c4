"""The watchdog: a collective that does not finish names the rank that stopped answering.

torch.distributed waits for a missing rank for the process group's timeout
(`parallel.timeout_minutes`), then raises an error that names no rank (gloo: "Timed out waiting
3000ms for recv operation", a dead peer: "Connection reset by peer"), or, with NCCL, aborts the
process with pages of log. The watchdog turns that into one line naming the ranks and the
operation, printed by the lowest surviving rank, e.g.

    rank 1 did not answer the gradient all-reduce of step 7 within 0.05 min (frozen or dead)

How it knows: every rank runs a thread that publishes a heartbeat to the rendezvous store (the
TCPStore that torchrun's agent, or rank 0, holds) every `interval` seconds: a counter and the
steps this rank has completed. A frozen (SIGSTOP, a hung driver) or dead process stops counting;
a rank stuck elsewhere (an endless data read) keeps counting but stays behind in steps.
`diagnose` reads the heartbeats twice, `2.5 * interval` apart, and names those ranks. It runs when
a collective raises in the main thread (`failure`), or from the thread itself when this rank has
completed no step for the timeout (NCCL waits on the GPU and may never raise): then the thread
prints the line and ends the process (exit status 3). The operation is read off the stack (of the
exception, or of the main thread): the innermost trireme function, e.g. `BucketReducer.finish`
is the gradient all-reduce.

A rank that fails with a user error leaves the message in the store (`post_error`); the reporting
rank quotes it. Costs: one small store write per rank every `interval` seconds; nothing per step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from trireme.errors import RankFailure

PACKAGE = str(Path(__file__).resolve().parents[1])  # .../trireme
EXIT_STATUS = 3  # another rank failed (1: a bug, 2: a user error)
# (folder/file, function) -> the operation it waits in; a file alone covers its other functions
OPERATIONS = {
    ("step/data_parallel.py", "finish"): "gradient all-reduce",
    ("step/data_parallel.py", "_launch"): "gradient all-reduce",
    ("step/data_parallel.py", "data_parallel_loss"): "loss all-reduce",
    ("step/data_parallel.py", ""): "gradient all-reduce",
    ("step/grads.py", ""): "gradient sum / norm all-reduce",
    ("optim/distributed.py", "_gather"): "parameter all-gather",
    ("optim/distributed.py", ""): "distributed-optimizer collective",
    ("step/fsdp.py", ""): "FSDP collective",
    ("step/pipeline.py", ""): "pipeline send / receive",
    ("parallel/p2p.py", ""): "pipeline send / receive",
    ("parallel/comm.py", ""): "tensor-parallel collective",
    ("parallel/vocab.py", ""): "tensor-parallel collective",
    ("training/loop.py", "agree"): "stop-flag all-reduce",
    ("step/stragglers.py", ""): "log-step timing gather",
    ("training/loop.py", "moe_of_all_stages"): "log-step collective",
    ("checkpoint/saver.py", ""): "checkpoint save",
    ("checkpoint/sharded.py", ""): "checkpoint collective",
    ("checkpoint/gathered.py", ""): "checkpoint collective",
    ("training/checkpoints.py", ""): "checkpoint collective",
}
IN_STEP = ("step", "optim", "parallel", "models", "ops")  # floors that run inside a step
COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "c10d")


def is_comm_error(error: BaseException) -> bool:
    """An error raised by torch.distributed's backends (not a bug in the model code)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in COMM_WORDS)


def where(frames: list[FrameType]) -> tuple[str, bool]:
    """(operation, inside a training step) from the innermost trireme frame of `frames`."""
    for frame in reversed(frames):
        path = Path(frame.f_code.co_filename)
        if not str(path).startswith(PACKAGE) or path.name == "watchdog.py":
            continue
        in_step = path.parent.name in IN_STEP
        name = f"{path.parent.name}/{path.name}"
        for key in ((name, frame.f_code.co_name), (name, "")):
            if key in OPERATIONS:
                return OPERATIONS[key], in_step
        return f"collective in {path.parent.name}/{path.name}:{frame.f_code.co_name}", in_step
    return "collective", False


def stack_of(thread_id: int | None) -> list[FrameType]:
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]  # outermost first, like a traceback


class Watchdog:
    """Heartbeats of every rank in `store`, and the one-line report when a rank stops answering
    (module docstring). `progress` is anything with a `step` (the trainer's state)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_minutes: float,
                 progress: object) -> None:
        self.store = dist.PrefixStore("trireme/watchdog", store)
        self.rank, self.world_size = rank, world_size
        self.timeout_minutes = timeout_minutes
        self.interval = min(max(timeout_minutes * 60 / 6, 0.2), 10.0)
        self.progress = progress
        self.beats = 0
        self.terminated = False  # a SIGTERM arrived outside the loop
        self._failing = threading.Lock()
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._sigterm = signal.getsignal(signal.SIGTERM)
        main = threading.current_thread() is threading.main_thread()
        if main and self._sigterm is signal.SIG_DFL:  # the loop handles SIGTERM on its own
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="trireme-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm):
            signal.signal(signal.SIGTERM, self._sigterm)

    def _on_sigterm(self, signum: int, frame) -> None:
        """torchrun stops every rank when one fails: the survivors finish their report first
        (the loop, while it runs, turns SIGTERM into a stop request of its own)."""
        self.terminated = True

    def post_error(self, message: str) -> None:
        """Leave this rank's user error for the rank that reports (it is not printed here)."""
        try:
            self.store.set(f"error/{self.rank}", message)
        except Exception:  # noqa: BLE001  the store is gone: the job is ending anyway
            pass

    def _beat(self) -> None:
        self.beats += 1
        self.store.set(f"beat/{self.rank}", f"{self.beats} {self.progress.step}")

    def _run(self) -> None:
        step, since = self.progress.step, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001  the store is gone: nothing left to watch
                return
            if self.progress.step != step:
                step, since = self.progress.step, time.monotonic()
            elif time.monotonic() - since > self.timeout_minutes * 60 + 4 * self.interval:
                since = time.monotonic()  # all alive and together (a long step): keep watching
                self._thread_failure()

    def _thread_failure(self) -> None:
        """No step for the timeout and the backend did not raise: report and end the process."""
        if not self._failing.acquire(blocking=False):
            return
        error = self.report(stack_of(self._main))
        if error is None:
            self._failing.release()
            return
        if error.report:
            print(f"trireme: error: {error}", file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

    def failure(self, error: BaseException) -> RankFailure | None:
        """The one-line error for a collective that raised `error` in the main thread, or None
        when every rank still answers (then `error` is something else; keep its traceback)."""
        if not is_comm_error(error) or not self._failing.acquire(blocking=False):
            return None
        frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        return self.report(frames)

    def report(self, frames: list[FrameType]) -> RankFailure | None:
        failed, errors = self.diagnose()
        if not failed:
            return None
        operation, in_step = where(frames)
        done = self.progress.step
        when = f"of step {done + 1}" if in_step else f"after step {done}"
        names = ", ".join(str(r) for r in sorted(failed))
        ranks = f"rank {names}" if len(failed) == 1 else f"ranks {names}"
        why = "; ".join(failed[r] if len(failed) == 1 else f"rank {r} {failed[r]}"
                        for r in sorted(failed))
        message = (f"{ranks} did not answer the {operation} {when} within "
                   f"{self.timeout_minutes:g} min ({why})")
        survivors = [r for r in range(self.world_size) if r not in failed]
        # a user error of rank 0 was printed by rank 0 itself
        report = self.rank == min(survivors) and 0 not in errors
        return RankFailure(message, report=report)

    def diagnose(self) -> tuple[dict[int, str], dict[int, str]]:
        """{rank: why} of the ranks that stopped answering, and {rank: their posted error}."""
        first = self._read("beat")
        time.sleep(2.5 * self.interval)
        second, errors = self._read("beat"), self._read("error")
        steps = {r: int(v.split()[1]) for r, v in second.items()}
        ahead = max(steps.values(), default=0)
        failed = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if r in errors:
                failed[r] = f"failed: {errors[r]}"
            elif r not in second or second[r] == first.get(r):
                failed[r] = "frozen or dead"
            elif steps[r] < ahead:
                failed[r] = f"alive but behind at step {steps[r]}"
        return failed, errors

    def _read(self, kind: str) -> dict[int, str]:
        found = {}
        for r in range(self.world_size):
            key = f"{kind}/{r}"
            try:
                if self.store.check([key]):
                    found[r] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001  an unreadable store: the rank counts as silent
                pass
        return found
