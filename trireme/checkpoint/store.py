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
decoded by a small tagged format (tuples, non-string dict keys and tensor references are tagged).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import struct
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from trireme import __version__
from trireme.errors import CheckpointError

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

_STEP_RE = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp-"
# model.safetensors metadata: {name: stored name} for every name, in the order given (tied names
# point at the one stored copy)
_NAMES_KEY = "trireme.names"


def step_dir_name(step: int) -> str:
    """The directory name of a step's checkpoint: step_0000100."""
    return f"step_{step:07d}"


# --------------------------------------------------------------------------------------------
# Nested state <-> (JSON structure, flat tensors)
#
# Plain JSON keeps None, bools, ints, floats (NaN and infinities included), strings and lists with
# their types. Everything else is a one-key object whose key is a tag: {"__tensor__": flat name},
# {"__tuple__": [...]}, {"__items__": [[key, value], ...]} for dicts whose keys are not all plain
# strings. Plain dicts never have keys starting with "__", so tags cannot be confused with data.

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_PLAIN = (type(None), bool, int, float, str)


def _identity(t: Tensor) -> tuple[Any, ...] | None:
    """Two tensors with the same identity are the same view of the same memory (tied weights)."""
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _Flattener:
    """Turns a nested state into a JSON-able structure plus a flat dict of tensors."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.tensors: dict[str, Tensor] = {}
        self._seen: dict[tuple[Any, ...], str] = {}

    def encode(self, obj: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(obj, Tensor):
            return {_TENSOR: self._add(obj, path)}
        if type(obj) in _PLAIN:
            return obj
        if type(obj) is list:
            return [self.encode(v, (*path, str(i))) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {_TUPLE: [self.encode(v, (*path, str(i))) for i, v in enumerate(obj)]}
        if type(obj) is dict:
            if all(type(k) is str and not k.startswith("__") for k in obj):
                return {k: self.encode(v, (*path, k)) for k, v in obj.items()}
            return {_ITEMS: [[self._key(k, path), self.encode(v, (*path, str(k)))]
                             for k, v in obj.items()]}
        raise TypeError(
            f"{self.what} state at {'/'.join(path) or '<top>'!r} is a {type(obj).__qualname__}; "
            "checkpoints hold tensors, None, bools, ints, floats, strings and lists, tuples and "
            "dicts of them"
        )

    def _key(self, key: Any, path: tuple[str, ...]) -> Any:
        if type(key) not in _PLAIN:
            raise TypeError(
                f"{self.what} state at {'/'.join(path) or '<top>'!r} has a dict key of type "
                f"{type(key).__qualname__}; keys must be strings, ints, floats, bools or None"
            )
        return key

    def _add(self, t: Tensor, path: tuple[str, ...]) -> str:
        ident = _identity(t)
        if ident is not None and ident in self._seen:
            return self._seen[ident]  # the same tensor again: store it once
        name = "/".join(path) or "."
        if name in self.tensors:
            raise ValueError(
                f"{self.what} state: two tensors flatten to the same name {name!r}; "
                "avoid '/' in dict keys"
            )
        self.tensors[name] = t
        if ident is not None:
            self._seen[ident] = name
        return name


def _decode(obj: Any, tensors: dict[str, Tensor], source: Path) -> Any:
    """Inverse of `_Flattener.encode`; `source` names the JSON file in error messages."""
    if isinstance(obj, list):
        return [_decode(v, tensors, source) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if not any(k.startswith("__") for k in obj):
        return {k: _decode(v, tensors, source) for k, v in obj.items()}
    (tag, value), *rest = obj.items()
    if rest:
        raise CheckpointError(f"{source}: malformed entry {obj!r}; the file is corrupted")
    if tag == _TENSOR:
        if value not in tensors:
            raise CheckpointError(
                f"{source} refers to tensor {value!r}, which its .safetensors file lacks; "
                "the checkpoint is corrupted, load an earlier step"
            )
        return tensors[value]
    if tag == _TUPLE:
        return tuple(_decode(v, tensors, source) for v in value)
    if tag == _ITEMS:
        return {_decode(k, tensors, source): _decode(v, tensors, source) for k, v in value}
    raise CheckpointError(
        f"{source}: unknown entry {tag!r}; the checkpoint was written by a newer trireme, upgrade"
    )


# --------------------------------------------------------------------------------------------
# Writing files: hashed as they are written, fsynced before they count

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


class _HashingWriter:
    """A binary file wrapper that counts and hashes what is written through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.size = 0
        self.sha256 = hashlib.sha256()

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.f.write(view)
        self.sha256.update(view)
        self.size += len(view)


