"""A checkpoint root on disk, shared by both formats (store.py: gathered, sharded.py: sharded).

    root/
      latest           text file naming the newest checkpoint directory ("step_0000100")
      step_0000100/    one directory per step; meta.json, written last, marks it complete
      .tmp-...         a save in progress (or left by a crash); removed by the next save

Publishing a save is the same protocol for both formats: the files go into a temporary
directory `root/.tmp-step_0000100-<token>` (`temporary_dir`), which is fsynced and renamed to
its final name (`publish`), and only then does `latest` move (`write_latest`, through a
temporary file and a rename); `remove_old` then applies the retention. A crash at any moment
leaves the previous checkpoint loadable. `check_complete` and `latest_checkpoint` find what is
safe to load, and `Checkpoint` is what loading either format returns.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trireme import __version__
from trireme.checkpoint import format as fmt
from trireme.errors import CheckpointDamageError, CheckpointError

FORMAT = "trireme-checkpoint"
FORMAT_VERSION = 1

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_FILE = "rng.safetensors"
TRAINER_JSON = "trainer.json"
CONFIG_FILE = "config.toml"
META_FILE = "meta.json"
LATEST_FILE = "latest"
REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_JSON, RNG_FILE, TRAINER_JSON, CONFIG_FILE)
SHARDED_REQUIRED_FILES = (".metadata", TRAINER_JSON, CONFIG_FILE)

STEP_RE = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"  # every entry of a root whose name starts so is temporary


def step_dir_name(step: int) -> str:
    """The directory name of a step's checkpoint: step_0000100."""
    return f"step_{step:07d}"


def temporary_dir(root: Path, step: int, token: str) -> Path:
    """Where a save of `step` writes before `publish` renames it: root/.tmp-step_0000100-<token>
    (`token` keeps concurrent or crashed saves of the same step apart)."""
    return root / f"{TMP_PREFIX}{step_dir_name(step)}-{token}"


def meta_record(step: int, files: dict[str, Any], checkpoint_format: str | None = None
                ) -> dict[str, Any]:
    """The content of meta.json: format and versions, step, time, and every file's record.
    `checkpoint_format` is set for the sharded format only (the gathered one has none)."""
    meta: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
    if checkpoint_format is not None:
        meta["checkpoint_format"] = checkpoint_format
    meta.update({
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unix_time": time.time(),
        "trireme_version": __version__, "torch_version": torch.__version__, "files": files,
    })
    return meta


# --------------------------------------------------------------------------------------------
# Atomic file-system steps


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE).

    Returns False where the OS or file system does not support it; the caller then falls back to two
    renames, which leave a moment in which neither version has the final name.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p] * 2 + [ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def publish(tmp: Path, final: Path) -> None:
    """Give the finished directory its final name, replacing an earlier save of the same step.

    After an exchange, `tmp` holds the replaced version and the caller deletes it.
    """
    if not final.exists():
        os.rename(tmp, final)
    elif not _exchange(tmp, final):
        aside = final.parent / f"{TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(final.parent)


def check_writable(root: Path) -> None:
    """Create `root` if needed and a file in it, so that a run whose checkpoint directory cannot
    be written fails at start-up, not at its first save."""
    probe = root / f"{TMP_PREFIX}probe-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir {root} is not writable ({e.strerror or e}); give a directory this "
            "process can create and write, or fix its permissions") from None


def free_space(path: Path) -> str:
    """How much space the file system holding `path` (or its nearest existing parent) has
    left, for an error message ("12.3 MB free"), "" if it cannot be told."""
    for place in (path, *path.parents):
        if place.exists():
            try:
                free = shutil.disk_usage(place).free
            except OSError:
                return ""
            for unit in ("B", "kB", "MB", "GB", "TB"):
                if free < 1000 or unit == "TB":
                    return f"{free:.1f} {unit} free" if unit != "B" else f"{free} B free"
                free /= 1000
    return ""


def save_failure(final: Path, why: object) -> str:
    """The one-line message of a save that failed: the reason and the free space left."""
    free = free_space(final.parent)
    return (f"could not save checkpoint {final}: {why}; check free space"
            f"{f' ({free} on its file system)' if free else ''} and permissions")


