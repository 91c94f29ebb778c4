"""Reading the pickles other tools leave behind, without ever running code from them.

Two kinds of file need it, both written by other programs:

- Megatron's legacy `model_optim_rng.pt` (a `torch.save` zip; also the common state inside a
  torch_dist checkpoint). It is read with `torch.load(weights_only=True)`, torch's restricted
  unpickler, which only builds tensors, containers and numbers. Megatron's pickle also names a few
  classes of its own, argparse's `Namespace`, numpy arrays and `signal.Signals`; torch refuses
  those by default. We list the globals first (a static scan, nothing runs), refuse the file if
  any is outside a small allow-list, and hand torch an inert stand-in for each allowed one: a class
  of ours that only records the arguments and state the pickle gives it. Nothing from Megatron,
  numpy or argparse is imported or called.
- torch.distributed.checkpoint's `.metadata` (a plain pickle of its metadata dataclasses). torch's
  own reader calls `pickle.load` on it; we use `RestrictedUnpickler`, whose `find_class` resolves
  only an explicit list of torch's metadata classes and dtypes.
"""

from __future__ import annotations

import importlib
import io
import pickle  # only for RestrictedUnpickler; never pickle.load / pickle.loads
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trireme.errors import CheckpointError

# Globals a Megatron checkpoint may name, replaced by inert stand-ins (never imported).
INERT_NAMES = frozenset({
    "argparse.Namespace",
    "signal.Signals",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
})
# Whole namespaces of inert data classes: Megatron's enums and configs, numpy's dtype classes.
INERT_PREFIXES = ("megatron.", "numpy.dtypes.")


class Inert:
    """A stand-in for an object of a class that is never imported: it keeps what the pickle gave.

    `name` is the global the pickle named, `args` the constructor / reduce arguments, `state` what
    BUILD handed over (for an argparse.Namespace: the dict of arguments).
    """

    name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        self = super().__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.name} {self.args!r}>"


def _stand_in(full_name: str) -> type[Inert]:
    return type(full_name.rsplit(".", 1)[-1], (Inert,), {"name": full_name})


def is_allowed(full_name: str) -> bool:
    return full_name in INERT_NAMES or full_name.startswith(INERT_PREFIXES)


def load_torch_file(path: Path) -> Any:
    """Load a `torch.save` file (tensors memory-mapped, on CPU) with the inert stand-ins.

    Raises CheckpointError naming the file if it is not a torch zip file, is corrupted, or names a
    global outside the allow-list (which is then never touched).
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    return _load(path, str(path))


def load_torch_bytes(data: bytes, label: str) -> Any:
    """`load_torch_file` for a `torch.save` blob held in memory; `label` names it in errors."""
    return _load(io.BytesIO(data), label)


def _load(source: Path | io.BytesIO, label: str) -> Any:
    if not zipfile.is_zipfile(source):
        raise CheckpointError(
            f"{label} is not a torch zip file (truncated, corrupted, or saved in the legacy "
            "non-zip torch format, which this loader does not read)"
        )
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception as e:  # noqa: BLE001 - any failure to parse the file is a bad file
        raise CheckpointError(f"{label} is truncated or corrupted ({e})") from None
    refused = sorted(n for n in names if not is_allowed(n))
    if refused:
        raise CheckpointError(
            f"{label} refers to {', '.join(refused)}, which a checkpoint has no business "
            "naming; refusing to load it (nothing was executed)"
        )
    stand_ins = [(_stand_in(n), n) for n in names]
    mmap = isinstance(source, Path)
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - corrupted zip members, bad storages, refused opcodes
        raise CheckpointError(
            f"{label} is truncated, corrupted or not safely loadable (nothing was executed): "
            f"{type(e).__name__}: {e}"
        ) from None


def namespace_dict(value: Any) -> dict[str, Any]:
    """The attributes of an argparse.Namespace read through `load_torch_file` (or a real one)."""
    if isinstance(value, Inert):
        return dict(value.state or {})
    if isinstance(value, dict):
        return dict(value)
    return dict(getattr(value, "__dict__", {}))


# --------------------------------------------------------------------------------------------
# torch.distributed.checkpoint metadata

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}


def _dcp_allowed() -> dict[tuple[str, str], Any]:

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    for module_name, names in _DCP_CLASSES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                allowed[(module_name, name)] = getattr(module, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed`; anything else is refused."""

    def __init__(self, file: BinaryIO, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def load_dcp_metadata(path: Path, tensors_only: bool = False) -> Any:
    """torch.distributed.checkpoint's `Metadata` from a `.metadata` file, without running code,
    checked to have the shape DCP's own code relies on (a tampered file that builds the allowed
    classes with other contents is a CheckpointError, not an AttributeError later). With
    `tensors_only` (trireme's checkpoints hold tensors only) a non-tensor entry is refused too."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the torch_dist checkpoint is incomplete")
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f, _dcp_allowed()).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is truncated, corrupted or not dcp metadata ({e})") from None
    if type(metadata).__name__ != "Metadata":
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not dcp Metadata")
    problem = _metadata_problem(metadata, tensors_only)
    if problem is not None:
        raise CheckpointError(f"{path} is corrupted or tampered with: {problem}")
    return metadata


def _dims(value: Any) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def _tensor_problem(key: str, md: Any) -> str | None:
    """What is wrong with one TensorStorageMetadata (its size, dtype and chunks), or None."""
    dcp_md = importlib.import_module("torch.distributed.checkpoint.metadata")
    size = getattr(md, "size", None)
    if not _dims(size):
        return f"{key!r} has no valid size"
    if not isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype):
        return f"{key!r} has no valid dtype"
    chunks = getattr(md, "chunks", None)
    if not isinstance(chunks, list):
        return f"{key!r} has no chunk list"
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (isinstance(chunk, dcp_md.ChunkStorageMetadata) and _dims(offsets)
                and _dims(sizes) and len(offsets) == len(sizes) == len(size)
                and all(o + n <= d for o, n, d in zip(offsets, sizes, size))):
            return f"{key!r} has a chunk outside its shape {tuple(size)}"
    return None


def _metadata_problem(metadata: Any, tensors_only: bool) -> str | None:
    dcp_md = importlib.import_module("torch.distributed.checkpoint.metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return "it has no table of entries"
    for key, md in entries.items():
        if not isinstance(key, str):
            return f"an entry is named by a {type(key).__name__}"
        if isinstance(md, dcp_md.BytesStorageMetadata) and not tensors_only:
            continue
        if not isinstance(md, dcp_md.TensorStorageMetadata):
            return f"entry {key!r} is stored as {type(md).__name__}, not as a tensor"
        problem = _tensor_problem(key, md)
        if problem is not None:
            return problem
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return None
    if not isinstance(storage, dict):
        return "its storage table is not a dict"
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name and Path(name).name == name and name != ".."
                and _dims((getattr(info, "offset", None), getattr(info, "length", None)))):
            return f"a storage record names {name!r}, not a data file beside it"
    return None