def _write_file(path: Path, write: Callable[[_HashingWriter], None]) -> dict[str, Any]:
    """Write a file through `write`, fsync it, and return its size and sha256."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        write(w)
        f.flush()
        os.fsync(f.fileno())
    return {"size": w.size, "sha256": w.sha256.hexdigest()}


def _write_safetensors(
    f: _HashingWriter, tensors: dict[str, Tensor], metadata: dict[str, str]
) -> None:
    """Stream `tensors` to `f` in the safetensors format, one tensor in memory at a time.

    Tensors are ordered by element size (largest first), then name, so that each one starts at a
    multiple of its element size and can be memory-mapped in place. Storage shared between tensors
    is no obstacle: every tensor's bytes are copied out on their own.
    """
    if "__metadata__" in tensors:
        raise ValueError("'__metadata__' is reserved by safetensors and cannot name a tensor")
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in names:  # raw little-endian bytes, as safetensors specifies (every torch host is LE)
        t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        f.write(t.view(torch.uint8).numpy())


def _write_json(f: _HashingWriter, obj: Any) -> None:
    f.write(json.dumps(obj, indent=1).encode())


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


def _dedupe_model(model: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store tied tensors once: returns the tensors to write and {name: stored name}."""
    stored: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in model.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"model state {name!r} is a {type(t).__qualname__}, not a tensor")
        ident = _identity(t)
        if ident is not None and ident in seen:
            names[name] = seen[ident]
            continue
        stored[name] = t
        names[name] = name
        if ident is not None:
            seen[ident] = name
    return stored, names


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
    model_tensors, model_names = _dedupe_model(model)
    opt = _Flattener("optimizer")
    opt_structure = opt.encode(optimizer)
    tr = _Flattener("trainer")
    trainer_structure = tr.encode(trainer)
    model_meta = {_NAMES_KEY: json.dumps(model_names)}

    writers: list[tuple[str, Callable[[_HashingWriter], None]]] = [
        (CONFIG_FILE, lambda f: f.write(config_toml.encode())),
        (TRAINER_JSON, lambda f: _write_json(f, trainer_structure)),
        (RNG_FILE, lambda f: _write_safetensors(f, tr.tensors, {})),
        (OPTIMIZER_JSON, lambda f: _write_json(f, opt_structure)),
        (OPTIMIZER_FILE, lambda f: _write_safetensors(f, opt.tensors, {})),
        (MODEL_FILE, lambda f: _write_safetensors(f, model_tensors, model_meta)),
    ]
    tmp = root / f"{_TMP_PREFIX}{name}-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        files = {fname: _write_file(tmp / fname, write) for fname, write in writers}
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unix_time": time.time(),
            "trireme_version": __version__, "torch_version": torch.__version__, "files": files,
        }
        _write_file(tmp / META_FILE, lambda f: _write_json(f, meta))  # last: marks it complete
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
        _write_file(tmp, lambda f: f.write(f"{name}\n".encode()))
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path} is unreadable or corrupted ({e}); load an earlier step"
        ) from None


