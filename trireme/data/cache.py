"""A disk cache for index arrays: `.npy` files in a folder named by a hash of what made them.

`load_or_build(directory, description, build)` returns the arrays stored under the hash of
`description` (a JSON-able dict holding everything that determines them), building them with
`build()` when missing. Safe when several processes ask at once: one builds while the others wait
on a file lock, and the result is written into a private folder that is renamed into place whole,
so a reader never sees a half-written entry (on filesystems without working locks, the rename alone
keeps it correct; the losers of a race just built the same arrays for nothing). An unwritable cache
directory is not an error: the arrays are built in memory, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from trireme.data.corpus import default_cache_root
from trireme.data.indexed import IndexedDataset, temporary_path

CACHE_VERSION = 1
DESCRIPTION_NAME = "description.json"  # written last: its presence marks a complete entry
_FULL_HASH_LIMIT = 64 << 20
_warned: set[str] = set()


def index_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`<cache_dir>/index-cache`; with no cache_dir under ~/.cache/trireme (or $XDG_CACHE_HOME)."""

    return (Path(cache_dir) if cache_dir else default_cache_root()) / "index-cache"


def dataset_fingerprint(dataset: IndexedDataset) -> str:
    """A hash of the dataset's `.idx` (all of it up to 64 MiB; beyond, its size, both ends and
    a strided sample), so a changed or different dataset never reuses another's indices."""
    path = dataset.prefix + ".idx"
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        else:
            half = _FULL_HASH_LIMIT // 2
            digest.update(f.read(half))
            stride = size // 4096
            for k in range(1, 4096):
                f.seek(k * stride)
                digest.update(f.read(64))
            f.seek(size - half)
            digest.update(f.read(half))
    return digest.hexdigest()[:32]


def array_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:32]


def _load(folder: Path, names: list[str]) -> dict[str, np.ndarray]:
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in names}


def _complete(folder: Path) -> bool:
    return (folder / DESCRIPTION_NAME).is_file()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"trireme: warning: {message}", file=sys.stderr)


class _FileLock:
    """An exclusive advisory lock on `path` for the `with` body (a no-op where unsupported)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None

    def __enter__(self) -> _FileLock:
        try:
            import fcntl

            self.file = open(self.path, "a")
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):
            if self.file is not None:
                self.file.close()
            self.file = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the lock


def load_or_build(
    directory: Path | None,
    description: dict,
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The cached arrays for `description`, built (once, by one process) when missing.

    `description` must hold a "kind" (a short name for the folder) and everything the arrays
    depend on. Returns read-only memory maps when cached, or the built arrays when the cache is
    off (`directory` None) or unwritable.
    """
    if directory is None:
        return build()
    text = json.dumps({"cache_version": CACHE_VERSION, **description}, sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    folder = Path(directory) / f"{description['kind']}-{key}"
    if _complete(folder):
        return _load(folder, json.loads((folder / DESCRIPTION_NAME).read_text())["arrays"])
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        lock = _FileLock(Path(directory) / f".{folder.name}.lock")
    except OSError as e:
        _warn_once(f"index cache {directory} is not writable ({e.strerror}); indices are "
                   "built in memory each run (set data.cache_dir)")
        return build()
    with lock:
        if _complete(folder):  # another process built it while we waited
            return _load(folder, json.loads((folder / DESCRIPTION_NAME).read_text())["arrays"])
        arrays = build()
        work = Path(temporary_path(folder))
        try:
            work.mkdir()
            for name, array in arrays.items():
                np.save(work / f"{name}.npy", np.ascontiguousarray(array))
            record = {"description": json.loads(text), "arrays": sorted(arrays)}
            (work / DESCRIPTION_NAME).write_text(json.dumps(record, indent=1) + "\n")
            try:
                os.rename(work, folder)
            except OSError:
                if not _complete(folder):  # a stale, incomplete folder: replace it
                    shutil.rmtree(folder, ignore_errors=True)
                    os.rename(work, folder)
        except OSError as e:
            _warn_once(f"could not write the index cache in {directory} ({e}); "
                       "using the indices built in memory")
            return arrays
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return _load(folder, sorted(arrays))
