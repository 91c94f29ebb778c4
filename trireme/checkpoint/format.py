"""The bytes of a checkpoint: nested state as JSON plus flat tensors, and safetensors files.

Nested state <-> (JSON structure, flat tensors). Plain JSON keeps None, bools, ints, floats (NaN and
infinities included), strings and lists with their types. Everything else is a one-key object whose
key is a tag: {"__tensor__": flat name}, {"__tuple__": [...]}, {"__items__": [[key, value], ...]}
for dicts whose keys are not all plain strings. Plain dicts never have keys starting with "__", so
tags cannot be confused with data.

Files are written through `HashingWriter`, which counts and hashes the bytes as they go, and
fsynced before they count. safetensors files are written by `write_safetensors`, a streaming writer
of the (small, fixed) format: one tensor in host memory at a time, from any device, hashed on the
way. `safetensors.torch.save_file` would need every tensor on the host, contiguous and unshared
first (a second full host copy of the model and optimizer state during a save: about 14 bytes per
parameter in bf16 training with fp32 master weights and Adam moments) and a second read of each
file for its sha256.
Files are read back with the safetensors library itself, which validates what it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from trireme.errors import CheckpointError

# model.safetensors metadata: {name: stored name} for every name, in the order given (tied names
# point at the one stored copy)
NAMES_KEY = "trireme.names"

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_PLAIN = (type(None), bool, int, float, str)


def tensor_identity(t: Tensor) -> tuple[Any, ...] | None:
    """Two tensors with the same identity are the same view of the same memory (tied weights)."""
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class Flattener:
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
        ident = tensor_identity(t)
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


def decode(obj: Any, tensors: dict[str, Tensor], source: Path) -> Any:
    """Inverse of `Flattener.encode`; `source` names the JSON file in error messages."""
    if isinstance(obj, list):
        return [decode(v, tensors, source) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if not any(k.startswith("__") for k in obj):
        return {k: decode(v, tensors, source) for k, v in obj.items()}
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
        return tuple(decode(v, tensors, source) for v in value)
    if tag == _ITEMS:
        return {decode(k, tensors, source): decode(v, tensors, source) for k, v in value}
    raise CheckpointError(
        f"{source}: unknown entry {tag!r}; the checkpoint was written by a newer trireme, upgrade"
    )


def dedupe_model(model: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store tied tensors once: returns the tensors to write and {name: stored name}."""
    stored: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in model.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"model state {name!r} is a {type(t).__qualname__}, not a tensor")
        ident = tensor_identity(t)
        if ident is not None and ident in seen:
            names[name] = seen[ident]
            continue
        stored[name] = t
        names[name] = name
        if ident is not None:
            seen[ident] = name
    return stored, names


# --------------------------------------------------------------------------------------------
# Writing

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


class HashingWriter:
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


def write_file(path: Path, write: Callable[[HashingWriter], None]) -> dict[str, Any]:
    """Write a file through `write`, fsync it, and return its size and sha256."""
    with open(path, "wb") as f:
        w = HashingWriter(f)
        write(w)
        f.flush()
        os.fsync(f.fileno())
    return {"size": w.size, "sha256": w.sha256.hexdigest()}


def write_safetensors(
    f: HashingWriter, tensors: dict[str, Tensor], metadata: dict[str, str]
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


def write_json(f: HashingWriter, obj: Any) -> None:
    f.write(json.dumps(obj, indent=1).encode())


# --------------------------------------------------------------------------------------------
# Reading


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path} is unreadable or corrupted ({e}); load an earlier step"
        ) from None


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
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


def read_model(path: Path) -> dict[str, Tensor]:
    """The model state in its saved order, tied names sharing one tensor."""
    tensors, metadata = read_safetensors(path)
    try:
        names = json.loads(metadata.get(NAMES_KEY, "{}"))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, dict) or any(s not in tensors for s in names.values()):
        raise CheckpointError(f"{path}: its tensor name list is corrupted; load an earlier step")
    model = {name: tensors[stored] for name, stored in names.items()}
    return model | {k: v for k, v in tensors.items() if k not in model}
