"""`trireme inspect --verify`: is a checkpoint intact, file by file and tensor by tensor?

For each checkpoint directory (a step directory, or every step of a root): meta.json is there and
readable, every file it lists is present with its recorded size and sha256, and every
floating-point tensor (model, optimizer state) is finite. Tensors are read one at a time
(gathered) or in batches of about `BATCH_BYTES` (sharded), so memory stays bounded. Damaged files
are named and their tensors not read.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trireme.checkpoint import directory, sharded
from trireme.checkpoint.dcp_io import DCP_METADATA
from trireme.checkpoint.directory import LATEST_FILE, META_FILE, STEP_RE
from trireme.checkpoint.finite import first_nonfinite
from trireme.checkpoint.safe_pickle import load_dcp_metadata
from trireme.errors import CheckpointDamageError, CheckpointError
from trireme.words import count_of

BATCH_BYTES = 1 << 30


def _gathered_tensors(path: Path, meta: dict) -> tuple[int, list[str]]:
    """(tensors read, problems) of a gathered checkpoint's safetensors files."""
    count, problems = 0, []
    for fname in sorted(f for f in meta["files"] if f.endswith(".safetensors")):
        try:
            with safe_open(str(path / fname), framework="pt", device="cpu") as f:
                for key in f.keys():
                    count += 1
                    if first_nonfinite([(key, f.get_tensor(key))]) is not None:
                        problems.append(f"{fname}: tensor {key} holds NaN/Inf")
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            problems.append(f"{fname} does not decode ({e})")
    return count, problems


def _sharded_tensors(path: Path) -> tuple[int, list[str]]:
    """(tensors read, problems) of a sharded checkpoint, read in batches of whole tensors."""
    stored = load_dcp_metadata(path / DCP_METADATA, tensors_only=True).state_dict_metadata
    batches: list[list[str]] = [[]]
    size = 0
    for key, md in sorted(stored.items()):
        nbytes = math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
        if batches[-1] and size + nbytes > BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(key)
        size += nbytes
    problems = []
    for keys in batches:
        tensors = sharded.load_full_tensors(path, keys=keys)
        problems += [f"tensor {key} holds NaN/Inf" for key, t in tensors.items()
                     if first_nonfinite([(key, t)]) is not None]
    return len(stored), problems


def verify_step(path: Path) -> tuple[list[str], str]:
    """(problems, summary) of one checkpoint directory; no problems means intact."""
    try:
        meta = directory.read_meta(path)
    except CheckpointDamageError as e:
        return [e.problem], ""
    problems = directory.file_problems(path, meta, hashes=True)
    if problems:  # the tensors of damaged files are not read
        return problems, ""
    try:
        if meta.get("checkpoint_format") == sharded.FORMAT_NAME:
            count, problems = _sharded_tensors(path)
        else:
            count, problems = _gathered_tensors(path, meta)
    except CheckpointError as e:
        return [str(e)], ""
    return problems, (f"{count_of(len(meta['files']), 'file')} match the sizes and sha256 in "
                      f"{META_FILE}; {count_of(count, 'tensor')}, all finite")


def _steps(path: Path) -> tuple[list[Path], list[str]]:
    """The checkpoint directories to verify under `path`, and problems of the root itself."""
    if (path / META_FILE).exists() or STEP_RE.fullmatch(path.name):
        return [path], []
    steps = [p for _, p in sorted(directory.step_dirs(path), reverse=True)]
    foreign = {"hf": "a Hugging Face model", "megatron": "a Megatron-LM checkpoint"}.get(
        directory.foreign_format(path) or "")
    if not steps and foreign:
        raise CheckpointError(f"{path} is {foreign}: --verify checks trireme checkpoints "
                              f"(trireme inspect {path} describes it)")
    if not steps:
        raise CheckpointError(f"no checkpoint in {path} (expected step_* directories)")
    problems = []
    try:
        name = (path / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if not (STEP_RE.fullmatch(name) and (path / name).is_dir()):
        problems.append(f"{path / LATEST_FILE} names {name or 'nothing'!r}, not a checkpoint "
                        "directory here")
    return steps, problems


def verify(path: str | Path) -> tuple[list[str], bool]:
    """Lines reporting on every checkpoint at `path` (a root or a step directory), and whether
    anything is damaged."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give a checkpoint root or step_* dir")
    steps, root_problems = _steps(path)
    lines = [f"{p}" for p in root_problems]
    damaged = bool(root_problems)
    for step in steps:
        problems, summary = verify_step(step)
        damaged |= bool(problems)
        lines.append(f"{step}: {'DAMAGED' if problems else 'ok'}" +
                     ("" if problems else f" ({summary})"))
        lines += [f"  {p}" for p in problems]
    return lines, damaged