def write_latest(root: Path, name: str) -> None:
    """Point `root/latest` at the checkpoint directory `name` (atomically: a temporary file and
    a rename), the last step of a save."""
    tmp = root / f"{TMP_PREFIX}latest-{secrets.token_hex(4)}"
    try:
        fmt.write_file(tmp, lambda f: f.write(f"{name}\n".encode()))
        os.replace(tmp, root / LATEST_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(root)


def remove_old(root: Path, keep: Path, keep_last: int) -> None:
    """Delete stale temporary entries, and complete checkpoints beyond the newest `keep_last`
    (0: keep all), never `keep`. Only one process may save into a root at a time."""
    doomed: list[Path] = []
    if keep_last > 0:
        complete = [p for _, p in sorted(step_dirs(root), reverse=True) if is_complete(p)]
        doomed = [p for p in complete[keep_last:] if p != keep]
    for path in doomed:  # rename first, so a crash mid-delete leaves no half-deleted step_* dir
        aside = root / f"{TMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, aside)
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Find


def foreign_format(path: Path) -> str | None:
    """"hf" for a Hugging Face model folder, "megatron" for a Megatron-LM checkpoint (a root,
    an iter_* directory, a torch_dist iteration), else None: what a path that holds no trireme
    checkpoint may be instead."""
    if (path / "config.json").is_file():
        return "hf"
    if ((path / "latest_checkpointed_iteration.txt").is_file() or any(path.glob("mp_rank_*"))
            or any(path.glob("iter_*/mp_rank_*"))
            or ((path / "metadata.json").is_file() and (path / ".metadata").is_file())):
        return "megatron"
    return None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_* directory in root, complete or not."""
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = STEP_RE.fullmatch(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), entry))
    return out


def _file_problem(path: Path, fname: str, info: Any, sharded: bool, hashes: bool) -> str | None:
    """What is wrong with one file meta.json lists (a short clause naming it), or None."""
    parts = Path(fname).parts
    nested_ok = sharded and len(parts) == 2 and parts[0] == "rng"
    if (Path(fname).name != fname and not nested_ok) or ".." in parts or not isinstance(info, dict):
        return f"{META_FILE} has a bad file entry {fname!r} (the file is corrupted)"
    file = path / fname
    try:
        if not file.is_file():
            return f"{fname} is missing"
        size = file.stat().st_size
    except OSError as e:  # e.g. no permission to enter a directory of the checkpoint
        return unreadable(fname, e)
    if size != info.get("size"):
        return (f"{fname} has {size} bytes but {META_FILE} records {info.get('size')} "
                "(truncated or corrupted)")
    return digest_problem(path, fname, info["sha256"]) if hashes and "sha256" in info else None


def digest_problem(path: Path, fname: str, sha256: str) -> str | None:
    """Whether `path/fname` has the sha256 meta.json records (None), else a short clause: it
    differs, or the file cannot be read (no permission, an I/O error)."""
    try:
        if fmt.sha256_file(path / fname) == sha256:
            return None
    except OSError as e:
        return unreadable(fname, e)
    return f"{fname} is corrupted: its sha256 does not match {META_FILE}"


def unreadable(fname: str, e: OSError) -> str:
    """E.g. '__0_0.distcp is unreadable (Permission denied: check its permissions)'."""
    return f"{fname} is unreadable ({e.strerror or e}: check its permissions)"


def file_problems(path: Path, meta: dict[str, Any], hashes: bool = False) -> list[str]:
    """What is wrong with the files of a checkpoint directory whose meta.json is `meta`: a file
    missing, of another size than recorded or (with `hashes`) of another sha256; [] if none."""
    files = meta["files"]
    sharded = meta.get("checkpoint_format") == "sharded"  # sharded.py: DCP files + rng/*
    problems = [f"{META_FILE} does not list {fname} (the checkpoint is corrupted)"
                for fname in (SHARDED_REQUIRED_FILES if sharded else REQUIRED_FILES)
                if fname not in files]
    for fname, info in files.items():
        problem = _file_problem(path, fname, info, sharded, hashes)
        if problem is not None:
            problems.append(problem)
    return problems


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a checkpoint directory; CheckpointDamageError if missing or malformed."""
    meta_path = path / META_FILE
    try:
        present = meta_path.is_file()
    except OSError as e:  # the step directory itself cannot be entered
        raise CheckpointDamageError(path, unreadable(META_FILE, e)) from None
    if not present:
        raise CheckpointDamageError(
            path, f"{META_FILE} is missing (the save did not finish, or the file was removed)",
            "load an earlier step_* directory or the checkpoint root")
    try:
        meta = fmt.read_json(meta_path)
    except CheckpointError:
        raise CheckpointDamageError(path, f"{META_FILE} is unreadable or corrupted") from None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT
            and isinstance(meta.get("step"), int) and isinstance(meta.get("files"), dict)):
        raise CheckpointDamageError(path, f"{META_FILE} is not a trireme checkpoint meta file")
    return meta


def check_complete(path: Path, hashes: bool = False) -> dict[str, Any]:
    """Return the meta.json of a complete checkpoint directory (every file present with its
    recorded size, and with `hashes` its sha256); raise CheckpointDamageError naming the first
    damaged file if not."""
    meta = read_meta(path)
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path / META_FILE}: checkpoint format version {version!r} is newer than this "
            f"trireme reads ({FORMAT_VERSION}); upgrade trireme"
        )
    problems = file_problems(path, meta, hashes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointDamageError(path, problems[0] + more)
    return meta


def is_complete(path: Path) -> bool:
    """Whether `path` is a complete checkpoint directory (`check_complete` passes)."""
    try:
        check_complete(path)
    except CheckpointError:
        return False
    return True


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory in `root`, or None if there is none.

    That is the directory named by `root/latest` if it is complete (meta.json present and every
    file of the recorded size), else the complete step_* directory with the highest step.
    """
    root = Path(root)
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if STEP_RE.fullmatch(name) and is_complete(root / name):
        return root / name
    for _, path in sorted(step_dirs(root), reverse=True):
        if is_complete(path):
            return path
    return None


# --------------------------------------------------------------------------------------------
# What loading returns


@dataclass
class Checkpoint:
    """A checkpoint read back from disk (either format, in the gathered form).

    `model` maps global names to CPU tensors (tied names map to the same tensor); `optimizer` and
    `trainer` are the nested states as they were given to `save_checkpoint`, with tensors on CPU.
    """

    step: int
    model: dict[str, Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]
    config_toml: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
