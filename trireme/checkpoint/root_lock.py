"""One training run per checkpoint root at a time.

A second run started on a `checkpoint.dir` that a live run is saving into (a requeued job whose
first instance still runs, the same command started twice) would resume from the first run's
checkpoints, save over its step directories and delete its save in progress as a leftover. While a
run trains, global rank 0 holds an exclusive `flock` on the root directory itself (no file is
added to the root); a second run stops at start-up with one line. The kernel drops the lock when
the process ends, however it ends (kill -9 included), so a crashed run never blocks the next one.
A file system whose directories take no flock (NFS emulates flock with POSIX locks, which a
directory cannot take; Lustre without its flock mount option) holds nothing, as before.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trireme.errors import CheckpointError


@contextmanager
def exclusive(root: Path | None) -> Iterator[None]:
    """Hold a lock on the directory `root` for the duration of the block (nothing for None); a
    CheckpointError if another process holds it."""
    fd = _acquire(root) if root is not None else None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _acquire(root: Path) -> int | None:
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # an unwritable root was reported at start-up already
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"checkpoint.dir {root} is in use by another training run (a process holds its "
            "lock): two runs saving there would overwrite each other's checkpoints; stop that "
            "run first, or give this one another checkpoint.dir") from None
    except OSError:  # a file system without locks on directories: nothing to hold
        os.close(fd)
        return None
    return fd
