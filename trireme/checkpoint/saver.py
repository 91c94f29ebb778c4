"""The training loop's checkpoint writer: the configured format, blocking or in the background.

`checkpoint.async_save` (sharded format): `save` does the collective planning in the foreground
(temporary directory name, each rank's RNG file), copies this rank's pieces to CPU (pinned host
buffers allocated by the first save and reused: memory for one checkpoint) and returns; a
background thread writes them with torch.distributed.checkpoint over a
separate gloo group (so its collectives never interleave with the training's), and rank 0 then
renames the directory and moves `latest`. At most one save is in flight: the next save, and the
end of training, wait for it. An error in the background is raised by the next `check` (the loop
calls it before every step) as a CheckpointError.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trireme.checkpoint import directory, sharded
from trireme.checkpoint.state import TrainingState
from trireme.checkpoint.tokenizer_copy import keep_tokenizer
from trireme.errors import CheckpointError, ConfigError


class Saver:
    """Saves `run` (checkpoint.state.TrainingState) in the configured format: the sharded one
    here (sharded.py), the gathered one by `save_gathered(run)`."""

    def __init__(self, run: TrainingState,
                 save_gathered: Callable[[TrainingState], Path | None]) -> None:
        c = run.cfg.checkpoint
        if c.async_save and c.format != "sharded":
            raise ConfigError("checkpoint.async_save = true needs checkpoint.format = 'sharded'")
        if c.dir and (run.is_main or c.format == "sharded"):  # the ranks that will write
            directory.check_writable(Path(c.dir))
        self.run = run
        # copied at the first save, so a run that fails its start-up checks writes nothing there
        self._tokenizer_kept = not (c.dir and run.is_main)
        self.save_gathered = save_gathered
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self._staging: dict = {}  # pinned host buffers, reused by every async save
        self.finished_at = 0.0  # time.perf_counter() when the last background save ended

    def group(self):
        """A gloo group of all ranks for the checkpoint's collectives (None in one process)."""
        if self.run.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank saves here
        return self._group

    @property
    def made_group(self):
        """The gloo group `group()` made (None before its first use)."""
        return self._group

    def save(self) -> Path | None:
        """Save now (blocking), or start a background save; returns the path when it is known."""
        self.wait()
        run, c = self.run, self.run.cfg.checkpoint
        if not self._tokenizer_kept:  # generate and convert find it there (tokenizer_copy.py)
            keep_tokenizer(Path(c.dir), run.cfg.data.tokenizer)
            self._tokenizer_kept = True
        if c.format == "gathered":
            self.last_path = self.save_gathered(run)
            return self.last_path
        group = self.group()
        job = sharded.prepare(run, Path(c.dir), group)
        if not c.async_save:
            self.last_path = sharded.write(job)
            if run.world_size > 1:
                dist.barrier(group=group)  # the checkpoint is complete before any rank goes on
            return self.last_path
        job["entries"] = sharded.staged(job["entries"], self._staging)
        self._thread = threading.Thread(target=self._write, args=(job,), name="trireme-save",
                                        daemon=True)
        self._thread.start()
        return None

    def _write(self, job) -> None:
        if self.run.device.type == "cuda":  # a new thread starts on GPU 0: stay on ours
            torch.cuda.set_device(self.run.device)
        try:
            self.last_path = sharded.write(job)
        except BaseException as e:  # handed to the training thread by check()
            self._error = e
        finally:
            self.finished_at = time.perf_counter()

    def check(self) -> None:
        """Raise the error of a finished background save, once."""
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint save failed: {sharded.reason(error)}"
                                  ) from error

    def wait(self) -> None:
        """Wait for the save in flight, then raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def close(self) -> None:
        """Wait for a save in flight without raising: the loop is ending on an error of its own,
        and the checkpoint being written must still be completed. A failure of that save is
        reported on stderr."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            print(f"trireme: the background checkpoint save failed too: "
                  f"{sharded.reason(self._error)}", file=sys.stderr, flush=True)
            self._error = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
