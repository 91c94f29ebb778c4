"""Checkpoint save and resume for one process.

A checkpoint is one directory per step under a root:

    root/
      latest                 text file naming the newest checkpoint directory ("step_0000100")
      step_0000100/
        model.safetensors    model state by global parameter name (tied tensors stored once)
        optimizer.safetensors  optimizer tensors, flattened: "exp_avg/layers.0.mlp.fc1.weight"
        optimizer.json       the optimizer state's structure and its non-tensor values
        rng.safetensors      tensors of the trainer state (RNG states)
        trainer.json         the trainer state's structure: step, consumed samples, ...
        config.toml          the resolved config of the run
        meta.json            format version, step, time, versions, and every file's size and sha256

Saving is atomic: everything is written into `root/.tmp-step_0000100-<random>/`, fsynced, renamed
to its final name, and only then does `latest` move (through a temporary file and a rename).
`meta.json` is written last, so a directory without it is incomplete. A crash at any moment leaves
the previous checkpoint loadable.

Loading never executes code: tensors come from safetensors files and everything else from JSON,
decoded by a small tagged format (tuples, non-string dict keys and tensor references are tagged;
see format.py). This module is the public face of the checkpoint package: the training loop imports
save / load / latest, `load_model_state` (model_state.py) and the RNG helpers (rng.py) from here.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trireme import __version__
from trireme.checkpoint import format as fmt
from trireme.checkpoint.model_state import LoadResult, load_model_state
from trireme.checkpoint.rng import capture_rng_state, restore_rng_state
from trireme.errors import CheckpointError

__all__ = [
    "Checkpoint", "LoadResult", "capture_rng_state", "latest_checkpoint", "load_checkpoint",
    "load_model_state", "restore_rng_state", "save_checkpoint", "step_dir_name",
]

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

_STEP_RE = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    """The directory name of a step's checkpoint: step_0000100."""
    return f"step_{step:07d}"



# --------------------------------------------------------------------------------------------
# Atomic file-system steps


def _fsync_dir(path: Path) -> None:
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


# --------------------------------------------------------------------------------------------
# Save


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: dict[str, Tensor],
    optimizer: dict[str, Any],
    trainer: dict[str, Any],
    config_toml: str,
    keep_last: int = 0,
) -> Path:
    """Save a checkpoint atomically to `root/step_XXXXXXX/` and point `root/latest` at it.

    `model` maps global parameter names to tensors; `optimizer` and `trainer` are nested dicts,
    lists and tuples of tensors and plain values. With `keep_last > 0`, only that many most recent
    complete checkpoints are kept (never deleting the one just written). Leftover `.tmp-*` entries
    of interrupted saves are removed, so only one process may save into a root at a time.
    Returns the checkpoint directory.
    """
    if step < 0:
        raise ValueError(f"step must not be negative, got {step}")
    root = Path(root)
    name = step_dir_name(step)
    final = root / name
    # Check and flatten everything before touching the disk, so a bad value leaves nothing behind.
    model_tensors, model_names = fmt.dedupe_model(model)
    opt = fmt.Flattener("optimizer")
    opt_structure = opt.encode(optimizer)
    tr = fmt.Flattener("trainer")
    trainer_structure = tr.encode(trainer)
    model_meta = {fmt.NAMES_KEY: json.dumps(model_names)}

    writers: list[tuple[str, Callable[[fmt.HashingWriter], None]]] = [
        (CONFIG_FILE, lambda f: f.write(config_toml.encode())),
        (TRAINER_JSON, lambda f: fmt.write_json(f, trainer_structure)),
        (RNG_FILE, lambda f: fmt.write_safetensors(f, tr.tensors, {})),
        (OPTIMIZER_JSON, lambda f: fmt.write_json(f, opt_structure)),
        (OPTIMIZER_FILE, lambda f: fmt.write_safetensors(f, opt.tensors, {})),
        (MODEL_FILE, lambda f: fmt.write_safetensors(f, model_tensors, model_meta)),
    ]
    tmp = root / f"{_TMP_PREFIX}{name}-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        files = {fname: fmt.write_file(tmp / fname, write) for fname, write in writers}
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unix_time": time.time(),
            "trireme_version": __version__, "torch_version": torch.__version__, "files": files,
        }
        # meta.json last: its presence marks the checkpoint complete
        fmt.write_file(tmp / META_FILE, lambda f: fmt.write_json(f, meta))
        _fsync_dir(tmp)
        _publish(tmp, final)
        _write_latest(root, name)
    except OSError as e:
        raise CheckpointError(
            f"could not save checkpoint {final}: {e}; check free space and permissions"
        ) from e
    finally:
        if tmp.exists():  # a failed save, or the replaced old version after an exchange
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        _remove_old(root, keep=final, keep_last=keep_last)
    except OSError as e:  # the new checkpoint is safe; only the clean-up failed
        warnings.warn(f"saved {final}, but could not remove old checkpoints in {root}: {e}",
                      stacklevel=2)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Give the finished directory its final name, replacing an earlier save of the same step.

    After an exchange, `tmp` holds the replaced version and the caller deletes it.
    """
    if not final.exists():
        os.rename(tmp, final)
    elif not _exchange(tmp, final):
        aside = final.parent / f"{_TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(final.parent)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{_TMP_PREFIX}latest-{secrets.token_hex(4)}"
    try:
        fmt.write_file(tmp, lambda f: f.write(f"{name}\n".encode()))
        os.replace(tmp, root / LATEST_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(root)


def _remove_old(root: Path, keep: Path, keep_last: int) -> None:
    """Delete stale temporary entries, and complete checkpoints beyond the newest `keep_last`."""
    doomed: list[Path] = []
    if keep_last > 0:
        complete = [p for _, p in sorted(_step_dirs(root), reverse=True) if _is_complete(p)]
        doomed = [p for p in complete[keep_last:] if p != keep]
    for path in doomed:  # rename first, so a crash mid-delete leaves no half-deleted step_* dir
        aside = root / f"{_TMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, aside)
    for entry in root.iterdir():
        if entry.name.startswith(_TMP_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Find


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_* directory in root, complete or not."""
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = _STEP_RE.fullmatch(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), entry))
    return out