def _check_complete(path: Path) -> dict[str, Any]:
    """Return the meta.json of a complete checkpoint directory; raise CheckpointError if not."""
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is incomplete: {META_FILE} is missing (was the save interrupted?); "
            "load an earlier step_* directory or the checkpoint root"
        )
    meta = _read_json(meta_path)
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
    for fname in REQUIRED_FILES:
        if fname not in files:
            raise CheckpointError(f"{meta_path} does not list {fname}; the checkpoint is corrupted")
    for fname, info in files.items():
        file = path / fname
        if Path(fname).name != fname or not isinstance(info, dict):
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
        _check_complete(path)
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """All tensors (on CPU) and the metadata of a safetensors file, with errors naming the file."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path} is truncated or corrupted ({e}); load an earlier step"
        ) from None
    return tensors, metadata


def _read_model(path: Path) -> dict[str, Tensor]:
    """The model state in its saved order, tied names sharing one tensor."""
    tensors, metadata = _read_safetensors(path)
    try:
        names = json.loads(metadata.get(_NAMES_KEY, "{}"))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, dict) or any(s not in tensors for s in names.values()):
        raise CheckpointError(f"{path}: its tensor name list is corrupted; load an earlier step")
    model = {name: tensors[stored] for name, stored in names.items()}
    return model | {k: v for k, v in tensors.items() if k not in model}


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
    meta = _check_complete(path)
    if verify:
        for fname, info in meta["files"].items():
            if "sha256" in info and _sha256(path / fname) != info["sha256"]:
                raise CheckpointError(
                    f"{path / fname} does not match the sha256 in {META_FILE}: it is corrupted; "
                    "load an earlier step"
                )
    model = _read_model(path / MODEL_FILE)
    opt_tensors, _ = _read_safetensors(path / OPTIMIZER_FILE)
    optimizer = _decode(_read_json(path / OPTIMIZER_JSON), opt_tensors, path / OPTIMIZER_JSON)
    rng_tensors, _ = _read_safetensors(path / RNG_FILE)
    trainer = _decode(_read_json(path / TRAINER_JSON), rng_tensors, path / TRAINER_JSON)
    try:
        config_toml = (path / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is unreadable ({e})") from None
    return Checkpoint(step=int(meta["step"]), model=model, optimizer=optimizer, trainer=trainer,
                      config_toml=config_toml, path=path, meta=meta)


# --------------------------------------------------------------------------------------------
# Model state


class LoadResult(NamedTuple):
    """Keys skipped by a non-strict `load_model_state`."""

    missing: list[str]
    unexpected: list[str]


def _listing(label: str, items: list[str], limit: int = 8) -> str:
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"{label}: {', '.join(items[:limit])}{more}"


def load_model_state(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> LoadResult:
    """Copy `state` into the model's parameters and persistent buffers by name.

    Values are converted to each parameter's dtype and device. Nothing is copied unless everything
    fits: shape mismatches always raise, and with `strict` so do missing and unexpected keys, all
    listed in one CheckpointError. Tied parameters (one tensor under several names) are satisfied by
    any of their names; if the state holds several of them, they must agree.
    """
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, Tensor)}
    groups: dict[int, list[str]] = {}  # one entry per distinct tensor: all its names
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    missing: list[str] = []
    mismatched: list[str] = []
    conflicting: list[str] = []
    copies: list[tuple[Tensor, Tensor]] = []
    for names in groups.values():
        present = [n for n in names if n in state]
        if not present:
            missing.extend(names)
            continue
        target = targets[names[0]]
        shapes_fit = True
        for n in present:
            value = state[n]
            if not isinstance(value, Tensor):
                raise CheckpointError(
                    f"model state {n!r} is a {type(value).__qualname__}, not a tensor"
                )
            if tuple(value.shape) != tuple(target.shape):
                shapes_fit = False
                mismatched.append(
                    f"{n}: checkpoint {tuple(value.shape)} vs model {tuple(target.shape)}"
                )
        first = state[present[0]]
        if shapes_fit and any(_identity(state[n]) != _identity(first)
                              and not torch.equal(state[n], first) for n in present[1:]):
            conflicting.append("=".join(present))
        copies.append((target, first))
    unexpected = [n for n in state if n not in targets]
    problems = []
    if strict and missing:
        problems.append(_listing("missing keys", missing))
    if strict and unexpected:
        problems.append(_listing("unexpected keys", unexpected))
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    if conflicting:
        problems.append(_listing("tied in the model but different in the checkpoint", conflicting))
    if problems:
        raise CheckpointError(
            "checkpoint does not fit the model: " + "; ".join(problems)
            + " (was it saved with a different model config? compare its config.toml)"
        )
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value)
    return LoadResult(missing=missing, unexpected=unexpected)


# --------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a run uses: torch CPU, each CUDA device, Python, numpy.

    The result is a plain nested dict of tensors and numbers that `save_checkpoint` can store (for
    example as `trainer["rng"]`).
    """
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": str(name), "key": torch.from_numpy(np.array(key, dtype=np.uint32)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generators captured by `capture_rng_state`.

    Parts that are absent are left alone; CUDA states are restored for the devices present (a
    checkpoint saved on GPUs can be resumed on CPU, without its CUDA states).
    """
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(device="cpu", dtype=torch.uint8))
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["name"], s["key"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.to(device="cpu", dtype=torch.uint8), i)