def check_complete(path: Path) -> dict[str, Any]:
    """Return the meta.json of a complete checkpoint directory; raise CheckpointError if not."""
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is incomplete: {META_FILE} is missing (was the save interrupted?); "
            "load an earlier step_* directory or the checkpoint root"
        )
    meta = fmt.read_json(meta_path)
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT
            and isinstance(meta.get("step"), int) and isinstance(meta.get("files"), dict)):
        raise CheckpointError(f"{meta_path} is not a trireme checkpoint meta file")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: checkpoint format version {version!r} is newer than this trireme reads "
            f"({FORMAT_VERSION}); upgrade trireme"
        )
    files = meta["files"]
    sharded = meta.get("checkpoint_format") == "sharded"  # sharded.py: DCP files + rng/*
    for fname in SHARDED_REQUIRED_FILES if sharded else REQUIRED_FILES:
        if fname not in files:
            raise CheckpointError(f"{meta_path} does not list {fname}; the checkpoint is corrupted")
    for fname, info in files.items():
        file = path / fname
        parts = Path(fname).parts
        nested_ok = sharded and len(parts) == 2 and parts[0] == "rng"
        if (Path(fname).name != fname and not nested_ok) or ".." in parts \
                or not isinstance(info, dict):
            raise CheckpointError(f"{meta_path}: bad file entry {fname!r}; the file is corrupted")
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing; the checkpoint is incomplete, load an earlier step"
            )
        size = file.stat().st_size
        if size != info.get("size"):
            raise CheckpointError(
                f"{file} has {size} bytes but {META_FILE} records {info.get('size')}: it is "
                "truncated or corrupted; load an earlier step"
            )
    return meta


def _is_complete(path: Path) -> bool:
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
    if _STEP_RE.fullmatch(name) and _is_complete(root / name):
        return root / name
    for _, path in sorted(_step_dirs(root), reverse=True):
        if _is_complete(path):
            return path
    return None


# --------------------------------------------------------------------------------------------
# Load


@dataclass
class Checkpoint:
    """A checkpoint read back from disk.

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


def load_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Load a checkpoint from a step directory, or from a root (then its latest checkpoint).

    Reads only safetensors and JSON; nothing in the checkpoint is executed. With `verify`, every
    file's sha256 is checked against meta.json (one extra read); sizes are always checked.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check checkpoint.dir")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; give a checkpoint root or a step_* directory"
        )
    if not (path / META_FILE).exists() and not _STEP_RE.fullmatch(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(
                f"no complete checkpoint in {path} (expected step_*/{META_FILE}); "
                "check checkpoint.dir or give a step_* directory"
            )
        path = found
    meta = check_complete(path)
    if meta.get("checkpoint_format") == "sharded":  # every rank's shards: sharded.py
        from trireme.checkpoint import sharded

        return sharded.load_checkpoint(path, meta, verify)
    if verify:
        for fname, info in meta["files"].items():
            if "sha256" in info and fmt.sha256_file(path / fname) != info["sha256"]:
                raise CheckpointError(
                    f"{path / fname} does not match the sha256 in {META_FILE}: it is corrupted; "
                    "load an earlier step"
                )
    model = fmt.read_model(path / MODEL_FILE)
    opt_tensors, _ = fmt.read_safetensors(path / OPTIMIZER_FILE)
    optimizer = fmt.decode(fmt.read_json(path / OPTIMIZER_JSON), opt_tensors, path / OPTIMIZER_JSON)
    rng_tensors, _ = fmt.read_safetensors(path / RNG_FILE)
    trainer = fmt.decode(fmt.read_json(path / TRAINER_JSON), rng_tensors, path / TRAINER_JSON)
    try:
        config_toml = (path / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is unreadable ({e})") from None
    return Checkpoint(step=int(meta["step"]), model=model, optimizer=optimizer, trainer=trainer,
                      config_toml=config_toml, path=path, meta=meta)
